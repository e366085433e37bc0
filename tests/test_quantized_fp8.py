"""``parity compare A B`` where B is an FP8 block-quantized release (DeepSeek V3's and Qwen3's layout): each quantized
matrix a float8_e4m3fn ``weight`` beside a float32 ``weight_scale_inv`` per block, config.json's
``quantization_config = {quant_method: "fp8", fmt: "e4m3", weight_block_size: [128, 128]}``.

A is a tiny LLaMA built with transformers' own classes whose FFN sides (160 and 200) are not multiples of the block,
so every matrix has partial edge blocks.  B is written here with torch's float8_e4m3fn in transformers' FP8 layout
(each block's scale its largest magnitude / 448, the codes A / scale rounded to e4m3): faithful, and with one of the
conversion mistakes on layer 1 only.  B is read by compressed-tensors (the extra ``quant``); a test reads it with
transformers' own FP8 dequantizer too, to hold the figure docs/compare.md gives for their disagreement.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from .derived_checkpoints import (
    HOSTILE_PARTS,
    UNSTATED,
    assert_hostile_part_refused,
    assert_module_not_stated,
    assert_plain_module_named,
    build,
    format_fixtures,
    quantized_copy,
    quantized_layer_one_named,
    save_quantized,
    skip_listed,
)
from .support import compare_json as compare
from .support import run_main

pytest.importorskip("compressed_tensors")

BLOCK = (128, 128)
SIZES = dict(hidden_size=160, intermediate_size=200, num_key_value_heads=2)
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
FFN = ("gate_proj", "up_proj", "down_proj")


def quantize(weight: torch.Tensor, block: tuple[int, int], power_of_two: bool = False, coarser: float = 1.0
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] in FP8 blocks as transformers' FP8 layout stores it: codes (float8_e4m3fn) and each
    block's weight_scale_inv (float32 [ceil(out / block[0]), ceil(in / block[1])]; partial edge blocks included);
    ``power_of_two``: each scale rounded up to a power of two (scale_fmt "ue8m0"); ``coarser``: each scale that many
    times the format's (fewer of e4m3's codes used)."""
    rows, cols = weight.shape
    grid = math.ceil(rows / block[0]), math.ceil(cols / block[1])
    padded = torch.nn.functional.pad(weight.float(), (0, grid[1] * block[1] - cols, 0, grid[0] * block[0] - rows))
    tiles = padded.reshape(grid[0], block[0], grid[1], block[1])
    scale = tiles.abs().amax(dim=(1, 3)) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale)) * coarser
    if power_of_two:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    codes = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.reshape(grid[0] * block[0], grid[1] * block[1])[:rows, :cols].contiguous(), scale.float()


def fp8_export(a: Path, dest: Path, breaks: dict[str, str] | None = None, keep: tuple[str, ...] = (),
               fields: dict | None = None, *, block: tuple[int, int] | None = BLOCK,
               scale_part: str = "weight_scale_inv", scale_bytes: bool = False,
               skip_key: str = "modules_to_not_convert", activation_scales: bool = False, per_row: bool = False
               ) -> Path:
    """A's folder written as an FP8 block-quantized release (every linear weight of the decoder layers), the
    tensors named in ``breaks`` written with that mistake: inverted (1 / weight_scale_inv stored), transposed (the
    scale grid transposed), even (quantized in blocks splitting each side evenly, stated as 128x128), block64
    (quantized in 64x64 blocks, stated as 128x128), coarse16 (every scale 16 x the format's).  Modules named in
    ``keep`` stay unquantized, cast to bfloat16 and listed in ``skip_key`` (modules_to_not_convert; MiniMax writes
    ignored_layers); ``fields`` replace quantization_config's own.  ``block``: the blocks quantized in and stated
    (None: one scale per matrix, stored as a scalar); ``scale_part``: the scale's name beside X.weight (DeepSeek V4
    writes X.scale, Mistral Large 4 X.qscale_weight); ``scale_bytes``: ue8m0 scales stored as uint8 exponents (MXFP8);
    ``activation_scales``: a static activation scale (X.activation_scale, float32 scalar) beside each weight;
    ``per_row``: one scale per output row ([out, 1], as fbgemm_fp8 stores X.weight_scale)."""
    breaks = breaks or {}
    shutil.copytree(a, dest)
    tensors = load_file(a / "model.safetensors")
    out = {}
    for name, value in tensors.items():
        kept = any(f".{module}." in name for module in keep)
        if ".layers." not in name or value.dim() != 2 or kept:
            out[name] = value.bfloat16() if kept else value
            continue
        how = breaks.get(name)
        rows, cols = value.shape
        stated = (1, cols) if per_row else block or (rows, cols)
        used = {"even": (math.ceil(rows / math.ceil(rows / stated[0])), math.ceil(cols / math.ceil(cols / stated[1]))),
                "block64": (64, 64)}.get(how, stated)
        power_of_two = (fields or {}).get("scale_fmt") == "ue8m0"
        codes, scale = quantize(value, used, power_of_two, coarser=16.0 if how == "coarse16" else 1.0)
        scale = {"inverted": 1.0 / scale, "transposed": scale.t().contiguous()}.get(how, scale)
        if block is None and not per_row:
            scale = scale.reshape(())
        if power_of_two:  # stored as UE8M0 exponents, as transformers writes them (MXFP8: their bytes)
            scale = scale.to(torch.float8_e8m0fnu)
            scale = scale.view(torch.uint8) if scale_bytes else scale
        module = name.removesuffix(".weight")
        out[name], out[f"{module}.{scale_part}"] = codes, scale
        if activation_scales:
            out[f"{module}.activation_scale"] = torch.tensor(0.01)
    save_file(out, dest / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dest / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "static" if activation_scales else "dynamic",
                                     "weight_block_size": list(block) if block else None,
                                     skip_key: list(keep) or None, **(fields or {})}
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dest


root, model_a = format_fixtures("fp8", SIZES)


@pytest.fixture(scope="module")
def faithful(model_a, root) -> Path:
    return fp8_export(model_a, root / "faithful")




def test_a_faithful_fp8_export_passes_on_every_layer(model_a, faithful, capsys):
    code, report = compare(capsys, model_a, faithful)
    assert code == 0, report
    assert [layer["passed"] for layer in report["layers"]] == [True, True]
    for layer in report["layers"]:
        conversion = layer["conversion"]
        assert conversion["kind"] == "quantized float32 -> float8_e4m3fn"
        assert conversion["conversion_deviation"] > 0  # FP8 moves the function: judged against that, not noise
        for row in conversion["tensors"]:
            assert row["storage"] == "float8_e4m3fn" and row["step_source"] == "file"
            assert row["steps"]["values_beyond_step"] == 0
            assert row["steps"]["max_steps"] <= 0.5 + 1e-3  # round to nearest: at most half the code's step
            assert "compressed-tensors" in row["conversion"]
    assert any("FP8 e4m3, 128x128 blocks" in note for note in report["notes"])


def test_a_faithful_export_with_power_of_two_scales_passes(model_a, root, capsys):
    """scale_fmt "ue8m0" (DeepSeek V3.1): each scale the power of two at or above amax / 448, stored as
    float8_e8m0fnu; A is re-quantized the same way, so the export is A's conversion exactly."""
    b = fp8_export(model_a, root / "ue8m0", fields={"scale_fmt": "ue8m0"})
    code, report = compare(capsys, model_a, b)
    assert code == 0, report
    for layer in report["layers"]:
        assert layer["conversion"]["ratio_to_conversion"] == pytest.approx(1.0, abs=1e-6)
        assert all("power of two" in row["conversion"] for row in layer["conversion"]["tensors"])
        assert all(row["steps"]["values_beyond_step"] == 0 for row in layer["conversion"]["tensors"])


@pytest.mark.parametrize(("tensor", "how", "named"), [
    ("gate_proj", "inverted", "fp8_scale_inverted"),
    ("down_proj", "transposed", "fp8_scales_transposed"),
    ("up_proj", "even", "fp8_block_size_wrong"),
    ("up_proj", "block64", "fp8_block_size_wrong"),
    ("up_proj", "coarse16", "grid_too_coarse"),
])
def test_an_fp8_conversion_mistake_fails_its_layer_only_and_is_named(model_a, root, capsys, tensor, how, named):
    broken = fp8_export(model_a, root / f"{how}-{tensor}", {f"model.layers.1.mlp.{tensor}.weight": how})
    found = quantized_layer_one_named(capsys, model_a, broken, named, tensor)
    if found["distance"] is not None:  # a replay of the function: B reproduces it far closer than it is to A
        assert found["distance"] <= 0.5 * found["reference_distance"]
    elif how == "block64":  # read from B's scale grid: its shape is the evidence
        assert "weight_scale_inv has shape [4, 3]" in found["message"] and "64x64" in found["message"]
    elif how == "coarse16":  # within its tolerance and its own steps: each block's scale against A's amax / 448
        assert "4 of 4 blocks" in found["message"] and "(16.00x" in found["message"]
    else:  # replayed value by value: every value of B within its step of the replay
        assert "every value of B lies within its step of this replay" in found["message"]


def test_transformers_dequantizer_misreads_partial_edge_blocks_where_compressed_tensors_follows_the_block(
        model_a, faithful):
    """The figures docs/compare.md and parity.sources.fp8_blocks give, per FFN matrix (every one [200, 160] or
    [160, 200], grid [2, 2]): transformers' Fp8Dequantize infers 100x80 (80x100) blocks from the grid and lands 2.4 to
    4.9 steps from A's values (up to 0.071); compressed-tensors reads the stated 128x128 and stays within half a step,
    as round-to-nearest does.  A step: the e4m3 spacing at the value's code times its block's scale."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    from parity.engine.compare.fp8_grid import steps

    args = QuantizationArgs(num_bits=8, type="float", strategy="block", block_structure=list(BLOCK), symmetric=True,
                            dynamic=False)
    original, stored = load_file(model_a / "model.safetensors"), load_file(faithful / "model.safetensors")
    for name in (f"model.layers.{layer}.mlp.{t}.weight" for layer in (0, 1) for t in FFN):
        codes, scales = stored[name], stored[name.removesuffix("weight") + "weight_scale_inv"]
        assert scales.shape == (2, 2) and codes.shape[0] % BLOCK[0] and codes.shape[1] % BLOCK[1]
        a, step = original[name].double(), steps(codes, scales, BLOCK).double()
        library = dequantize(codes, scales, None, args=args, dtype=torch.float32).double()
        theirs = Fp8Dequantize(None).convert({"weight": codes, "weight_scale_inv": scales})["weight"].double()
        assert float(((library - a).abs() / step).max()) <= 0.5 * 1.01, name
        assert float(((theirs - a).abs() / step).max()) > 2.0, name  # measured 2.4 to 4.9 steps


def test_modules_left_unquantized_are_judged_by_their_own_storage(model_a, root, capsys):
    """A release that keeps down_proj in bfloat16 (modules_to_not_convert): down_proj judged as a cast, gate and up
    by their FP8 steps; every layer passes."""
    mixed = fp8_export(model_a, root / "mixed", keep=("down_proj",))
    code, report = compare(capsys, model_a, mixed)
    assert code == 0, report
    for layer in report["layers"]:
        storage = {row["name"]: row["storage"] for row in layer["conversion"]["tensors"]}
        assert storage == {"gate_proj.weight": "float8_e4m3fn", "up_proj.weight": "float8_e4m3fn",
                           "down_proj.weight": "bfloat16"}
    assert any("left unquantized: down_proj" in note for note in report["notes"])


@pytest.mark.parametrize(("fields", "said"), [
    ({"weight_block_size": [128]}, "weight_block_size is [128]"),
    ({"fmt": "e5m2"}, "quantization_config.fmt is 'e5m2'"),
    ({"expert_dtype": "fp4"}, "expert_dtype is 'fp4'"),
    ({"scale_fmt": "e8m0"}, "scale_fmt must be 'float' or 'ue8m0'"),
])
def test_an_fp8_config_parity_cannot_read_is_exit_2_naming_the_field(model_a, root, capsys, fields, said):
    b = fp8_export(model_a, root / f"config-{len(list(root.iterdir()))}", fields=fields)
    code, out, err = run_main(capsys, "compare", model_a, b)
    assert code == 2, out + err
    assert said in err and "config.json" in err and "Traceback" not in err


@pytest.mark.parametrize(("case", "export"), [
    ("per-tensor", dict(block=None)),
    ("deepseek-v4-scale", dict(scale_part="scale")),
    ("mistral-large-4-qscale", dict(scale_part="qscale_weight")),
    ("mxfp8", dict(block=(1, 32), scale_bytes=True, fields={"quant_method": "mxfp8", "scale_fmt": "ue8m0"})),
    ("minimax-ignored-layers", dict(keep=("down_proj",), skip_key="ignored_layers")),
    ("static-activations", dict(activation_scales=True)),
    ("dequantize-true", dict(fields={"dequantize": True})),  # its loader's converter folds weight and scale: no name
    ("fbgemm-fp8", dict(block=None, per_row=True, scale_part="weight_scale",
                        fields={"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0})),
])
def test_fp8_releases_as_transformers_loads_them_pass_on_every_layer(model_a, root, capsys, case, export):
    """What transformers' FineGrainedFP8 quantizer loads beyond DeepSeek V3's layout, read as it reads it: a scale
    per tensor (weight_block_size null: a scalar weight_scale_inv), the scale names its own renamings map to
    weight_scale_inv (DeepSeek V4's X.scale, Mistral Large 4's X.qscale_weight), quant_method "mxfp8" ([1, 32]
    blocks, e8m0 scales stored as uint8 bytes), MiniMax's skip list under ignored_layers, static activation scales
    beside each weight; fbgemm_fp8 (Meta's FP8 releases: a float32 X.weight_scale per output row, read with
    compressed-tensors' channel dequantization, fbgemm's own being CUDA only).  All but ignored_layers and
    dequantize: true (kept as guards: they passed before) failed before (exit 2, or the activation scales listed as
    tensors only in B); now every layer passes at A's re-quantization, its values within their own steps."""
    keep = export.pop("keep", ())
    b = fp8_export(model_a, root / f"release-{case}", keep=keep, **export)
    code, report = compare(capsys, model_a, b)
    assert code == 0, report
    for layer in report["layers"]:
        for row in layer["conversion"]["tensors"]:
            if row["name"].split(".")[0] in keep:
                assert row["storage"] == "bfloat16", row
                continue
            assert row["storage"] == "float8_e4m3fn" and row["step_source"] == "file", row
            assert row["steps"]["values_beyond_step"] == 0, row
    assert report["comparison"]["inventory"]["only_in_b"] == [], report["comparison"]["inventory"]


def test_an_fbgemm_fp8_scale_inverted_fails_its_layer_named(model_a, root, capsys):
    b = fp8_export(model_a, root / "fbgemm-inverted", {"model.layers.1.mlp.up_proj.weight": "inverted"}, block=None,
                   per_row=True, scale_part="weight_scale", fields={"quant_method": "fbgemm_fp8"})
    found = quantized_layer_one_named(capsys, model_a, b, "fp8_scale_inverted", "up_proj")
    assert "up_proj" in found["message"], found


@pytest.mark.parametrize("other", ["scale", "qscale_weight"])
def test_two_scales_of_one_fp8_weight_are_exit_2_naming_both(model_a, root, capsys, other):
    """X.weight_scale_inv beside an X.scale (or X.qscale_weight) that transformers' loader renames to it: which one
    a loader takes is its own order, so neither is taken silently (one of them x 4 passed before)."""
    b = fp8_export(model_a, root / f"two-scales-{other}")
    tensors = load_file(b / "model.safetensors")
    tensors[f"model.layers.1.mlp.up_proj.{other}"] = tensors["model.layers.1.mlp.up_proj.weight_scale_inv"] * 4
    save_file(tensors, b / "model.safetensors", metadata={"format": "pt"})
    code, out, err = run_main(capsys, "compare", model_a, b)
    assert code == 2, out + err
    assert f"up_proj.{other} and model.layers.1.mlp.up_proj.weight_scale_inv are both" in err or \
        f"up_proj.weight_scale_inv and model.layers.1.mlp.up_proj.{other} are both" in err, err


def test_a_scale_grid_of_three_dimensions_is_named_never_an_internal_error(model_a, root, capsys):
    b = fp8_export(model_a, root / "grid-3d")
    tensors = load_file(b / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight_scale_inv"
    tensors[name] = tensors[name][None]
    save_file(tensors, b / "model.safetensors", metadata={"format": "pt"})
    found = quantized_layer_one_named(capsys, model_a, b, "fp8_block_size_wrong", "up_proj")
    assert "a grid of 3 dimensions" in found["message"], found["message"]


def test_an_fp8_code_without_its_scale_is_exit_2_naming_it(model_a, root, capsys):
    b = fp8_export(model_a, root / "scale-lost")
    tensors = load_file(b / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight_scale_inv"]
    save_file(tensors, b / "model.safetensors", metadata={"format": "pt"})
    code, out, err = run_main(capsys, "compare", model_a, b)
    assert code == 2, out + err
    assert "model.layers.1.mlp.up_proj.weight is stored float8_e4m3fn without a scale" in err, err
    assert "Traceback" not in err


def test_without_compressed_tensors_an_fp8_b_is_exit_2_naming_the_extra(model_a, faithful, capsys, monkeypatch):
    for module in ("compressed_tensors", "compressed_tensors.quantization",
                   "compressed_tensors.quantization.lifecycle.forward"):
        monkeypatch.setitem(sys.modules, module, None)  # import of it raises ImportError
    code, out, err = run_main(capsys, "compare", model_a, faithful)
    assert code == 2, out + err
    assert "compressed-tensors" in err and "'quant'" in err and "FP8-quantized" in err and "'fp8'" in err
    assert "Traceback" not in err


def test_fp8_experts_are_judged_one_by_one_and_a_broken_one_is_named(root, capsys):
    """A mixture of experts (Qwen3-MoE, DeepSeek V3's per-expert layout: each expert's matrices with their own
    weight_scale_inv; sides 160 and 136, no multiple of the block), the router left unquantized: every expert of a
    faithful export passes; one expert whose scale was written inverted fails alone, named."""
    from .derived_checkpoints import MOE

    moe = build("qwen3_moe", root / "moe", 5, **{**MOE, "hidden_size": 160, "moe_intermediate_size": 136})
    faithful = fp8_export(moe, root / "moe-fp8", keep=("gate",))
    code, report = compare(capsys, moe, faithful)
    assert code == 0, report
    experts = [unit for unit in report["layers"] if unit["unit"] != "block"]
    assert len(experts) == 2 * MOE["num_experts"]
    # each layer's whole block too: B's dequantized experts in it, the unquantized router as A's (it passes)
    assert [(unit["layer"], unit["passed"]) for unit in report["layers"] if unit["unit"] == "block"] == [(0, True),
                                                                                                        (1, True)]
    broken = fp8_export(moe, root / "moe-fp8-broken", {"model.layers.1.mlp.experts.2.up_proj.weight": "inverted"},
                        keep=("gate",))
    code, report = compare(capsys, moe, broken)
    assert code == 1, report
    failed = [(unit["layer"], unit["expert"], unit["diagnosis"]["id"]) for unit in report["layers"]
              if not unit["passed"]]
    assert failed == [(1, 2, "fp8_scale_inverted")]


def ct_export(a: Path, dest: Path, preset: str, breaks: dict[str, str] | None = None, fmt: str = "float-quantized",
              also: dict[str, str] | None = None) -> Path:
    """A's folder in compressed-tensors' layout (what llm-compressor and vLLM write): every linear weight of the
    decoder layers as X.weight (float8_e4m3fn) and X.weight_scale, the config compressed-tensors' own
    QuantizationConfig of its preset scheme ``preset`` (FP8: one scale per tensor; FP8_DYNAMIC: per output channel;
    FP8_BLOCK: per 128x128 block).  ``breaks``: as ``fp8_export``'s (inverted); ``also``: a regex target
    ("re:...") -> the preset its modules are quantized with instead, each a config group of its own (llm-compressor's
    non-uniform recipes)."""
    import re

    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    scheme = preset_name_to_scheme(preset, ["Linear"])
    others = {target: preset_name_to_scheme(name, [target]) for target, name in (also or {}).items()}

    def stored(name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
        own = next((s for t, s in others.items() if re.match(t.removeprefix("re:"), name.removesuffix(".weight"))),
                   scheme)
        strategy = str(getattr(own.weights.strategy, "value", own.weights.strategy))
        block = {"tensor": tuple(value.shape), "channel": (1, value.shape[1])}.get(strategy, BLOCK)
        codes, scale = quantize(value, block)
        scale = 1.0 / scale if (breaks or {}).get(name) == "inverted" else scale
        return {name: codes, name + "_scale": scale.reshape(1) if strategy == "tensor" else scale}

    groups = {"group_0": scheme, **{f"group_{i + 1}": s for i, s in enumerate(others.values())}}
    quantization = QuantizationConfig(config_groups=groups, ignore=["lm_head"], format=fmt,
                                      quantization_status="compressed").model_dump(mode="json")
    return save_quantized(dest, quantized_copy(a, dest, stored), {**quantization, "quant_method": "compressed-tensors"})


@pytest.mark.parametrize("preset", ["FP8_BLOCK", "FP8_DYNAMIC", "FP8"])
def test_a_faithful_compressed_tensors_fp8_export_passes(model_a, root, capsys, preset):
    b = ct_export(model_a, root / f"ct-{preset}", preset)
    code, report = compare(capsys, model_a, b)
    assert code == 0, report
    assert any(", compressed-tensors' float-quantized layout" in note for note in report["notes"])
    for layer in report["layers"]:
        assert layer["conversion"]["ratio_to_conversion"] == pytest.approx(1.0, abs=1e-6)
        for row in layer["conversion"]["tensors"]:
            assert row["storage"] == "float8_e4m3fn" and row["steps"]["values_beyond_step"] == 0


@pytest.mark.parametrize(("preset", "also", "storage"), [
    ("FP8_DYNAMIC", {"re:.*mlp.*": "FP8"}, {"gate_proj": "tensor", "up_proj": "tensor", "down_proj": "tensor"}),
    ("FP8_DYNAMIC", {"re:.*down_proj": "FP8_BLOCK"}, {"gate_proj": "channel", "up_proj": "channel",
                                                       "down_proj": "128x128 blocks"}),
])
def test_fp8_config_groups_of_several_strategies_each_judge_their_own_modules(model_a, root, capsys, preset, also,
                                                                              storage):
    """llm-compressor's non-uniform FP8 recipes (its examples/quantization_non_uniform: attention per channel, the MLP
    per tensor): each module dequantized in the scheme compressed-tensors gives it (exit 2 before: several weight
    schemes), every layer passing at A's re-quantization in its own scheme; one per-tensor scale inverted fails its
    layer named."""
    b = ct_export(model_a, root / f"ct-mixed-{len(list(root.iterdir()))}", preset, also=also)
    code, report = compare(capsys, model_a, b)
    assert code == 0, report
    note = next(note for note in report["notes"] if "float-quantized" in note)
    for strategy in set(storage.values()):
        assert (f"one scale per {strategy}" if strategy != "128x128 blocks" else strategy) in note, note
    for layer in report["layers"]:
        assert layer["conversion"]["ratio_to_conversion"] == pytest.approx(1.0, abs=1e-6)
        for row in layer["conversion"]["tensors"]:
            assert row["storage"] == "float8_e4m3fn" and row["steps"]["values_beyond_step"] == 0, row
    broken = ct_export(model_a, root / f"ct-mixed-broken-{len(list(root.iterdir()))}", preset, also=also,
                       breaks={"model.layers.1.mlp.up_proj.weight": "inverted"})
    found = quantized_layer_one_named(capsys, model_a, broken, "fp8_scale_inverted", "up_proj")
    assert "up_proj" in found["message"]


@pytest.mark.parametrize("how", [*UNSTATED, "modules_to_not_convert"])
def test_a_module_stored_fp8_that_its_config_leaves_unquantized_is_named(model_a, root, capsys, how):
    """compressed-tensors' ignore or targets leaving down_proj out, or transformers' FP8 layout naming it in
    modules_to_not_convert (matched by transformers' own should_convert_module), its FP8 codes and scales kept."""
    if how in UNSTATED:
        assert_module_not_stated(capsys, model_a, ct_export(model_a, root / f"ct-unstated-{how}", "FP8_DYNAMIC"), how)
    else:
        assert_module_not_stated(capsys, model_a, fp8_export(model_a, root / "unstated"), skip_listed(how))


def test_a_module_its_config_quantizes_stored_unquantized_is_named(model_a, root, capsys):
    assert_plain_module_named(capsys, model_a, ct_export(model_a, root / "ct-plain", "FP8_DYNAMIC"))


@pytest.mark.parametrize(("layout", "part"), [("fp8", "weight_scale_inv"), ("ct", "weight_scale")])
def test_a_scale_grid_stored_flat_is_named_never_an_internal_error(model_a, root, layout, part, capsys):
    b = fp8_export(model_a, root / "flat-fp8") if layout == "fp8" else ct_export(model_a, root / "flat-ct", "FP8_BLOCK")
    assert_hostile_part_refused(capsys, model_a, b, f"model.layers.1.mlp.up_proj.{part}", HOSTILE_PARTS["flat"], 1)


def test_a_compressed_tensors_scale_inverted_fails_its_layer_named(model_a, root, capsys):
    b = ct_export(model_a, root / "ct-inverted", "FP8_BLOCK", {"model.layers.1.mlp.down_proj.weight": "inverted"})
    code, report = compare(capsys, model_a, b)
    assert code == 1, report
    assert [layer["passed"] for layer in report["layers"]] == [True, False]
    assert report["layers"][1]["diagnosis"]["id"] == "fp8_scale_inverted"
    assert "down_proj" in report["layers"][1]["diagnosis"]["message"]


def test_a_compressed_tensors_format_its_tensors_are_not_in_is_exit_2_naming_it(model_a, root, capsys):
    """A config stating NVFP4 (read by parity.sources.fp4_packed, tests/test_quantized_fp4.py) over FP8 tensors:
    exit 2 naming the format and the tensors it calls for, never the FP8 codes judged as NVFP4 or as weights."""
    b = ct_export(model_a, root / "ct-nvfp4", "NVFP4", fmt="nvfp4-pack-quantized")
    code, out, err = run_main(capsys, "compare", model_a, b)
    assert code == 2, out + err
    assert "states format 'nvfp4-pack-quantized', yet no tensor is stored as X.weight_packed" in err
    assert "Traceback" not in err


def test_a_check_of_an_fp8_release_runs_on_its_dequantized_weights(faithful, capsys):
    """``parity B`` (a check, not a compare): target and reference both get B's weights as compressed-tensors
    dequantizes them, and the report says so."""
    code, out, err = run_main(capsys, faithful, "--layers", "all")
    assert code == 0, out + err
    assert "FP8 e4m3, 128x128 blocks" in out and "the same dequantized float32 weights" in out


def test_an_fp8_release_from_the_hugging_face_cache_is_read_as_a_local_one(model_a, faithful, tmp_path, capsys,
                                                                            monkeypatch):
    """B given as a hub id, offline, from the Hugging Face cache (as DeepSeek's and Qwen's FP8 repos are): read
    through the hub path, dequantized the same way, every layer passes."""
    from .support import cache_repo, use_hf_home

    home = use_hf_home(monkeypatch, tmp_path / "hf")
    cache_repo(home, "someone/tiny-llama-fp8", faithful)
    code, report = compare(capsys, model_a, "someone/tiny-llama-fp8")
    assert code == 0, report
    assert report["comparison"]["candidate"]["checkpoint"].startswith("someone/tiny-llama-fp8")
    assert all(row["storage"] == "float8_e4m3fn" for layer in report["layers"]
               for row in layer["conversion"]["tensors"])


def bf16_llm_compressor_export(a: Path, dest: Path, inverted: str | None = None) -> Path:
    """A bfloat16 A's folder as llm-compressor 0.14 writes FP8_BLOCK for it: each block's scale its largest magnitude
    / 448 rounded to bfloat16 and stored so, the codes compressed-tensors' ``quantize`` of the bfloat16 weight by the
    bfloat16 scale (bfloat16 arithmetic: its export of the Gemma 3 270M stand-in holds exactly these codes, 3 % of
    them other than float32 arithmetic's); ``inverted``: that tensor's scales stored as 1 / scale."""
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize

    from parity.engine.compare.fp8_grid import library_args

    args = library_args(BLOCK)

    def stored(name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
        rows, cols = (math.ceil(n / b) for n, b in zip(value.shape, BLOCK, strict=True))
        padded = torch.zeros(rows * BLOCK[0], cols * BLOCK[1])
        padded[:value.shape[0], :value.shape[1]] = value.float().abs()
        peak = padded.reshape(rows, BLOCK[0], cols, BLOCK[1]).amax(dim=(1, 3))
        scale = (peak / 448).to(torch.bfloat16)
        codes = ct_quantize(value, scale, torch.zeros_like(scale), args, dtype=torch.float8_e4m3fn).contiguous()
        return {name: codes, name + "_scale": 1 / scale if name == inverted else scale}

    scheme = preset_name_to_scheme("FP8_BLOCK", ["Linear"])
    quantization = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"], format="float-quantized",
                                      quantization_status="compressed").model_dump(mode="json")
    return save_quantized(dest, quantized_copy(a, dest, stored), {**quantization, "quant_method": "compressed-tensors"})


def test_an_fp8_export_computed_in_bfloat16_is_its_conversion_exactly_and_its_inverted_scale_named(model_a, root,
                                                                                                   capsys):
    """llm-compressor quantizes a bfloat16 model in bfloat16 and stores its scales so: A is re-quantized in the dtype
    B's scales are stored in (fp8_grid.quantize), so a faithful export is its conversion exactly (it sat at 0.96 to
    1.30 x on the Gemma 3 stand-in) and a scale stored inverted is named (it was grid_too_coarse there)."""
    a = root / "a-bf16"
    shutil.copytree(model_a, a)
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(model_a / "model.safetensors").items()},
              a / "model.safetensors", metadata={"format": "pt"})
    code, report = compare(capsys, a, bf16_llm_compressor_export(a, root / "bf16-llmc"))
    assert code == 0, report
    for layer in report["layers"]:
        assert layer["conversion"]["ratio_to_conversion"] == pytest.approx(1.0, abs=1e-6), layer["conversion"]
    broken = bf16_llm_compressor_export(a, root / "bf16-llmc-inverted", "model.layers.1.mlp.up_proj.weight")
    code, report = compare(capsys, a, broken)
    assert code == 1 and [layer["passed"] for layer in report["layers"]] == [True, False], report["layers"]
    assert report["layers"][1]["diagnosis"]["id"] == "fp8_scale_inverted", report["layers"][1]["diagnosis"]
