"""``parity compare A B`` where B is compressed-tensors' NVFP4 or MXFP4 (what llm-compressor's NVFP4A16 and MXFP4A16
schemes write): each Linear's ``weight_packed`` (two e2m1 codes a byte), ``weight_scale`` (e4m3 per 16 values, or an
e8m0 exponent per 32) and, for NVFP4, ``weight_global_scale``; config.json's ``quantization_config`` with format
``nvfp4-pack-quantized`` / ``mxfp4-pack-quantized``.

A is a tiny LLaMA built with transformers' own classes.  B is written the way llm-compressor writes it, with
compressed-tensors' own pieces: the global scale (``generate_gparam``) and each group's scale
(``calculate_qparams``) from A's values, then the format's registered compressor (``compress``); faithful, and with
one mistake in layer 1 only.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from .derived_checkpoints import (
    UNSTATED,
    assert_module_not_stated,
    assert_plain_module_named,
    broken_copy,
    format_fixtures,
    parts_scaled,
    quantized_layer_one_named,
    rows_scaled,
)
from .support import compare_json as compare
from .support import run_main

pytest.importorskip("compressed_tensors")

SIZES = dict(hidden_size=128, intermediate_size=192, num_key_value_heads=2, head_dim=64)
LAYER1 = "model.layers.1.mlp."
FORMATS = {"nvfp4": dict(strategy="tensor_group", group_size=16), "mxfp4": dict(strategy="group", group_size=32)}


def arguments(form: str):
    """The weights' arguments of llm-compressor's ``NVFP4A16`` / ``MXFP4A16`` scheme, compressed-tensors' own preset
    (each group's scale rounded to its scale dtype, e4m3 or e8m0, before the codes are chosen with it)."""
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    args = PRESET_SCHEMES[f"{form.upper()}A16"]["weights"]
    assert {key: getattr(args, key) for key in FORMATS[form]} == FORMATS[form]
    return args


def compressed(weight: torch.Tensor, form: str, how: str | None = None) -> dict[str, torch.Tensor]:
    """``weight`` [out, in] as llm-compressor stores it in ``form``, with mistake ``how``: global (the global scale
    doubled: every value halved; global_1.1: x 1.1, every value / 1.1), row (row 3's scales twice as large, after
    compressing), exchanged_rows (rows 0 and 1 of the packed codes exchanged, their scales kept)."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    args = arguments(form)
    weight = weight.to(torch.bfloat16)
    groups = weight.float().reshape(weight.shape[0], -1, args.group_size)
    zero = torch.zeros(1)
    state = {"weight": weight}
    if form == "nvfp4":
        state["weight_global_scale"] = generate_gparam(weight.float().min(), weight.float().max())
    state["weight_scale"], _ = calculate_qparams(torch.minimum(groups.amin(-1), zero),
                                                torch.maximum(groups.amax(-1), zero), args,
                                                global_scale=state.get("weight_global_scale"))
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    out = BaseCompressor.load_from_registry(f"{form}-pack-quantized").compress(state, scheme)
    if how in ("global", "global_1.1"):
        out["weight_global_scale"] = out["weight_global_scale"] * (2 if how == "global" else 1.1)
    if how == "row":
        scale = out["weight_scale"].clone()
        scale[3] = (scale[3].float() * 2).to(scale.dtype) if form == "nvfp4" else scale[3] + 1
        out["weight_scale"] = scale
    if how == "exchanged_rows":
        packed = out["weight_packed"].clone()
        packed[[0, 1]] = packed[[1, 0]]
        out["weight_packed"] = packed
    return {k: v.contiguous() for k, v in out.items()}


FP8_ROWS = dict(num_bits=8, type="float", strategy="channel", symmetric=True, dynamic=False)


def fp8_rows(weight: torch.Tensor, how: str | None = None) -> dict[str, torch.Tensor]:
    """``weight`` [out, in] as compressed-tensors' float-quantized compressor stores FP8 per output channel (codes
    float8_e4m3fn, X.weight_scale [out, 1] float32, from A's float32 values), quantized by compressed-tensors
    itself; ``how`` "inverted": the scales stored as their inverses."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    args = QuantizationArgs(**FP8_ROWS)
    weight = weight.float()
    scale, zero = calculate_qparams(weight.float().amin(1, keepdim=True).clamp(max=0),
                                    weight.float().amax(1, keepdim=True).clamp(min=0), args)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    state = {"weight": weight, "weight_scale": scale, "weight_zero_point": zero}
    out = BaseCompressor.load_from_registry("float-quantized").compress(state, scheme)
    if how == "inverted":
        out["weight_scale"] = 1.0 / out["weight_scale"]
    return {k: v.contiguous() for k, v in out.items() if k != "weight_zero_point"}


def export(a: Path, dest: Path, form: str, breaks: dict[str, str] | None = None, fp8: str | None = None) -> Path:
    """A's folder as llm-compressor's FP4 schemes save it: every decoder Linear packed, lm_head and the rest in
    bfloat16 (``ignore: ["lm_head"]``); ``fp8``: a module name these modules end in (``down_proj``) stored in FP8 per
    channel instead, as llm-compressor's non-uniform nvfp4 recipe writes it (format mixed-precision, each config
    group its own format)."""
    breaks = breaks or {}
    shutil.copytree(a, dest)
    out = {}
    for name, value in load_file(a / "model.safetensors").items():
        module = name.removesuffix(".weight")
        if name.startswith("model.layers.") and fp8 is not None and module.endswith(fp8):
            out.update({f"{module}.{k}": t for k, t in fp8_rows(value, breaks.get(name)).items()})
        elif name.startswith("model.layers.") and name.endswith("proj.weight"):
            out.update({f"{module}.{k}": t for k, t in compressed(value, form, breaks.get(name)).items()})
        else:
            out[name] = value.to(torch.bfloat16)
    save_file(out, dest / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dest / "config.json").read_text())
    groups = {"group_0": {"targets": ["Linear"], "weights": arguments(form).model_dump(mode="json")}}
    if fp8 is not None:
        groups["group_0"]["format"] = f"{form}-pack-quantized"
        groups["group_1"] = {"targets": [f"re:.*{fp8}$"], "weights": FP8_ROWS, "format": "float-quantized"}
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "quantization_status": "compressed", "config_groups": groups,
        "format": f"{form}-pack-quantized" if fp8 is None else "mixed-precision", "ignore": ["lm_head"]}
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dest


root, model_a = format_fixtures("fp4", SIZES)


@pytest.mark.parametrize("form", FORMATS)
def test_a_faithful_fp4_export_passes_on_every_layer(model_a, root, capsys, form):
    code, report = compare(capsys, model_a, export(model_a, root / f"faithful-{form}", form))
    assert code == 0, report
    group = FORMATS[form]["group_size"]
    for layer in report["layers"]:
        conversion = layer["conversion"]
        assert conversion["conversion_deviation"] > 0
        # A rounded onto B's own groups (no re-quantization): measured 0.96 to 1.02 of B's deviation
        assert 0.9 <= conversion["ratio_to_conversion"] <= 1.1
        for row in conversion["tensors"]:
            assert row["storage"] == f"{form}/{group}" and row["step_source"] == "file"
            assert row["steps"]["values_beyond_step"] == 0
    assert any(f"compressed-tensors {form}-pack-quantized, groups of {group}" in note for note in report["notes"])
    inventory = report["comparison"]["inventory"]
    assert inventory["shape_differs"] == [] and f"F32 -> {form.upper()}" in inventory["dtype_changes"]


@pytest.mark.parametrize("form", FORMATS)
@pytest.mark.parametrize(("case", "tensor", "named"), [
    ("global", "up_proj", "fp4_scale_power_off"),
    ("row", "down_proj", "grid_too_coarse"),
    ("exchanged_rows", "gate_proj", "rows_permuted"),
])
def test_an_fp4_mistake_fails_its_layer_only(model_a, root, capsys, form, case, tensor, named):
    if case == "global" and form == "mxfp4":
        pytest.skip("mxfp4 has no global scale")
    broken = export(model_a, root / f"broken-{form}-{case}", form, {f"{LAYER1}{tensor}.weight": case})
    if named is not None:
        quantized_layer_one_named(capsys, model_a, broken, named, tensor)
        return
    code, report = compare(capsys, model_a, broken)
    assert code == 1, report
    assert [layer["passed"] for layer in report["layers"]] == [True, False]


def test_nvfp4_with_down_proj_in_fp8_judges_each_module_by_its_own_storage(model_a, root, capsys):
    """llm-compressor's non-uniform nvfp4 recipe (examples/quantization_non_uniform: down_proj in FP8, the rest in
    NVFP4; format mixed-precision, each config group its own format): gate and up read by compressed-tensors' nvfp4
    decompress, down_proj by its FP8 dequantization, each judged on its own grid; exit 2 before (several weight
    schemes).  down_proj's scales inverted fail its layer named."""
    b = export(model_a, root / "nvfp4-fp8-down", "nvfp4", fp8="down_proj")
    code, report = compare(capsys, model_a, b)
    assert code == 0, report
    for layer in report["layers"]:
        storage = {row["name"]: row["storage"] for row in layer["conversion"]["tensors"]}
        assert storage == {"gate_proj.weight": "nvfp4/16", "up_proj.weight": "nvfp4/16",
                           "down_proj.weight": "float8_e4m3fn"}, storage
        assert all(row["steps"]["values_beyond_step"] == 0 for row in layer["conversion"]["tensors"])
    assert any("nvfp4-pack-quantized" in note for note in report["notes"])
    assert any("one scale per channel" in note for note in report["notes"]), report["notes"]
    broken = export(model_a, root / "nvfp4-fp8-down-inverted", "nvfp4", fp8="down_proj",
                    breaks={f"{LAYER1}down_proj.weight": "inverted"})
    found = quantized_layer_one_named(capsys, model_a, broken, "fp8_scale_inverted", "down_proj")
    assert "down_proj" in found["message"]
    tensors = load_file(b / "model.safetensors")  # down_proj stored nvfp4 where its group states FP8
    module = f"{LAYER1}down_proj"
    a_tensors = load_file(model_a / "model.safetensors")
    for part in ("weight", "weight_scale"):
        tensors.pop(f"{module}.{part}")
    tensors.update({f"{module}.{k}": t for k, t in compressed(a_tensors[f"{module}.weight"], "nvfp4").items()})
    save_file(tensors, b / "model.safetensors", metadata={"format": "pt"})
    code, out, err = run_main(capsys, "compare", model_a, b)
    assert code == 2, out + err
    assert f"{module} is stored nvfp4-pack-quantized, but config.json's" in err, err


@pytest.mark.parametrize("how", UNSTATED)
def test_a_module_stored_fp4_that_its_config_leaves_unquantized_is_named(model_a, root, capsys, how):
    assert_module_not_stated(capsys, model_a, export(model_a, root / f"unstated-{how}", "nvfp4"), how)


@pytest.mark.parametrize("factor", [3e-5, 1e-5, 1e-6])
def test_rows_whose_e4m3_group_scales_lie_among_its_subnormals_pass_faithful(model_a, root, capsys, factor):
    """Layer 1's FFN matrices with 8 rows x ``factor`` (near-dead rows, as trained checkpoints hold): their groups'
    need (amax / 6 times the global scale) falls under e4m3's smallest normal, where its values lie 2^-9 apart, so
    compressed-tensors' rounding of it is up to twice it or half of it, and 0 (then e4m3's eps, 0.125) under 2^-10.
    Each is the format's own rounding: the export passes on every layer, each value within its step plus what a
    rounded-down scale clips."""
    a = rows_scaled(model_a, root / f"a-quiet-{factor:g}", LAYER1, factor)
    code, report = compare(capsys, a, export(a, root / f"nvfp4-quiet-{factor:g}", "nvfp4"))
    assert code == 0, [layer["diagnosis"] for layer in report["layers"]]
    for row in report["layers"][1]["conversion"]["tensors"]:
        assert row["steps"]["values_beyond_step"] == 0 and row["grid"] is None, row


def test_an_nvfp4_global_scale_a_tenth_off_fails_named_though_its_values_stay_within_their_steps(model_a, root,
                                                                                                  capsys):
    """up_proj's global scale x 1.1: every value / 1.1, within e2m1's wide steps, the function within its tolerance
    (it passed), but B's least-squares factor on A's conversion is outside what round to nearest leaves."""
    b = export(model_a, root / "nvfp4-global-1.1", "nvfp4", {f"{LAYER1}up_proj.weight": "global_1.1"})
    found = quantized_layer_one_named(capsys, model_a, b, "tensor_scaled", "up_proj")
    factor = float(re.search(r"is A's x ([0-9.]+)", found["message"]).group(1))
    assert 0.88 <= factor <= 0.93 and "within 0.98 to 1.02" in found["message"], found["message"]


@pytest.mark.parametrize("factor", [6.0, 1e30])
def test_an_nvfp4_global_scale_far_off_is_tensor_scaled_never_unverifiable(model_a, root, capsys, factor):
    """down_proj's weight_global_scale (a divisor) stored ``factor`` x the one quantized with: A rounded onto B's
    grid, 6 or 1e30 x too fine, clamped at e2m1's top and lay as far from A as B, and the layer was exit 2 "could not
    be verified".  Where B's grid rounds A more than ``fp4_grid.SOUND`` x worse than B's grid divided by B's factor on
    A, A is rounded onto that one, saying so, and the factor is named."""
    good = root / "nvfp4-global-good"
    if not good.exists():
        export(model_a, good, "nvfp4")
    b = parts_scaled(good, root / f"nvfp4-global-{factor:g}", (f"{LAYER1}down_proj.weight_global_scale",), factor)
    found = quantized_layer_one_named(capsys, model_a, b, "tensor_scaled", "down_proj")
    said = float(re.search(r"down_proj\.weight (?:\(.*?\) is A's )?x ([0-9.e+-]+)", found["message"]).group(1))
    assert 0.9 < said * factor < 1.1, found["message"]


def test_a_value_halfway_between_two_levels_rounds_as_compressed_tensors_rounds_it():
    """Every e2m1 midpoint of either sign, and values near them: parity's rounding onto B's grid (A's conversion)
    is compressed-tensors' own ``quantize`` of them, ties to the even code (5 and -5 to 4 and -4).  Before, -5 went to
    -6, 0.75 to 0.5, 3.5 to 3: a reviewer's faithful MXFP4 export of weights with spikes at +-5 read as x 0.956."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize

    from parity.engine.compare.fp4_grid import nearest_level

    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    near = torch.cat([ties, ties + 1e-3, ties - 1e-3, torch.linspace(0, 6, 99)])  # 120 values
    values = torch.cat([near, -near]).reshape(-1, 16)
    args = QuantizationArgs(num_bits=4, type="float", symmetric=True, strategy="tensor_group", group_size=16)
    theirs = quantize(values, torch.ones(values.shape[0], 1), None, args, global_scale=torch.ones(1))
    assert torch.equal(nearest_level(values), theirs), (values, nearest_level(values), theirs)


def test_a_module_its_config_quantizes_stored_unquantized_is_named(model_a, root, capsys):
    assert_plain_module_named(capsys, model_a, export(model_a, root / "plain", "nvfp4"))


def test_gate_and_up_exchanged_in_an_nvfp4_export_is_named(model_a, root, capsys):
    a = broken_copy(model_a, root / "a-swapped", ("mlp.gate_proj", "mlp.up_proj"))
    code, report = compare(capsys, model_a, export(a, root / "swapped", "nvfp4"))
    assert code == 1, report
    assert [layer["passed"] for layer in report["layers"]] == [True, False]
    assert report["layers"][1]["diagnosis"]["id"] == "gate_up_exchanged"


@pytest.mark.parametrize(("edit", "said"), [
    (lambda t: {**t, "weight_packed": t["weight_packed"].view(torch.int8)}, "packs two e2m1 codes a byte"),
    (lambda t: {**t, "weight_packed": t["weight_packed"][:0]}, "packs two e2m1 codes a byte"),
    (lambda t: {**t, "weight_scale": t["weight_scale"].float()}, "stores its scales as float8_e4m3fn"),
    (lambda t: {**t, "weight_scale": t["weight_scale"][:, :-1]}, "one scale per group of 16"),
    (lambda t: {**t, "weight_global_scale": t["weight_global_scale"].repeat(2)}, "holds 2 values"),
])
def test_an_nvfp4_tensor_of_another_layout_is_exit_2_naming_it(model_a, root, capsys, edit, said):
    """Hostile layouts of layer 1's up_proj: exit 2 naming the tensor and what the format stores, never a traceback."""
    b = export(model_a, root / f"hostile-{len(list(root.iterdir()))}", "nvfp4")
    tensors = load_file(b / "model.safetensors")
    module = f"{LAYER1}up_proj"
    parts = edit({k.rsplit(".", 1)[1]: v for k, v in tensors.items() if k.startswith(module + ".")})
    tensors = {k: v for k, v in tensors.items() if not k.startswith(module + ".")}
    save_file({**tensors, **{f"{module}.{k}": v.contiguous() for k, v in parts.items()}}, b / "model.safetensors")
    code, out, err = run_main(capsys, "compare", model_a, b)
    assert code == 2, out + err
    assert said in err and "up_proj" in err and "Traceback" not in err and "internal error" not in err
