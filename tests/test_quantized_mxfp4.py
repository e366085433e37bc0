"""``parity compare A B`` where B is a GPT-OSS release in MXFP4: each expert tensor stored as ``X_blocks`` (two e2m1
codes a byte, the even value in the low nibble) and ``X_scales`` (one e8m0 exponent per 32 input values), config.json's
``quantization_config = {quant_method: "mxfp4", modules_to_not_convert: [...]}``, everything else in bfloat16.

A is a tiny GPT-OSS built with transformers' own classes.  B's blocks and scales are written by ``mlx.core.quantize``
in its mxfp4 mode, whose bytes are the layout GPT-OSS's release stores (its uint32 words, viewed as bytes, are the
16-byte blocks; transformers' own dequantizer reads them back exactly, checked below); faithful, and with one
mistake in layer 1 only.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from .derived_checkpoints import MOE, assert_module_not_stated, build, skip_listed
from .support import compare_json as compare

mx = pytest.importorskip("mlx.core")

SIZES = dict(MOE, hidden_size=64, intermediate_size=64, head_dim=16)
EXPERTS = "model.layers.{}.mlp.experts."
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def mxfp4(param: torch.Tensor, how: str | None = None) -> dict[str, torch.Tensor]:
    """transformers' expert parameter [E, in, out] as GPT-OSS stores it: blocks [E, out, in / 32, 16], scales
    [E, out, in / 32]; mistake ``how``: doubled (every exponent one up), coarse (expert 1's row 3 exponents one up),
    swapped_nibbles (each byte's two codes exchanged), bias128 (exponents written with bias 128: every value halved)."""
    stored = param.float().transpose(1, 2).contiguous()  # [E, out, in]
    packed, scales = mx.quantize(mx.array(stored.to(torch.bfloat16).float().numpy()), mode="mxfp4")
    blocks = np.array(packed).view(np.uint8).reshape(*stored.shape[:2], -1, 16).copy()
    scales = np.array(scales).copy()
    if how == "doubled":
        scales += 1
    if how == "coarse":
        scales[1, 3] += 1
    if how == "swapped_nibbles":
        blocks = (blocks >> 4) | (blocks << 4)
    if how == "bias128":
        scales -= 1
    return {"_blocks": torch.from_numpy(blocks), "_scales": torch.from_numpy(scales)}


def release(a: Path, dest: Path, breaks: dict[str, str] | None = None) -> Path:
    """A's folder as GPT-OSS's release stores it: the experts' gate_up_proj and down_proj in MXFP4, their biases and
    every other tensor in bfloat16; ``breaks``: tensor name -> a mistake of ``mxfp4``."""
    breaks = breaks or {}
    shutil.copytree(a, dest)
    out = {}
    for name, value in load_file(a / "model.safetensors").items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out.update({name + part: t for part, t in mxfp4(value, breaks.get(name)).items()})
        else:
            out[name] = value.to(torch.bfloat16)
    save_file(out, dest / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dest / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dest


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mxfp4")


@pytest.fixture(scope="module")
def model_a(root) -> Path:
    return build("gpt_oss", root / "a", 4, **SIZES)


def test_mlx_bytes_are_the_layout_transformers_dequantizes(model_a):
    """The writer's premise: mlx's mxfp4 words viewed as bytes are GPT-OSS's blocks, read by transformers'
    convert_moe_packed_tensors to exactly mlx's own dequantized values."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    param = load_file(model_a / "model.safetensors")[EXPERTS.format(0) + "down_proj"]
    parts = mxfp4(param)
    ours = convert_moe_packed_tensors(parts["_blocks"], parts["_scales"], dtype=torch.float32)
    packed, scales = mx.quantize(mx.array(param.to(torch.bfloat16).float().transpose(1, 2).contiguous().numpy()),
                                 mode="mxfp4")
    theirs = np.array(mx.dequantize(packed, scales, mode="mxfp4", dtype=mx.float32)).transpose(0, 2, 1)
    assert torch.equal(ours, torch.from_numpy(theirs.copy()))


def test_a_faithful_mxfp4_release_passes_on_every_expert(model_a, root, capsys):
    code, report = compare(capsys, model_a, release(model_a, root / "faithful"))
    assert code == 0, report
    units = [unit for unit in report["layers"] if unit["unit"] != "block"]
    assert len(units) == 2 * SIZES["num_local_experts"]
    for unit in units:
        conversion = unit["conversion"]
        assert conversion["conversion_deviation"] > 0
        # A rounded onto B's own blocks (no MXFP4 quantizer runs here): measured 0.99 to 1.06 of B's deviation
        assert 0.8 <= conversion["ratio_to_conversion"] <= 1.25
        storage = {row["name"]: row["storage"] for row in conversion["tensors"]}
        assert {n for n, s in storage.items() if s == "bfloat16"} == {n for n in storage if "bias" in n}, storage
        for row in conversion["tensors"]:
            if "bias" not in row["name"]:
                assert row["storage"] == "mxfp4 (GPT-OSS blocks)" and row["step_source"] == "file"
                assert row["steps"]["values_beyond_step"] == 0 and row["steps"]["max_steps"] <= 1.01
    assert any("MXFP4 experts" in note and "convert_moe_packed_tensors" in note for note in report["notes"])


@pytest.mark.parametrize(("case", "tensor", "experts", "named"), [
    ("doubled", "down_proj", range(4), {"fp4_scale_power_off"}),
    ("coarse", "down_proj", [1], {"grid_too_coarse"}),
    ("bias128", "gate_up_proj", range(4), {"fp4_scale_power_off"}),
    ("swapped_nibbles", "down_proj", range(4), {"packed_order_wrong"}),
])
def test_an_mxfp4_mistake_fails_its_layer_only(model_a, root, capsys, case, tensor, experts, named):
    broken = release(model_a, root / f"broken-{case}", {EXPERTS.format(1) + tensor: case})
    code, report = compare(capsys, model_a, broken)
    assert code == 1, report
    failed = {(unit["layer"], unit["expert"]) for unit in report["layers"]
              if unit["unit"] != "block" and not unit["passed"]}
    assert failed == {(1, e) for e in experts}
    if named is not None:
        ids = {unit["diagnosis"]["id"] for unit in report["layers"] if unit["unit"] != "block" and not unit["passed"]}
        assert ids <= named, ids


def test_experts_stored_mxfp4_that_modules_to_not_convert_names_are_named(model_a, root, capsys):
    """modules_to_not_convert naming the experts (transformers' Mxfp4 integration would then keep their packed
    blocks as bfloat16 parameters): every expert and block fails, named, where they passed."""
    b = release(model_a, root / "unstated")
    assert_module_not_stated(capsys, model_a, b, skip_listed("modules_to_not_convert", "mlp.experts"), "experts")


def test_an_mxfp4_release_from_the_hugging_face_cache_is_read_as_a_local_one(model_a, root, tmp_path, capsys,
                                                                             monkeypatch):
    """B given as a hub id, offline, from the Hugging Face cache: read through the hub path, every expert passes, and
    its inventory outside the FFN is made without reading X from a header that holds only X_blocks."""
    from .support import cache_repo, use_hf_home

    home = use_hf_home(monkeypatch, tmp_path / "hf")
    cache_repo(home, "openai/tiny-gpt-oss", release(model_a, root / "hub"))
    code, report = compare(capsys, model_a, "openai/tiny-gpt-oss")
    assert code == 0, report
    assert all(row["storage"] in ("mxfp4 (GPT-OSS blocks)", "bfloat16") for unit in report["layers"]
               for row in unit["conversion"].get("tensors", []))


@pytest.mark.parametrize(("edit", "said"), [
    ("config", "modules_to_not_convert is 5"),
    ("unstacked", "[experts, out, in / 32, 16]"),
    ("int8", "stores both as uint8"),
])
def test_an_mxfp4_release_of_another_layout_is_exit_2_naming_it(model_a, root, capsys, edit, said):
    from .support import run_main

    b = release(model_a, root / f"hostile-{edit}")
    if edit == "config":
        config = json.loads((b / "config.json").read_text())
        config["quantization_config"]["modules_to_not_convert"] = 5
        (b / "config.json").write_text(json.dumps(config))
    else:
        tensors = load_file(b / "model.safetensors")
        name = EXPERTS.format(1) + "down_proj"
        if edit == "unstacked":
            tensors[name + "_blocks"], tensors[name + "_scales"] = (tensors[name + "_blocks"][0].contiguous(),
                                                                    tensors[name + "_scales"][0].contiguous())
        else:
            tensors[name + "_blocks"] = tensors[name + "_blocks"].view(torch.int8)
        save_file(tensors, b / "model.safetensors")
    code, out, err = run_main(capsys, "compare", model_a, b)
    assert code == 2, out + err
    assert said in err and "Traceback" not in err and "internal error" not in err
