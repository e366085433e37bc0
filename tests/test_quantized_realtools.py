"""``parity compare`` on layouts the ecosystems' own tools write, which parity's other quantized tests did not know.

Each was found by running the tool itself on CPU on a trained tiny LLaMA / Qwen2 (d = 256, d_ff 768 / 1024, 3 layers;
the runs and their figures are in docs/compare.md, "Checked on the tools' own files").  The test environment does not
have those tools, so each fixture below writes the layout without them, with the format's own library (mlx,
compressed-tensors), and names the tool and version that wrote the original.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from .derived_checkpoints import build
from .support import compare_json as compare

LAYER1 = "model.layers.1.mlp"


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("realtools")


# --- MLX (mlx-lm 0.32.2's mlx_lm.convert) ------------------------------------------------------------------------

def mlx_quantized(value: torch.Tensor, group: int, bits: int) -> dict[str, torch.Tensor]:
    """``value`` [out, in] as mlx_lm.convert stores it in bfloat16: uint32 weight, scales and biases."""
    mx = pytest.importorskip("mlx.core")
    packed, scales, biases = mx.quantize(mx.array(value.float().numpy()).astype(mx.bfloat16), group_size=group,
                                         bits=bits)
    floats = [torch.from_numpy(np.array(t.astype(mx.float32))).bfloat16() for t in (scales, biases)]
    return {"weight": torch.from_numpy(np.array(packed).view(np.int32)).view(torch.uint32), "scales": floats[0],
            "biases": floats[1]}


def mlx_convert(a: Path, dest: Path, stated: dict, written: dict) -> Path:
    """A's folder as mlx_lm.convert writes it: every decoder weight quantized with ``written[module]`` (default 4-bit
    groups of 64), the rest in bfloat16; config.json's ``quantization`` (and its copy ``quantization_config``) is
    ``stated``."""
    shutil.copytree(a, dest)
    out = {}
    for name, value in load_file(a / "model.safetensors").items():
        module = name.removesuffix(".weight")
        if ".layers." not in name or value.dim() != 2:
            out[name] = value.bfloat16()
            continue
        entry = written.get(module, {"group_size": 64, "bits": 4})
        out.update({f"{module}.{k}": t for k, t in mlx_quantized(value, entry["group_size"], entry["bits"]).items()})
    save_file(out, dest / "model.safetensors", metadata={"format": "mlx"})
    config = json.loads((dest / "config.json").read_text())
    config["quantization"] = config["quantization_config"] = stated
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dest


@pytest.fixture(scope="module")
def llama(root) -> Path:
    # intermediate_size = 2 x hidden_size: an 8-bit matrix of hidden_size inputs read at 4 bits unpacks to exactly
    # intermediate_size values, another width the config states
    return build("llama", root / "llama", 5, num_hidden_layers=3, hidden_size=128, intermediate_size=256,
                 num_key_value_heads=2, head_dim=64)


def test_an_mlx_mixed_recipe_with_null_group_sizes_passes(llama, root, capsys):
    """mlx-lm 0.32.2, ``mlx_lm.convert -q --quant-predicate mixed_3_6`` (no --q-group-size): every module's own entry
    is ``{"group_size": null, "bits": 3 or 6, "mode": "affine"}``, mlx's default group size (64) for the mode.  parity
    read it as exit 2 ('expected a positive integer')."""
    modules = {f"model.layers.{n}.mlp.{p}": {"group_size": None, "bits": 6 if p == "down_proj" else 3,
                                              "mode": "affine"}
               for n in range(3) for p in ("gate_proj", "up_proj", "down_proj")}
    written = {m: {"group_size": 64, "bits": e["bits"]} for m, e in modules.items()}
    b = mlx_convert(llama, root / "mixed", {"group_size": 64, "bits": 4, "mode": "affine", **modules}, written)
    code, report = compare(capsys, llama, b)
    assert code == 0, report
    assert [layer["passed"] for layer in report["layers"]] == [True, True, True]


def test_mlx_bits_stated_wrong_are_named_bits_where_the_misread_width_is_another_config_size(llama, root, capsys):
    """Layer 1's gate_proj written 8-bit, stated 4-bit: read at 4 bits its words hold 256 inputs in groups of 128,
    and 256 is the config's intermediate_size, so a check against every size the config states called it
    mlx_group_size_wrong.  Its own in_features (128, transformers' model) say the bits are wrong."""
    gate = f"{LAYER1}.gate_proj"
    b = mlx_convert(llama, root / "bits", {"group_size": 64, "bits": 4, gate: {"group_size": 64, "bits": 4}},
                    {gate: {"group_size": 64, "bits": 8}})
    code, report = compare(capsys, llama, b)
    assert code == 1, report
    layers = report["layers"]
    assert [layer["passed"] for layer in layers] == [True, False, True]
    assert layers[1]["diagnosis"]["id"] == "mlx_bits_mismatched", layers[1]["diagnosis"]
    assert "fit 8-bit codes" in layers[1]["diagnosis"]["message"]


# --- compressed-tensors pack-quantized, as llm-compressor 0.14.0.1's AWQModifier writes it --------------------------

def awq_scales(tensors: dict[str, torch.Tensor], layers: int, norm: str = "post_attention_layernorm",
               offset: float = 0.0) -> dict[str, torch.Tensor]:
    """AWQ's smoothing as llm-compressor's AWQModifier applies it to LLaMA: each input channel of gate and up times s,
    the norm before them (``norm``) divided by s; up's output rows divided by s2, down's input columns times s2.  The
    ranges are those read off the real export (s 0.50 to 1.99, s2 0.36 to 2.75).  ``offset``: what the model's RMSNorm
    adds to its weight (Gemma's x * (1 + w): 1), the scale dividing that sum, as on llm-compressor's Gemma 3 export."""
    out = dict(tensors)
    generator = torch.Generator().manual_seed(11)
    for layer in range(layers):
        p = f"model.layers.{layer}."
        hidden, inner = out[p + "mlp.gate_proj.weight"].shape[1], out[p + "mlp.up_proj.weight"].shape[0]
        s = torch.exp(torch.empty(hidden).uniform_(-0.7, 0.7, generator=generator))
        s2 = torch.exp(torch.empty(inner).uniform_(-1.0, 1.0, generator=generator))
        out[p + f"{norm}.weight"] = (out[p + f"{norm}.weight"].float() + offset) / s - offset
        for name in ("gate_proj", "up_proj"):
            out[p + f"mlp.{name}.weight"] = out[p + f"mlp.{name}.weight"].float() * s
        out[p + "mlp.up_proj.weight"] = out[p + "mlp.up_proj.weight"] / s2[:, None]
        out[p + "mlp.down_proj.weight"] = out[p + "mlp.down_proj.weight"].float() * s2
    return out


def llmcompressor_awq(a: Path, dest: Path, *, exchanged: bool = False, norm: str = "post_attention_layernorm",
                      offset: float = 0.0) -> Path:
    """A's folder as llm-compressor 0.14.0.1 writes ``oneshot(recipe=AWQModifier(scheme="W4A16_ASYM"))`` with
    ``save_compressed=True``: AWQ's scales folded (above), every decoder Linear int4 asymmetric (groups of 32 here) by
    compressed-tensors' own compressor (weight_packed, bfloat16 weight_scale, int32 weight_zero_point packed along the
    outputs, int64 weight_shape), config_groups' weights with ``zp_dtype "torch.int8"`` and ``actorder null``, ignore
    ["lm_head"]; ``exchanged``: layer 1's gate_proj and up_proj tensors written under each other's names; ``norm``,
    ``offset``: ``awq_scales``'."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = preset_name_to_scheme("W4A16_ASYM", ["Linear"])
    # groups of 32, not the preset's 128: on random N(0, 0.05) weights int4 in groups of 128 moves a layer's output by
    # a third of its largest value, which leaves the layer unverifiable (the trained model's FFN: 3 to 17 %)
    scheme.weights = scheme.weights.model_copy(update={"group_size": 32})
    args = scheme.weights
    shutil.copytree(a, dest)
    out = {}
    for name, value in awq_scales(load_file(a / "model.safetensors"), 3, norm, offset).items():
        if ".layers." not in name or value.dim() != 2:
            out[name] = value.bfloat16()
            continue
        w = value.bfloat16().float()
        tiles = w.reshape(w.shape[0], -1, args.group_size)
        scale, zero = calculate_qparams(tiles.amin(-1), tiles.amax(-1), args)
        state = {"weight": w, "weight_scale": scale.bfloat16(), "weight_zero_point": zero}
        compressed = PackedQuantizationCompressor.compress(state, scheme)
        out.update({f"{name.removesuffix('.weight')}.{key}": t for key, t in compressed.items()})
    if exchanged:
        for part in [k.removeprefix(f"{LAYER1}.gate_proj.") for k in out if k.startswith(f"{LAYER1}.gate_proj.")]:
            gate, up = f"{LAYER1}.gate_proj.{part}", f"{LAYER1}.up_proj.{part}"
            out[gate], out[up] = out[up], out[gate]
    save_file(out, dest / "model.safetensors", metadata={"format": "pt"})
    stated = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"], format="pack-quantized",
                                quantization_status="compressed").model_dump(mode="json")
    stated["config_groups"]["group_0"]["weights"].update(zp_dtype="torch.int8", actorder=None)
    config = json.loads((dest / "config.json").read_text())
    config["quantization_config"] = {**stated, "quant_method": "compressed-tensors", "version": ct.__version__}
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dest


@pytest.fixture(scope="module")
def wide(root) -> Path:
    """A LLaMA whose FFN widths are multiples of 128 (llm-compressor's W4A16 groups)."""
    return build("llama", root / "wide", 6, num_hidden_layers=3, hidden_size=256, intermediate_size=512,
                 num_key_value_heads=2, head_dim=64)


def test_an_llm_compressor_awq_export_passes_and_with_gate_and_up_exchanged_is_named(wide, root, capsys):
    """On the real export (llm-compressor 0.14.0.1, AWQ W4A16_ASYM) gate and up exchanged in layer 1 passed: the fold
    was not recognised on exchanged tensors, and A rounded on B's (the other tensor's) grid set a tolerance loose
    enough (1.5 x min-max's rounding error) for the exchange.  Now the fold is undone and the exchange named."""
    code, report = compare(capsys, wide, llmcompressor_awq(wide, root / "awq"))
    assert code == 0, report
    assert all("folded activation scales (AWQ's, SmoothQuant's) undone" in t["conversion"] for layer in report["layers"]
               for t in layer["conversion"]["tensors"])
    code, report = compare(capsys, wide, llmcompressor_awq(wide, root / "awq-exchanged", exchanged=True))
    assert code == 1, report
    layers = report["layers"]
    assert [layer["passed"] for layer in layers] == [True, False, True]
    assert layers[1]["diagnosis"]["id"] == "gate_up_exchanged", layers[1]["diagnosis"]


def test_an_awq_fold_into_gemmas_one_plus_w_norm_is_undone(root, capsys):
    """llm-compressor 0.14.0.1's AWQ export of the Gemma 3 270M stand-in (model_type gemma3_text) failed on every
    layer: its pre_feedforward_layernorm holds (1 + w) / s - 1, and the norm's offset was looked for in a module
    named after the model_type (transformers.models.gemma3_text, which does not exist: Gemma 3's text model lives in
    gemma3), so no fold was read and up's rows, divided by s2, were judged as they are."""
    gemma = build("gemma3_text", root / "gemma3", 7, num_hidden_layers=3, hidden_size=256, intermediate_size=512,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    b = llmcompressor_awq(gemma, root / "gemma3-awq", norm="pre_feedforward_layernorm", offset=1.0)
    code, report = compare(capsys, gemma, b)
    assert code == 0, report
    assert all("folded activation scales (AWQ's, SmoothQuant's) undone" in t["conversion"]
               and "pre_feedforward_layernorm" in t["conversion"]
               for layer in report["layers"] for t in layer["conversion"]["tensors"])
