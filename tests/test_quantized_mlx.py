"""``parity compare A B`` where B is an MLX-LM affine-quantized release (what ``mlx_lm.convert -q`` writes): each
quantized matrix a uint32 ``weight`` packing 32 / bits codes per word beside ``scales`` and ``biases`` in the model's
dtype (one per group of group_size input values), config.json's ``quantization = {group_size, bits}`` (copied to
``quantization_config``), per-module entries for mixed precision.

A is a tiny LLaMA (and Qwen2, and a Qwen2-MoE) built with transformers' own classes.  B is written here the way
mlx_lm.convert does it: every weight cast to the model dtype, then ``mlx.core.quantize`` (every linear weight,
embeddings and lm_head included); faithful, and with one conversion mistake on layer 1 only.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from .derived_checkpoints import (
    HOSTILE_PARTS,
    assert_hostile_part_refused,
    assert_module_not_stated,
    broken_copy,
    build,
    format_fixtures,
    parts_scaled,
    quantized_layer_one_named,
    rows_scaled,
)
from .support import compare_json as compare
from .support import run_main

mx = pytest.importorskip("mlx.core")

SIZES = dict(hidden_size=128, intermediate_size=192, num_key_value_heads=2, head_dim=64)
FFN = ("gate_proj", "up_proj", "down_proj")
LAYER1 = "model.layers.1.mlp"
DTYPES = {"bfloat16": "BF16", "float16": "F16"}  # safetensors' names


def to_torch(array, dtype: str | None = None) -> torch.Tensor:
    """An mlx array as torch (uint32 kept as its bit pattern; a float cast to ``dtype`` exactly, via float32)."""
    if array.dtype == mx.uint32:
        return torch.from_numpy(np.array(array).view(np.int32)).view(torch.uint32)
    return torch.from_numpy(np.array(array.astype(mx.float32))).to(getattr(torch, dtype)).contiguous()


def pack4(codes: np.ndarray) -> np.ndarray:
    """4-bit codes [out, in] packed as MLX packs them: eight per uint32, the first in the lowest bits."""
    words = codes.astype(np.uint32).reshape(codes.shape[0], -1, 8)
    return sum(words[..., k] << np.uint32(4 * k) for k in range(8)).astype(np.uint32)


def microscaled(value: torch.Tensor, mode: str, dtype: str, how: str | None = None, *,
                global_scale: bool = False) -> dict:
    """``value`` as mlx_lm.convert stores it in a microscaled ``mode`` (weight, uint8 scales; no biases), with
    mistake ``how``: doubled (every scale twice as large), coarse (row 2's scales twice as large: its groups' grid
    twice as coarse as mlx chooses), gguf_order (each 32-value block's codes packed in
    ggml's MXFP4 order: value j and j + 16 in byte j), transposed (a square scale grid stored transposed), nan (row
    3's scales the byte mlx reads as no number), affine (quantized in affine mode: scales and biases in ``dtype``),
    global_x2 / global_x1.1 (the global scale stored 2 / 1.1 times the one quantized with).  ``global_scale``:
    nvfp4 quantized with mlx's ``global_scale`` (the matrix's largest magnitude, which puts its largest group's scale
    at e4m3's top), stored as X.global_scale (float32 scalar)."""
    w = mx.array(value.float().numpy()).astype(getattr(mx, dtype))
    if how == "affine":
        return quantize(value, 64, 4, dtype)
    gs = mx.array(np.float32(float(mx.abs(w).max()))) if global_scale else None
    packed, scales = mx.quantize(w, mode=mode, global_scale=gs)
    scales = np.array(scales)
    twice = 8 if mode == "nvfp4" else 1  # a scale byte twice as large: e4m3's exponent one up, e8m0's byte one up
    if how == "doubled":
        scales = scales + twice
    if how == "coarse":
        scales[2] += twice
    if how == "gguf_order":
        words = np.array(packed).reshape(packed.shape[0], -1, 4)  # a 32-value block is four words
        nibbles = np.stack([(words >> np.uint32(4 * k)) & np.uint32(15) for k in range(8)], -1).reshape(
            packed.shape[0], -1, 32)
        mlx_read = np.stack([nibbles[..., :16], nibbles[..., 16:]], -1).reshape(nibbles.shape)  # byte j: j, j + 16
        packed = mx.array(pack4(mlx_read.reshape(packed.shape[0], -1)))
    if how == "transposed":
        scales = np.ascontiguousarray(scales.T)
    if how == "nan":
        scales[3] = 255
    stored = {"weight": to_torch(packed), "scales": torch.from_numpy(scales.astype(np.uint8))}
    if gs is not None:
        stored["global_scale"] = torch.tensor(float(np.array(gs)) * {"global_x2": 2, "global_x1.1": 1.1}.get(how, 1))
    return stored


def quantize(value: torch.Tensor, group: int, bits: int, dtype: str, how: str | None = None) -> dict:
    """``value`` [out, in] (or experts stacked, [E, out, in]) as mlx_lm.convert stores it (weight, scales, biases),
    with mistake ``how``: exchanged (scales and biases swapped; "exchanged@2": in expert 2 only), transposed (both
    stored [groups, out]), coarse (4 bits: every scale doubled and the codes halved, rounded down), nan (row 3's
    scales NaN), zeroed (every code zero), shifted (every bias one step up: its group's scale added)."""
    w = mx.array(value.float().numpy()).astype(getattr(mx, dtype))
    packed, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    if how == "coarse":
        ones = mx.ones(scales.shape, dtype=mx.float32)
        codes = np.array(mx.dequantize(packed, ones, ones * 0, group_size=group, bits=bits)).astype(np.uint32)
        assert (pack4(codes) == np.array(packed)).all()  # the packing is MLX's own
        packed, scales = mx.array(pack4(codes // 2)), scales * 2
    if how == "exchanged":
        scales, biases = biases, scales
    if how == "nan":
        scales = mx.where((mx.arange(scales.shape[0]) == 3)[:, None], mx.array(float("nan"), scales.dtype), scales)
    if how == "zeroed":
        packed = mx.zeros_like(packed)
    if how == "shifted":
        biases = biases + scales
    if how is not None and how.startswith("exchanged@"):
        expert = int(how.split("@")[1])
        scales, biases = mx.array(np.array(scales.astype(mx.float32))), mx.array(np.array(biases.astype(mx.float32)))
        swapped = [mx.where(mx.arange(value.shape[0])[:, None, None] == expert, y, x)
                   for x, y in ((scales, biases), (biases, scales))]
        scales, biases = swapped
    if how == "transposed":
        scales, biases = scales.T, biases.T
    return {"weight": to_torch(packed), "scales": to_torch(scales, dtype), "biases": to_torch(biases, dtype)}


def mlx_export(a: Path, dest: Path, *, group: int = 64, bits: int = 4, dtype: str = "bfloat16",
               breaks: dict[str, str] | None = None, modules: dict | None = None, written: dict | None = None,
               mode: str | None = None, stated: str | None = None, global_scale: bool = False) -> Path:
    """A's folder as mlx_lm.convert -q writes it: every 2-D weight whose input width is a multiple of the group
    quantized, the rest cast to ``dtype``.  ``modules``: config.json's per-module entries ({group_size, bits} or
    False), which the tensors follow unless ``written`` says what a module was really quantized with (a config that
    misstates it); ``breaks``: tensor name -> a mistake of ``quantize`` (of ``microscaled`` with ``mode``: a
    microscaled mode, whose group size and bits are mlx's defaults, as ``--q-mode`` writes them); ``stated``: the
    mode config.json states, where it misstates ``mode``; ``global_scale``: nvfp4 with a global scale per matrix
    (``microscaled``)."""
    breaks, modules, written = breaks or {}, modules or {}, written or {}
    if mode is not None:
        _, scales = mx.quantize(mx.zeros((2, 256)), mode=mode)
        group, bits = 256 // scales.shape[-1], {"mxfp8": 8}.get(mode, 4)
    shutil.copytree(a, dest)
    out = {}
    for name, value in switch_mlp(load_file(a / "model.safetensors")).items():
        module = name.removesuffix(".weight")
        entry = written.get(module, modules.get(module, {"group_size": group, "bits": bits}))
        if value.dim() not in (2, 3) or "norm" in name or entry is False or value.shape[-1] % entry["group_size"]:
            out[name] = value.to(getattr(torch, dtype))
            continue
        parts = (microscaled(value, mode, dtype, breaks.get(name), global_scale=global_scale) if mode is not None
                 else quantize(value, entry["group_size"], entry["bits"], dtype, breaks.get(name)))
        out.update({f"{module}.{part}": tensor for part, tensor in parts.items()})
    save_file(out, dest / "model.safetensors", metadata={"format": "mlx"})
    config = json.loads((dest / "config.json").read_text())
    config["quantization"] = {"group_size": group, "bits": bits, **modules}
    if mode is not None or stated is not None:
        config["quantization"]["mode"] = stated or mode
    config["quantization_config"] = config["quantization"]
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dest


def switch_mlp(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors (``mlp.experts.{e}.up_proj.weight``) stacked as MLX-LM's models' sanitize does: one
    ``mlp.switch_mlp.up_proj.weight`` [E, out, in] per role."""
    out, stacks = {}, {}
    for name, value in tensors.items():
        found = re.fullmatch(r"(.*)\.experts\.(\d+)\.(\w+)\.weight", name)
        if found is None:
            out[name] = value
        else:
            stacks.setdefault(f"{found[1]}.switch_mlp.{found[3]}.weight", {})[int(found[2])] = value
    out.update({name: torch.stack([by[e] for e in sorted(by)]) for name, by in stacks.items()})
    return out


root, model_a = format_fixtures("mlx", SIZES)




@pytest.mark.parametrize(("group", "bits", "dtype"), [
    (64, 4, "bfloat16"), (32, 4, "bfloat16"), (64, 8, "bfloat16"), (32, 8, "float16"),
])
def test_a_faithful_mlx_export_passes_on_every_layer(model_a, root, capsys, group, bits, dtype):
    b = mlx_export(model_a, root / f"faithful-{group}-{bits}-{dtype}", group=group, bits=bits, dtype=dtype)
    code, report = compare(capsys, model_a, b)
    assert code == 0, report
    assert [layer["passed"] for layer in report["layers"]] == [True, True]
    for layer in report["layers"]:
        conversion = layer["conversion"]
        assert conversion["conversion_deviation"] > 0  # quantizing moves the function: judged against that
        assert conversion["ratio_to_conversion"] == pytest.approx(1.0, abs=1e-6)  # B is A's conversion exactly
        for row in conversion["tensors"]:
            assert row["storage"] == f"mlx affine {bits}-bit/{group} ({dtype} scales)"
            assert row["step_source"] == "file" and row["steps"]["values_beyond_step"] == 0
            # half a step, a step at a clamped end of the group (measured 1.04 at most), plus the scale's bfloat16
            # rounding times codes up to 255 at 8 bits (measured 1.67)
            assert row["steps"]["max_steps"] <= (2.0 if (bits, dtype) == (8, "bfloat16") else 1.1)
            assert "mlx.core.quantize" in row["conversion"]
    assert any(f"MLX affine {bits}-bit, groups of {group}" in note for note in report["notes"])
    # outside the FFN a quantized tensor is inventoried as the matrix it holds, not as its packed uint32 words
    inventory = report["comparison"]["inventory"]
    assert inventory["shape_differs"] == [] and inventory["dtype_changes"] == {f"F32 -> {DTYPES[dtype]}": 15}


def test_every_scale_and_bias_of_a_matrix_x_1_05_is_tensor_scaled(model_a, root, capsys):
    """down_proj's scales and biases x1.05 over the same codes: B is A's x1.05, each value within a step of A's and
    the function within the conversion's deviation (it passed before ``conversion.CONVERTED_SCALE``: 0.97 x, the
    tensor's factor on A 1.046 within 0.95-1.05).  mlx.core.quantize of A is what a faithful export holds, B x 1.0000
    on it; this one x 1.05."""
    good = mlx_export(model_a, root / "scaled-good")
    parts = tuple(f"{LAYER1}.down_proj.{part}" for part in ("scales", "biases"))
    found = quantized_layer_one_named(capsys, model_a, parts_scaled(good, root / "scaled-1.05", parts, 1.05),
                                      "tensor_scaled", "down_proj")
    assert "x 1.05 over A's conversion" in found["message"], found["message"]


def test_mixed_precision_modules_are_judged_by_their_own_storage(model_a, root, capsys):
    """Per-module entries, as mlx_lm.convert's quant predicates write them: layer 1's down_proj at 8 bits in groups
    of 32, layer 0's up_proj left unquantized (false: stored in bfloat16); every layer passes, each tensor judged by
    the storage it has."""
    modules = {f"{LAYER1}.down_proj": {"group_size": 32, "bits": 8}, "model.layers.0.mlp.up_proj": False}
    b = mlx_export(model_a, root / "mixed", modules=modules)
    code, report = compare(capsys, model_a, b)
    assert code == 0, report
    storage = [{row["name"]: row["storage"] for row in layer["conversion"]["tensors"]} for layer in report["layers"]]
    four = "mlx affine 4-bit/64 (bfloat16 scales)"
    assert storage == [{"gate_proj.weight": four, "up_proj.weight": "bfloat16", "down_proj.weight": four},
                       {"gate_proj.weight": four, "up_proj.weight": four,
                        "down_proj.weight": "mlx affine 8-bit/32 (bfloat16 scales)"}]
    assert any("1 modules with their own, 1 left unquantized" in note for note in report["notes"])


@pytest.mark.parametrize(("part", "edit"), [("biases", "drop_row"), ("biases", "flat"), ("scales", "int8"),
                                           ("scales", "scalar"), ("weight", "half")])
def test_an_mlx_part_of_another_shape_or_dtype_is_exit_2_naming_it(model_a, root, capsys, part, edit):
    """Biases a row short or flat, scales as integers or one value, codes as float16: mlx's dequantizer refused
    each in its own words, an internal error here before."""
    b = mlx_export(model_a, root / f"hostile-{part}-{edit}")
    assert_hostile_part_refused(capsys, model_a, b, f"model.layers.1.mlp.down_proj.{part}", HOSTILE_PARTS[edit], 2)


def test_a_module_stored_quantized_whose_own_entry_is_false_is_named(model_a, root, capsys):
    """Each down_proj quantized (scales beside it) while its own entry in config.json's quantization says false:
    every layer fails, named quantized_module_not_stated (was exit 2 for the whole compare)."""
    down = [f"model.layers.{i}.mlp.down_proj" for i in (0, 1)]
    b = mlx_export(model_a, root / "unstated", modules=dict.fromkeys(down, False),
                   written={m: {"group_size": 64, "bits": 4} for m in down})
    assert_module_not_stated(capsys, model_a, b, lambda quantization: None)


@pytest.mark.parametrize(("case", "export", "tensor", "named", "evidence"), [
    ("bits-8-as-4", dict(written={f"{LAYER1}.up_proj": {"group_size": 64, "bits": 8}}), "up_proj",
     "mlx_bits_mismatched", "fit 8-bit codes in the stated groups of 64"),
    ("bits-4-as-8", dict(modules={f"{LAYER1}.down_proj": {"group_size": 64, "bits": 8}},
                         written={f"{LAYER1}.down_proj": {"group_size": 64, "bits": 4}}), "down_proj",
     "mlx_bits_mismatched", "fit 4-bit codes in the stated groups of 64"),
    ("group-32-as-64", dict(written={f"{LAYER1}.gate_proj": {"group_size": 32, "bits": 4}}), "gate_proj",
     "mlx_group_size_wrong", "fit groups of 32 at the stated 4 bits"),
    ("transposed", dict(breaks={f"{LAYER1}.down_proj.weight": "transposed"}), "down_proj",
     "mlx_scales_transposed", "that grid transposed"),
    ("exchanged", dict(breaks={f"{LAYER1}.gate_proj.weight": "exchanged"}), "gate_proj",
     "mlx_scales_biases_exchanged", "exchanged"),
    ("coarse", dict(breaks={f"{LAYER1}.up_proj.weight": "coarse"}), "up_proj", "grid_too_coarse", "blocks"),
    ("nan", dict(breaks={f"{LAYER1}.up_proj.weight": "nan"}), "up_proj", "nonfinite_scale",
     "groups have a NaN/Inf scale or bias"),
    ("zeroed", dict(breaks={f"{LAYER1}.down_proj.weight": "zeroed"}), "down_proj", "zeroed_tensor",
     "every code is zero"),
    # mlx_lm's stories260K stand-in with up's biases + scales was named quantization_exceeds_step, no replay near
    ("shifted", dict(breaks={f"{LAYER1}.up_proj.weight": "shifted"}), "up_proj", "zero_point_off_by_one",
     "X.biases one step up"),
])
def test_an_mlx_conversion_mistake_fails_its_layer_only_and_is_named(model_a, root, capsys, case, export, tensor,
                                                                     named, evidence):
    broken = mlx_export(model_a, root / f"broken-{case}", **export)
    found = quantized_layer_one_named(capsys, model_a, broken, named, tensor)
    assert evidence in found["message"], found["message"]
    if found["distance"] is not None:  # a replay of the function: B reproduces it far closer than it is to A
        assert found["distance"] <= 0.5 * found["reference_distance"]


def test_a_faithful_2_bit_export_is_judged_by_its_values_and_passes(model_a, root, capsys):
    """At 2 bits mlx.core.quantize of A moves each layer's output by 0.68 to 0.70 of its largest magnitude: twice that
    would pass a module that outputs zeros, and every layer of an export holding exactly mlx's quantization of A was
    exit 2 "could not be verified".  Every tensor is held to its values (within its step, each group's scale mlx's
    choice for A's, B's factor on A's conversion near 1): each layer passes, judged by them, saying so."""
    code, report = compare(capsys, model_a, mlx_export(model_a, root / "faithful-2-bit", bits=2))
    assert code == 0, [layer["unverifiable"] for layer in report["layers"]]
    for layer in report["layers"]:
        assert layer["passed"] and layer["unverifiable"] is None
        assert layer["conversion"]["conversion_deviation"] > 0.5 * layer["max_abs_diff"] / layer["max_rel_diff"]
        assert "judged by its values" in layer["conversion"]["tolerance_rule"], layer["conversion"]
    assert any("layers 0, 1 judged by the values of B" in note for note in report["notes"]), report["notes"]


@pytest.mark.parametrize(("case", "named"), [
    ("exchanged", "mlx_scales_biases_exchanged"), ("shifted", "zero_point_off_by_one"), ("zeroed", "zeroed_tensor"),
    ("transposed", "mlx_scales_transposed"), ("scaled", "tensor_scaled"), ("gate_up", "gate_up_exchanged"),
])
def test_a_2_bit_export_judged_by_its_values_still_fails_each_mistake_named(model_a, root, capsys, case, named):
    """Each mistake on one tensor of layer 1 of the 2-bit export fails that layer alone, named as at 4 bits: its
    values, not its function, carry it (each was exit 2 before, the layer unverifiable)."""
    tensor = {"exchanged": "up_proj", "shifted": "down_proj", "zeroed": "gate_proj"}.get(case, "gate_proj")
    dest = root / f"broken-2-bit-{case}"
    if case == "scaled":
        good = mlx_export(model_a, root / "faithful-2-bit-scaled", bits=2)
        broken = parts_scaled(good, dest, tuple(f"{LAYER1}.{tensor}.{part}" for part in ("scales", "biases")), 1.05)
    elif case == "gate_up":
        broken = mlx_export(broken_copy(model_a, root / "a-swapped-2-bit", ("mlp.gate_proj", "mlp.up_proj")), dest,
                            bits=2)
    else:
        broken = mlx_export(model_a, dest, bits=2, breaks={f"{LAYER1}.{tensor}.weight": case})
    found = quantized_layer_one_named(capsys, model_a, broken, named, tensor if case != "gate_up" else "_proj")
    if found["distance"] is not None:
        assert found["distance"] <= 0.5 * found["reference_distance"]


def test_gate_and_up_exchanged_in_an_mlx_export_is_named(model_a, root, capsys):
    """Today's mistakes hold for a quantized B too: layer 1's gate and up exchanged before quantizing."""
    a = broken_copy(model_a, root / "a-swapped", ("mlp.gate_proj", "mlp.up_proj"))
    code, report = compare(capsys, model_a, mlx_export(a, root / "swapped"))
    assert code == 1, report
    assert [layer["passed"] for layer in report["layers"]] == [True, False]
    found = report["layers"][1]["diagnosis"]
    assert found["id"] == "gate_up_exchanged" and found["distance"] <= 0.5 * found["reference_distance"]


def test_a_faithful_qwen2_export_passes(root, capsys):
    a = build("qwen2", root / "qwen2", 4, **SIZES)
    code, report = compare(capsys, a, mlx_export(a, root / "qwen2-mlx", group=32))
    assert code == 0, report
    assert all(row["storage"] == "mlx affine 4-bit/32 (bfloat16 scales)" for layer in report["layers"]
               for row in layer["conversion"]["tensors"])


@pytest.mark.parametrize(("quantization", "said"), [
    ({"group_size": 64, "bits": 7}, "config.json's quantization is"),
    ({"group_size": 32, "bits": 4, "mode": "mxfp5"}, "Invalid quantization mode 'mxfp5'"),
    ({"group_size": 64, "bits": 4, "mode": "mxfp4"}, "mxfp4 quantization requires group size 32"),
    ({"group_size": 64, "bits": 4, "model.layers.0.mlp.up_proj": {"bits": 0}}, "quantization['model.layers.0"),
])
def test_an_mlx_config_parity_cannot_read_is_exit_2_naming_the_field(model_a, root, capsys, quantization, said):
    b = mlx_export(model_a, root / f"config-{len(list(root.iterdir()))}")
    config = json.loads((b / "config.json").read_text())
    config["quantization"] = config["quantization_config"] = quantization
    (b / "config.json").write_text(json.dumps(config))
    code, out, err = run_main(capsys, "compare", model_a, b)
    assert code == 2, out + err
    assert said in err and "Traceback" not in err


def test_without_mlx_an_mlx_b_is_exit_2_naming_the_extra(model_a, root, capsys, monkeypatch):
    b = mlx_export(model_a, root / "no-extra")
    for module in ("mlx", "mlx.core"):
        monkeypatch.setitem(sys.modules, module, None)  # import of it raises ImportError
    code, out, err = run_main(capsys, "compare", model_a, b)
    assert code == 2, out + err
    assert "MLX-quantized" in err and "'mlx'" in err and "Traceback" not in err


def test_mlx_experts_in_switch_mlp_are_judged_one_by_one_and_a_broken_one_is_named(root, capsys):
    """A Qwen2-MoE as MLX-LM stores it: each role's experts stacked in ``mlp.switch_mlp.{role}.weight`` [E, out, in]
    and quantized as one tensor (router and shared expert quantized too, as mlx_lm.convert does for this family):
    every expert and shared expert of a faithful export passes; scales and biases exchanged in expert 2 of layer 1's
    up_proj fail that expert alone, named."""
    from .derived_checkpoints import MOE

    moe = build("qwen2_moe", root / "moe", 5, **{**MOE, **SIZES, "moe_intermediate_size": 64,
                                                 "shared_expert_intermediate_size": 64})
    code, report = compare(capsys, moe, mlx_export(moe, root / "moe-mlx"))
    assert code == 0, report
    units = [(unit["layer"], unit["expert"]) for unit in report["layers"] if unit["unit"] != "block"]
    assert len(units) == 2 * (MOE["num_experts"] + 1)  # each expert and the shared expert, per layer
    assert all(row["storage"] == "mlx affine 4-bit/64 (bfloat16 scales)" for unit in report["layers"]
               for row in unit["conversion"].get("tensors", []))
    broken = mlx_export(moe, root / "moe-mlx-broken", breaks={f"{LAYER1}.switch_mlp.up_proj.weight": "exchanged@2"})
    code, report = compare(capsys, moe, broken)
    assert code == 1, report
    failed = [(unit["layer"], unit["expert"], unit["diagnosis"]["id"]) for unit in report["layers"]
              if not unit["passed"]]
    assert failed == [(1, 2, "mlx_scales_biases_exchanged")]


def test_a_check_of_an_mlx_release_runs_on_its_dequantized_weights(model_a, root, capsys):
    """``parity B`` (a check, not a compare): target and reference both get B's weights as mlx dequantizes them."""
    b = mlx_export(model_a, root / "check")
    code, out, err = run_main(capsys, b, "--layers", "all")
    assert code == 0, out + err
    assert "MLX affine 4-bit, groups of 64" in out and "the same dequantized float32 weights" in out


def test_an_mlx_release_from_the_hugging_face_cache_is_read_as_a_local_one(model_a, root, tmp_path, capsys,
                                                                           monkeypatch):
    """B given as a hub id (mlx-community's repos), offline, from the Hugging Face cache: read through the hub path,
    dequantized the same way, every layer passes."""
    from .support import cache_repo, use_hf_home

    home = use_hf_home(monkeypatch, tmp_path / "hf")
    cache_repo(home, "mlx-community/tiny-llama-4bit", mlx_export(model_a, root / "hub"))
    code, report = compare(capsys, model_a, "mlx-community/tiny-llama-4bit")
    assert code == 0, report
    assert all(row["storage"] == "mlx affine 4-bit/64 (bfloat16 scales)" for layer in report["layers"]
               for row in layer["conversion"]["tensors"])


MODES = ("mxfp4", "mxfp8", "nvfp4")


@pytest.mark.parametrize("mode", MODES)
def test_a_faithful_microscaled_export_passes_on_every_layer(model_a, root, capsys, mode):
    """``mlx_lm.convert -q --q-mode {mxfp4, mxfp8, nvfp4}``: uint8 scales (e8m0, e8m0, e4m3) and no biases, each
    code a floating-point value; every layer passes, B exactly A's re-quantization, each value within its code's gap
    times its group's scale (or, at the top level, what a scale rounded down clips)."""
    b = mlx_export(model_a, root / f"faithful-{mode}", mode=mode)
    code, report = compare(capsys, model_a, b)
    assert code == 0, report
    group = 16 if mode == "nvfp4" else 32
    for layer in report["layers"]:
        conversion = layer["conversion"]
        assert conversion["conversion_deviation"] > 0
        assert conversion["ratio_to_conversion"] == pytest.approx(1.0, abs=1e-6)
        for row in conversion["tensors"]:
            assert row["storage"] == f"mlx {mode}/{group}"
            assert row["step_source"] == "file" and row["steps"]["values_beyond_step"] == 0
            # half a gap, plus A's own bfloat16 rounding (measured 0.53); nvfp4's e4m3 scale rounded down clips the
            # top level (measured 1.47 on mlx-lm's own exports)
            assert 0 < row["steps"]["max_steps"] <= (2.0 if mode == "nvfp4" else 0.6)
    assert any(f"MLX {mode}, groups of {group}" in note for note in report["notes"])
    inventory = report["comparison"]["inventory"]
    assert inventory["shape_differs"] == [] and inventory["dtype_changes"] == {f"F32 -> {mode.upper()}": 10,
                                                                               "F32 -> BF16": 5}


def test_rows_whose_nvfp4_scales_underflow_pass_where_b_is_a_s_conversion(model_a, root, capsys):
    """nvfp4 without a global scale, of a layer whose rows of each matrix lie near 2e-5 (rows x 4e-4, as trained
    checkpoints hold near-dead rows): each such group's scale, amax / 6, lies below e4m3's smallest subnormal, so
    mlx stores it 0 and every value of the group 0, as A's own conversion holds it.  A step of 0 read as "inf steps"
    and every faithful export failed quantization_exceeds_step; a value equal to A's conversion is within its step."""
    a = rows_scaled(model_a, root / "a-quiet-rows", LAYER1, 4e-4)
    code, report = compare(capsys, a, mlx_export(a, root / "nvfp4-quiet-rows", mode="nvfp4"))
    assert code == 0, report
    for row in report["layers"][1]["conversion"]["tensors"]:
        assert row["steps"]["values_beyond_step"] == 0 and row["steps"]["max_steps"] <= 2.0, row


@pytest.mark.parametrize(("case", "mode", "tensor", "named", "evidence"), [
    ("doubled", "mxfp4", "up_proj", "tensor_scaled", "up_proj.weight x 1.9"),
    ("coarse", "mxfp4", "down_proj", "grid_too_coarse", "blocks"),
    ("gguf_order", "mxfp4", "gate_proj", "packed_order_wrong", "ggml's MXFP4 order"),
    ("nan", "mxfp8", "up_proj", "nonfinite_scale", "groups have a NaN/Inf scale"),
    ("coarse", "nvfp4", "gate_proj", "grid_too_coarse", "blocks"),
    ("affine", "mxfp4", "down_proj", "mlx_mode_wrong", "as MLX's affine mode stores them; config.json states mxfp4"),
])
def test_a_microscaled_conversion_mistake_fails_its_layer_only_and_is_named(model_a, root, capsys, case, mode,
                                                                            tensor, named, evidence):
    broken = mlx_export(model_a, root / f"broken-{mode}-{case}", mode=mode,
                        breaks={f"{LAYER1}.{tensor}.weight": case})
    found = quantized_layer_one_named(capsys, model_a, broken, named, tensor)
    assert evidence in found["message"], found["message"]
    if found["distance"] is not None:
        assert found["distance"] <= 0.5 * found["reference_distance"]


def test_an_nvfp4_export_with_global_scales_is_read_with_them_and_one_doubled_is_named(model_a, root, capsys):
    """nvfp4 quantized with mlx's ``global_scale`` (stored as X.global_scale beside each matrix): mlx.core.dequantize
    takes it, and every value's scale is its e4m3 byte times global_scale / (448 x 6).  Read without it, every layer
    of a faithful export failed grid_too_coarse; read with it (dequantized by mlx, A re-quantized at B's global
    scale), every layer passes at A's re-quantization.  One stored twice what it was quantized with moves the whole
    matrix: its layer fails, named with the factor."""
    b = mlx_export(model_a, root / "nvfp4-global", mode="nvfp4", global_scale=True)
    code, report = compare(capsys, model_a, b)
    assert code == 0, report
    for layer in report["layers"]:
        assert layer["conversion"]["ratio_to_conversion"] == pytest.approx(1.0, abs=1e-6)
        for row in layer["conversion"]["tensors"]:
            assert "at B's global scale" in row["conversion"] and row["steps"]["values_beyond_step"] == 0, row
    broken = mlx_export(model_a, root / "nvfp4-global-x2", mode="nvfp4", global_scale=True,
                        breaks={f"{LAYER1}.up_proj.weight": "global_x2"})
    found = quantized_layer_one_named(capsys, model_a, broken, "tensor_scaled", "up_proj")
    factor = float(re.search(r"up_proj\.weight x ([0-9.]+)", found["message"]).group(1))
    assert 1.9 <= factor <= 2.1, found["message"]
    # x 1.1: every value within its (wide) step and the function within its tolerance, but B's least-squares factor
    # on A's conversion outside what round to nearest leaves (conversion.CONVERTED_SCALE); it passed before
    broken = mlx_export(model_a, root / "nvfp4-global-x1.1", mode="nvfp4", global_scale=True,
                        breaks={f"{LAYER1}.up_proj.weight": "global_x1.1"})
    found = quantized_layer_one_named(capsys, model_a, broken, "tensor_scaled", "up_proj")
    factor = float(re.search(r"is A's x ([0-9.]+)", found["message"]).group(1))
    assert 1.07 <= factor <= 1.12 and "within 0.98 to 1.02" in found["message"], found["message"]


@pytest.mark.parametrize("factor", [1 / 6, 6.0, 1e-30, 1e30])
def test_an_nvfp4_global_scale_far_off_is_tensor_scaled_never_unverifiable(model_a, root, capsys, factor):
    """down_proj's global scale stored ``factor`` x the one quantized with: A re-quantized at it overflowed or
    underflowed e4m3's scales, so A's own conversion lay as far from A as B and the layer was exit 2 "could not be
    verified" (1/6, 1e-30, 1e30; x 6 was named).  Where B's global scale rounds A more than
    ``mlx_grid.GLOBAL_SOUND`` x worse than the one a writer gives A, A is re-quantized at that one, saying so, and
    B's factor is named."""
    good = root / "nvfp4-global-good"
    if not good.exists():
        mlx_export(model_a, good, mode="nvfp4", global_scale=True)
    b = parts_scaled(good, root / f"nvfp4-global-{factor:g}", (f"{LAYER1}.down_proj.global_scale",), factor)
    found = quantized_layer_one_named(capsys, model_a, b, "tensor_scaled", "down_proj")
    said = float(re.search(r"down_proj\.weight (?:\(.*?\) is A's )?x ([0-9.e+-]+)", found["message"]).group(1))
    assert 0.9 < said / factor < 1.1, found["message"]


def test_a_global_scale_beside_no_quantized_matrix_stays_in_the_inventory(model_a, root, capsys):
    """Only a quantized matrix's X.global_scale (beside its X.scales) is part of its storage; one beside a norm or
    beside nothing is a tensor of B's own, listed as only in B (hidden before)."""
    b = mlx_export(model_a, root / "global-stray", mode="nvfp4")
    tensors = load_file(b / "model.safetensors")
    stray = ["model.layers.1.input_layernorm.global_scale", "model.layers.1.mlp.nothing.global_scale"]
    tensors.update({name: torch.tensor(1.0) for name in stray})
    save_file(tensors, b / "model.safetensors", metadata={"format": "mlx"})
    code, report = compare(capsys, model_a, b)
    assert code == 0, report
    assert sorted(report["comparison"]["inventory"]["only_in_b"]) == stray


@pytest.mark.parametrize(("mode", "value", "said"), [
    ("mxfp4", torch.tensor(1.0), "mlx takes a global scale in nvfp4 mode only"),
    ("nvfp4", torch.tensor([1.0, 2.0]), "one positive finite float32 global scale per tensor"),
    ("nvfp4", torch.tensor(float("nan")), "one positive finite float32 global scale per tensor"),
    ("nvfp4", torch.tensor(1.0, dtype=torch.bfloat16), "one positive finite float32 global scale per tensor"),
])
def test_a_global_scale_mlx_cannot_take_is_exit_2_naming_it(model_a, root, capsys, mode, value, said):
    b = mlx_export(model_a, root / f"global-{mode}-{value.numel()}-{value.dtype}-{bool(value.isnan().any())}",
                   mode=mode)
    tensors = load_file(b / "model.safetensors")
    tensors[f"{LAYER1}.down_proj.global_scale"] = value
    save_file(tensors, b / "model.safetensors", metadata={"format": "mlx"})
    code, out, err = run_main(capsys, "compare", model_a, b)
    assert code == 2, out + err
    assert f"{LAYER1}.down_proj.global_scale" in err and said in err, err
    assert "Traceback" not in err


def test_a_microscaled_export_whose_config_says_affine_fails_every_layer_naming_the_mode(model_a, root, capsys):
    """An mxfp4 export whose config.json lost its mode (read as affine, mlx's default): the uint8 scales without
    biases are named on every layer, not dequantized on the wrong grid."""
    b = mlx_export(model_a, root / "mode-lost", mode="mxfp4", stated="affine")
    code, report = compare(capsys, model_a, b)
    assert code == 1, report
    assert [layer["diagnosis"]["id"] for layer in report["layers"]] == ["mlx_mode_wrong"] * 2
    assert "uint8 with no" in report["layers"][0]["diagnosis"]["message"]


def test_gate_and_up_exchanged_in_an_nvfp4_export_is_named(model_a, root, capsys):
    a = root / "a-swapped-nvfp4"
    shutil.copytree(model_a, a)
    tensors = load_file(a / "model.safetensors")
    gate, up = f"{LAYER1}.gate_proj.weight", f"{LAYER1}.up_proj.weight"
    tensors[gate], tensors[up] = tensors[up].clone(), tensors[gate].clone()
    save_file(tensors, a / "model.safetensors", metadata={"format": "pt"})
    code, report = compare(capsys, model_a, mlx_export(a, root / "swapped-nvfp4", mode="nvfp4"))
    assert code == 1, report
    assert [layer["passed"] for layer in report["layers"]] == [True, False]
    assert report["layers"][1]["diagnosis"]["id"] == "gate_up_exchanged"


def test_mxfp4_experts_in_switch_mlp_are_judged_one_by_one(root, capsys):
    """A Qwen2-MoE's stacked experts in mxfp4 (GPT-OSS's own format, as mlx-lm writes it): each expert's slice is
    read with its own scales; every (layer, expert) of a faithful export passes."""
    from .derived_checkpoints import MOE

    moe = build("qwen2_moe", root / "moe-mx", 5, **{**MOE, **SIZES, "moe_intermediate_size": 64,
                                                    "shared_expert_intermediate_size": 64})
    code, report = compare(capsys, moe, mlx_export(moe, root / "moe-mxfp4", mode="mxfp4"))
    assert code == 0, report
    units = [unit for unit in report["layers"] if unit["unit"] != "block"]
    assert len(units) == 2 * (MOE["num_experts"] + 1)
    assert all(row["storage"] == "mlx mxfp4/32" for unit in units for row in unit["conversion"]["tensors"])
