"""``parity compare A B`` where B is a bitsandbytes 4-bit checkpoint (what ``save_pretrained`` writes for a model loaded
with ``BitsAndBytesConfig(load_in_4bit=True)``): each quantized linear ``X`` stored as ``X.weight`` (uint8, two codes a
byte) beside its quant state (``X.weight.absmax``, ``.quant_map``, ``.nested_absmax``, ``.nested_quant_map``,
``.quant_state.bitsandbytes__nf4``), config.json's ``quantization_config`` transformers' own ``BitsAndBytesConfig``.

A is a tiny LLaMA built with transformers' own classes (FFN sides 160 and 200: rows not a multiple of the 64-value
block).  B is quantized here by bitsandbytes' own CPU functions (``quantize_4bit``, as ``Linear4bit`` quantizes a
weight) and written as ``Linear4bit._save_to_state_dict`` writes it (``QuantState.as_dict(packed=True)`` under
``X.weight.``): faithful, and with one conversion mistake on layer 1 only.  (transformers' own loader needs
accelerate to quantize, which this project does not install; the layout is bitsandbytes'.)
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from .derived_checkpoints import (
    assert_module_not_stated,
    build,
    format_fixtures,
    parts_scaled,
    quantized_copy,
    quantized_layer_one_named,
    save_quantized,
    skip_listed,
)
from .support import compare_json as compare
from .support import run_main, run_parity

functional = pytest.importorskip("bitsandbytes.functional")

SIZES = dict(hidden_size=160, intermediate_size=200, num_key_value_heads=2)
FFN = ("gate_proj", "up_proj", "down_proj")


def quant_state(value: torch.Tensor, quant_type: str, double_quant: bool, how: str | None,
                storage: torch.dtype = torch.uint8):
    """bitsandbytes' packed codes and QuantState of ``value`` as a faithful writer makes them, or with mistake
    ``how``: as_nf4 (FP4 codes stated as NF4), fp4_map (NF4 codes beside FP4's quant_map), block128 (quantized in
    128-value blocks, stated as 64), offset (double quant's absmax written without its offset), coarse (every absmax
    doubled)."""
    stated = quant_type
    if how == "as_nf4":
        quant_type = "fp4"
    nested = double_quant or how == "offset"
    packed, state = functional.quantize_4bit(value.float(), blocksize=128 if how == "block128" else 64,
                                             compress_statistics=nested, quant_type=quant_type,
                                             quant_storage=storage)
    if how == "offset":  # absmax written as plain float32, dequantized without the stored offset
        absmax = functional.dequantize_blockwise(state.absmax, state.state2)
        state = functional.QuantState(absmax=absmax, shape=state.shape, code=state.code, blocksize=64,
                                      quant_type=quant_type, dtype=state.dtype)
    state.quant_type = stated
    if how in ("as_nf4", "fp4_map"):
        state.code = functional.get_4bit_type({"as_nf4": "nf4", "fp4_map": "fp4"}[how], device="cpu")
    if how == "block128":
        state.blocksize = 64
    if how == "coarse":  # each block's absmax twice A's largest magnitude there, the codes rounded on that grid
        absmax = value.float().reshape(-1, 64).abs().amax(-1) * 2
        scaled = (value.float().reshape(-1, 64) / absmax[:, None]).reshape(-1)
        codes = (scaled[:, None] - state.code[None, :]).abs().argmin(-1).to(torch.uint8)
        packed = ((codes[0::2] << 4) | codes[1::2]).reshape(-1, 1)
        state = functional.QuantState(absmax=absmax, shape=state.shape, code=state.code, blocksize=64,
                                      quant_type=stated, dtype=state.dtype)
    return packed, state


def bnb_export(a: Path, dest: Path, quant_type: str = "nf4", double_quant: bool = True,
               breaks: dict[str, str] | None = None, keep: tuple[str, ...] = (),
               storage: torch.dtype = torch.uint8) -> Path:
    """A's folder written as a bitsandbytes 4-bit checkpoint (every linear weight of the decoder layers), the tensors
    named in ``breaks`` written with that mistake (``quant_state``'s); modules named in ``keep`` stay unquantized,
    cast to bfloat16 and listed in llm_int8_skip_modules; the packed codes held in ``storage``
    (``bnb_4bit_quant_storage``: the same bytes, viewed as that dtype)."""
    from transformers import BitsAndBytesConfig

    shutil.copytree(a, dest)
    out = {}
    for name, value in load_file(a / "model.safetensors").items():
        kept = any(f".{module}." in name for module in keep)
        if ".layers." not in name or value.dim() != 2 or kept:
            out[name] = value.bfloat16() if kept else value
            continue
        packed, state = quant_state(value, quant_type, double_quant, (breaks or {}).get(name), storage)
        out[name] = packed
        out.update({f"{name}.{key}": tensor for key, tensor in state.as_dict(packed=True).items()})
    save_file(out, dest / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dest / "config.json").read_text())
    stated = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                                bnb_4bit_use_double_quant=double_quant, llm_int8_skip_modules=list(keep) or None,
                                bnb_4bit_quant_storage=storage)
    config["quantization_config"] = json.loads(json.dumps(stated.to_dict()))
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dest


root, model_a = format_fixtures("bnb", SIZES)


@pytest.fixture(scope="module")
def faithful(model_a, root) -> Path:
    return bnb_export(model_a, root / "faithful")




@pytest.mark.parametrize(("quant_type", "double_quant"), [("nf4", True), ("nf4", False), ("fp4", True),
                                                          ("fp4", False)])
def test_a_faithful_bnb_export_passes_on_every_layer(model_a, root, capsys, quant_type, double_quant):
    b = bnb_export(model_a, root / f"faithful-{quant_type}-{double_quant}", quant_type, double_quant)
    code, report = compare(capsys, model_a, b)
    assert code == 0, report
    assert [layer["passed"] for layer in report["layers"]] == [True, True]
    for layer in report["layers"]:
        conversion = layer["conversion"]
        assert conversion["conversion_deviation"] > 0  # 4-bit moves the function: judged against that, not noise
        assert conversion["ratio_to_conversion"] == pytest.approx(1.0, abs=1e-6)  # B is A's conversion exactly
        for row in conversion["tensors"]:
            assert row["storage"] == quant_type and row["step_source"] == "file"
            assert row["steps"]["values_beyond_step"] == 0
            # round to the nearest level: half its wider gap; double quant reads each absmax back from its 8-bit code
            # (measured up to 0.52 steps here: the absmax up to 0.9% off moves the top level by 0.03 of its gap)
            assert row["steps"]["max_steps"] <= (0.55 if double_quant else 0.5 + 1e-3)
            assert "bitsandbytes' quantize_4bit" in row["conversion"]
    assert any(f"bitsandbytes 4-bit {quant_type.upper()}" in note for note in report["notes"])


def test_codes_held_in_another_storage_dtype_are_read_as_their_bytes(model_a, root, capsys):
    """``bnb_4bit_quant_storage=torch.bfloat16`` (for FSDP) keeps the same packed bytes viewed as bfloat16: [n / 4, 1]
    elements of two bytes.  transformers' own save of stories260K's stand-in so stored was exit 2 ('2752 bytes, too
    few for the 11008 4-bit codes': the elements counted as bytes)."""
    b = bnb_export(model_a, root / "faithful-bf16-storage", storage=torch.bfloat16)
    assert load_file(b / "model.safetensors")["model.layers.0.mlp.up_proj.weight"].dtype == torch.bfloat16
    code, report = compare(capsys, model_a, b)
    assert code == 0, report
    for layer in report["layers"]:
        assert layer["conversion"]["ratio_to_conversion"] == pytest.approx(1.0, abs=1e-6)
        assert all(row["steps"]["values_beyond_step"] == 0 for row in layer["conversion"]["tensors"])


@pytest.mark.parametrize(("tensor", "how", "named"), [
    ("gate_proj", "as_nf4", "bnb_code_book_wrong"),
    ("up_proj", "fp4_map", "bnb_code_book_wrong"),
    ("down_proj", "block128", "bnb_block_size_wrong"),
    ("up_proj", "offset", "bnb_double_quant_not_undone"),
    ("down_proj", "coarse", "grid_too_coarse"),
])
def test_a_bnb_conversion_mistake_fails_its_layer_only_and_is_named(model_a, root, capsys, tensor, how, named):
    broken = bnb_export(model_a, root / f"{how}-{tensor}", breaks={f"model.layers.1.mlp.{tensor}.weight": how})
    found = quantized_layer_one_named(capsys, model_a, broken, named, tensor)
    if how == "fp4_map":
        assert "quant_map is FP4's code book where its quant_state says nf4" in found["message"]
    elif how == "block128":
        assert "absmax has 250 entries" in found["message"] and "calls for 500" in found["message"]
    elif found["distance"] is not None:  # a replay of the function: B reproduces it far closer than it is to A
        assert found["distance"] <= 0.5 * found["reference_distance"]


def test_the_flat_read_follows_the_format_where_bitsandbytes_cpu_kernel_may_read_rows_off_the_block(
        model_a, faithful):
    """The figure parity.sources.bnb_4bit gives for reading each matrix flat: on some CPUs, bitsandbytes' CPU
    dequantize_4bit with the stored [rows, columns] shape lands 3.8 to 3.9 steps from A's values on the
    [200, 160] matrices (rows of 2.5 blocks of 64); on others (an AMD EPYC without AVX-512) the same
    call reads them right.  The flat read lies within half a step of every value (plus double quant's absmax
    rounding) on every machine, as rounding to the nearest level does; on [160, 200] the two agree."""
    import copy

    from parity.engine.compare.codebook_grid import steps, unpack
    from parity.sources.bnb_4bit import Bnb4bitCheckpoint

    original, stored = load_file(model_a / "model.safetensors"), load_file(faithful / "model.safetensors")
    for name in (f"model.layers.{layer}.mlp.{t}.weight" for layer in (0, 1) for t in FFN):
        prefix = len(name) + 1
        state = functional.QuantState.from_dict({k[prefix:]: v for k, v in stored.items() if k.startswith(name + ".")},
                                                device="cpu")
        a, packed = original[name].double(), stored[name]
        flat = copy.copy(state)
        flat.shape = torch.Size([a.numel()])
        as_stored = functional.dequantize_4bit(packed, state).double()
        as_flat = functional.dequantize_4bit(packed, flat).reshape(a.shape).double()
        step = steps(unpack(packed, a.numel()), Bnb4bitCheckpoint.dequantize_absmax(state), state.code, 64,
                     a.shape).double()
        flat_steps = float(((as_flat - a).abs() / step).max())
        misread = float(((as_stored - a).abs() / step).max())
        print(name, list(a.shape), f"flat {flat_steps:.3f} stored-shape {misread:.3f} steps")
        assert flat_steps <= 0.55, name  # double quant: the absmax read back from its 8-bit code (see above)
        # the stored-shape read is the kernel's, which differs by machine (measured: 3.76 and 3.93 steps on the
        # [200, 160] matrices on one, 0.52 on an AMD EPYC without AVX-512): reported, never relied on
        if list(a.shape) == [160, 200]:
            assert misread <= 0.55, (name, misread)


@pytest.mark.parametrize("factor", [1.05, 0.95])
def test_every_absmax_of_a_matrix_a_twentieth_off_is_tensor_scaled(model_a, root, capsys, factor):
    """down_proj's absmax x1.05 (x0.95) over the same codes (no double quantization: absmax stored float32): each
    value within a step of A's, the function within 1.3 x the conversion's deviation (x1.1 and x0.9 passed too,
    before ``conversion.CONVERTED_SCALE``); bitsandbytes' quantize_4bit of A is what a faithful export holds."""
    good = root / "absmax-good"
    if not good.exists():
        bnb_export(model_a, good, double_quant=False)
    part = "model.layers.1.mlp.down_proj.weight.absmax"
    found = quantized_layer_one_named(capsys, model_a, parts_scaled(good, root / f"absmax-{factor}", (part,), factor),
                                      "tensor_scaled", "down_proj")
    said = float(found["message"].split("is A's x ")[1].split(" ")[0])  # over A, or over A's conversion
    assert abs(said - factor) < 0.01, found["message"]


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_a_faithful_double_quant_export_of_heavy_tailed_weights_passes(root, capsys, quant_type):
    """Student-t weights (2 degrees of freedom) with rows a thousand times smaller, d_ff 172 as stories260K's: double
    quant stores each block's absmax as an 8-bit code of absmax - mean, up to 1.18 x A's largest magnitude there and
    below zero for the smallest rows: every layer failed grid_too_coarse, and then quantization_exceeds_step (values
    3.6 steps off, or without bound where the stored absmax came out 0).  A's need is its absmax as double quant
    stores it, and each value may lie as far as that storing moves it (``codebook_grid.nested_allowance``)."""
    a = root / "heavy-a"
    if not a.exists():
        build("llama", a, 11, hidden_size=64, intermediate_size=172, num_key_value_heads=2)
        tensors = load_file(a / "model.safetensors")
        generator = torch.Generator().manual_seed(11)
        for name, value in tensors.items():
            if ".mlp." in name:
                normal = [torch.randn(value.shape, generator=generator) for _ in range(3)]
                heavy = normal[0] / ((normal[1] ** 2 + normal[2] ** 2) / 2).sqrt() * 0.02  # Student-t, 2 degrees
                heavy[::7] *= 1e-3
                tensors[name] = heavy
        save_file(tensors, a / "model.safetensors", metadata={"format": "pt"})
    b = bnb_export(a, root / f"heavy-{quant_type}", quant_type=quant_type, double_quant=True)
    code, report = compare(capsys, a, b)
    assert code == 0, [layer["diagnosis"] for layer in report["layers"]]


def test_modules_left_unquantized_are_judged_by_their_own_storage(model_a, root, capsys):
    """llm_int8_skip_modules: down_proj kept in bfloat16 is judged as a cast, gate and up by their 4-bit steps."""
    mixed = bnb_export(model_a, root / "mixed", keep=("down_proj",))
    code, report = compare(capsys, model_a, mixed)
    assert code == 0, report
    for layer in report["layers"]:
        storage = {row["name"]: row["storage"] for row in layer["conversion"]["tensors"]}
        assert storage == {"gate_proj.weight": "nf4", "up_proj.weight": "nf4", "down_proj.weight": "bfloat16"}
    assert any("left unquantized: down_proj" in note for note in report["notes"])


@pytest.mark.parametrize("width", ["4bit", "8bit"])
def test_a_module_stored_quantized_that_llm_int8_skip_modules_names_is_named(model_a, root, capsys, width):
    """down_proj stored in 4 or 8 bits while llm_int8_skip_modules names it: transformers would keep it a Linear and
    load its codes as its weight (a silent pass before)."""
    b = (bnb_export if width == "4bit" else int8_export)(model_a, root / f"unstated-{width}")
    assert_module_not_stated(capsys, model_a, b, skip_listed("llm_int8_skip_modules"))


def test_a_skipped_module_with_a_broken_cast_fails_as_a_cast(model_a, root, capsys):
    """A module listed in llm_int8_skip_modules whose bfloat16 values were corrupted fails as the cast it is."""
    mixed = bnb_export(model_a, root / "mixed-broken", keep=("down_proj",))
    tensors = load_file(mixed / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = tensors[name].clone()
    tensors[name][3, :40] = tensors[name][3, :40] * 3
    save_file(tensors, mixed / "model.safetensors", metadata={"format": "pt"})
    code, report = compare(capsys, model_a, mixed)
    assert code == 1, report
    assert [layer["passed"] for layer in report["layers"]] == [True, False]
    assert report["layers"][1]["diagnosis"]["id"] == "value_corrupted"


def test_without_bitsandbytes_a_bnb_b_is_exit_2_naming_the_extra(model_a, faithful, capsys, monkeypatch):
    for module in ("bitsandbytes", "bitsandbytes.functional"):
        monkeypatch.setitem(sys.modules, module, None)  # import of it raises ImportError
    code, out, err = run_main(capsys, "compare", model_a, faithful)
    assert code == 2, out + err
    assert "bitsandbytes" in err and "'bnb'" in err and "4-bit quantized" in err and "Traceback" not in err


@pytest.mark.parametrize(("part", "edit", "said"), [
    ("nested_absmax", lambda t: t[:0], "a nested_absmax of 0 float32 entries"),
    ("nested_absmax", lambda t: t.to(torch.int32), "a nested_absmax of 2 int32 entries"),
    ("nested_quant_map", lambda t: t[:16], "a nested_quant_map of 16 entries"),
    ("absmax", lambda t: t.float(), "another dtype than the uint8 codes"),
    ("quant_map", lambda t: t[:8], "quant_map has 8 entries"),
])
def test_a_quant_state_part_bitsandbytes_would_read_past_is_exit_2_naming_it(model_a, faithful, root, part, edit,
                                                                              said):
    """A double quant's nested_absmax empty (bitsandbytes' native dequantizer read past it and the process ended
    with a segmentation fault), of another dtype, or a code book of another length: exit 2 naming the tensor, in a
    real process (a crash must show as one)."""
    b = root / f"state-{part}-{len(list(root.iterdir()))}"
    shutil.copytree(faithful, b)
    tensors = load_file(b / "model.safetensors")
    name = f"model.layers.1.mlp.down_proj.weight.{part}"
    tensors[name] = edit(tensors[name]).contiguous()
    save_file(tensors, b / "model.safetensors", metadata={"format": "pt"})
    done = run_parity("compare", model_a, b)
    assert done.returncode == 2, done.stdout + done.stderr
    assert said in done.stderr and "down_proj" in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize(("fields", "said"), [
    ({"load_in_4bit": False, "_load_in_4bit": False}, "bitsandbytes writes one of them true"),
    ({"bnb_4bit_quant_type": "int4"}, "bnb_4bit_quant_type is 'int4'"),
])
def test_a_bnb_config_parity_cannot_read_is_exit_2_naming_the_field(model_a, faithful, root, capsys, fields, said):
    b = root / f"config-{len(list(root.iterdir()))}"
    shutil.copytree(faithful, b)
    config = json.loads((b / "config.json").read_text())
    config["quantization_config"].update(fields)
    (b / "config.json").write_text(json.dumps(config))
    code, out, err = run_main(capsys, "compare", model_a, b)
    assert code == 2, out + err
    assert said in err and "config.json" in err and "Traceback" not in err


def test_a_check_of_a_bnb_checkpoint_runs_on_its_dequantized_weights(faithful, capsys):
    code, out, err = run_main(capsys, faithful, "--layers", "all")
    assert code == 0, out + err
    assert "bitsandbytes 4-bit NF4" in out and "the same dequantized float32 weights" in out


def int8_export(a: Path, dest: Path, breaks: dict[str, str] | None = None) -> Path:
    """A's folder as an LLM.int8 checkpoint, as ``Linear8bitLt._save_to_state_dict`` writes it: every linear weight of
    the decoder layers int8 codes (bitsandbytes' ``int8_vectorwise_quant``) beside ``SCB`` and ``weight_format``; the
    tensors in ``breaks``: scb127 (SCB stored divided by 127 once more), scb_cols (SCB of the transposed matrix, one
    per column)."""
    from transformers import BitsAndBytesConfig

    def stored(name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
        how = (breaks or {}).get(name)
        codes, scb, _ = functional.int8_vectorwise_quant(value.float().contiguous())
        if how == "scb_cols":
            codes, scb, _ = functional.int8_vectorwise_quant(value.float().t().contiguous())
            codes = codes.t().contiguous()
        prefix = name.removesuffix("weight")
        return {name: codes, prefix + "SCB": scb / 127 if how == "scb127" else scb,
                prefix + "weight_format": torch.tensor(0, dtype=torch.uint8)}

    return save_quantized(dest, quantized_copy(a, dest, stored),
                          json.loads(json.dumps(BitsAndBytesConfig(load_in_8bit=True).to_dict())))


def test_a_faithful_llm_int8_export_passes_on_every_layer(model_a, root, capsys):
    b = int8_export(model_a, root / "int8")
    code, report = compare(capsys, model_a, b)
    assert code == 0, report
    for layer in report["layers"]:
        conversion = layer["conversion"]
        assert conversion["ratio_to_conversion"] == pytest.approx(1.0, abs=1e-6)
        for row in conversion["tensors"]:
            assert row["storage"] == "int8" and "int8_vectorwise_quant" in row["conversion"]
            assert row["steps"]["values_beyond_step"] == 0 and row["steps"]["max_steps"] <= 0.5 + 1e-3
    assert any("bitsandbytes 8-bit (LLM.int8" in note for note in report["notes"])


@pytest.mark.parametrize(("tensor", "how", "named"), [("up_proj", "scb127", "tensor_scaled"),
                                                      ("down_proj", "scb_cols", "bnb_block_size_wrong")])
def test_an_llm_int8_mistake_fails_its_layer_only_and_is_named(model_a, root, capsys, tensor, how, named):
    b = int8_export(model_a, root / f"int8-{how}", {f"model.layers.1.mlp.{tensor}.weight": how})
    code, report = compare(capsys, model_a, b)
    assert code == 1, report
    assert [layer["passed"] for layer in report["layers"]] == [True, False]
    found = report["layers"][1]["diagnosis"]
    assert found["id"] == named and tensor in found["message"], found


def test_a_bnb_checkpoint_from_the_hugging_face_cache_is_read_as_a_local_one(model_a, faithful, tmp_path, capsys,
                                                                             monkeypatch):
    """B given as a hub id, offline, from the Hugging Face cache: read through the hub path, dequantized the same
    way, every layer passes."""
    from .support import cache_repo, use_hf_home

    home = use_hf_home(monkeypatch, tmp_path / "hf")
    cache_repo(home, "someone/tiny-llama-bnb-4bit", faithful)
    code, report = compare(capsys, model_a, "someone/tiny-llama-bnb-4bit")
    assert code == 0, report
    assert all(row["storage"] == "nf4" for layer in report["layers"] for row in layer["conversion"]["tensors"])
