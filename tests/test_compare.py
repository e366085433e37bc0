"""`parity compare A B`: a checkpoint judged against the checkpoint it was made from, layer by layer.

Every fixture is written here from one tiny LLaMA (and a tiny GPT-2 for Conv1D layouts): faithful re-saves,
casts and GGUF exports (written with the gguf package's own writer and quantizer) must pass; each broken
export injects one conversion mistake into one layer, which must fail and be named there while the other
layers pass.
"""

from __future__ import annotations

import json
import re
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import parity
from parity.engine.results import SCHEMA_FILE

from .builders import MIXTRAL, tiny_model
from .conftest import build_model, save
from .gguf_files import HF_TO_GGUF, Q, gguf_from_hf, gguf_gpt2, write_gguf
from .support import run_json, run_main, run_parity

SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3)
MLP = "model.layers.{}.mlp.{}_proj.weight"


class Edited:
    """What gguf_from_hf reads of a model (config, state_dict), with edited tensors."""

    def __init__(self, model, state: dict[str, torch.Tensor]):
        self.config, self._state = model.config, state

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._state


def export(folder: Path, source: Path, state: dict[str, torch.Tensor]) -> Path:
    """A safetensors checkpoint with ``source``'s config.json and these tensors."""
    folder.mkdir(parents=True)
    shutil.copy(source / "config.json", folder / "config.json")
    save_file({k: v.contiguous().clone() for k, v in state.items()}, folder / "model.safetensors")
    return folder


@pytest.fixture(scope="session")
def llama():
    return build_model("llama", seed=41, **SIZES)


@pytest.fixture(scope="session")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("compare")


@pytest.fixture(scope="session")
def a_f32(llama, root):
    return save(llama, root / "a-f32")


@pytest.fixture(scope="session")
def a_bf16(root):
    return save(build_model("llama", seed=41, **SIZES).to(torch.bfloat16), root / "a-bf16")


@pytest.fixture(scope="session")
def state(a_f32):
    return load_file(a_f32 / "model.safetensors")


def edited(state: dict, **changes) -> dict:
    """A copy of ``state`` with ``layer.proj`` keys (``"1.gate"``) replaced."""
    out = dict(state)
    for key, fn in changes.items():
        layer, proj = key.split("_")
        out[MLP.format(layer, proj)] = fn(state)
    return out


# -- faithful conversions pass ------------------------------------------------------------------------------

def test_a_faithful_resave_passes_bit_identical(a_f32, llama, root, capsys):
    b = save(llama, root / "resave")
    code, data, _ = run_json(capsys, "compare", a_f32, b)
    assert code == 0 and data["passed"] and len(data["layers"]) == 3
    for layer in data["layers"]:
        assert layer["max_abs_diff"] == 0.0 and layer["conversion"]["identical"]
        assert layer["conversion"]["kind"] == "same dtype"
        assert layer["tolerance"] == pytest.approx(16 * layer["noise_floor"], rel=1e-6)
    assert data["comparison"]["inventory"]["in_both"] == 21  # attention, norms, embeddings: present in both
    assert data["comparison"]["inventory"]["missing_in_b_count"] == 0


def test_a_bfloat16_to_float16_cast_passes_within_the_rounding_it_causes(a_bf16, root):
    b = save(build_model("llama", seed=41, **SIZES).to(torch.bfloat16).to(torch.float16), root / "cast-f16")
    report = parity.compare(str(a_bf16), str(b))
    assert report.passed
    for layer in report.layers:
        conv = layer.conversion
        assert conv["kind"] == "cast bfloat16 -> float16"
        # bf16 values with small exponents are exact in float16: the cast changed nothing it could not
        assert not conv["identical"] and layer.max_abs_diff <= layer.tolerance
    assert report.comparison["inventory"]["dtype_changes"] == {"BF16 -> F16": 21}


def test_a_float32_to_float16_cast_is_held_to_float16_rounding(a_f32, llama, root):
    b = save(build_model("llama", seed=41, **SIZES).to(torch.float16), root / "f16")
    report = parity.compare(str(a_f32), str(b))
    assert report.passed
    for layer in report.layers:
        assert layer.conversion["conversion_deviation"] > 100 * layer.noise_floor  # f16 rounding, not noise
        assert layer.conversion["ratio_to_conversion"] == pytest.approx(1.0, abs=1e-9)


@pytest.mark.parametrize("qtype", [Q.F16, Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.MXFP4])
def test_faithful_gguf_exports_pass(a_f32, llama, root, qtype):
    b = gguf_from_hf(llama, root / f"faithful-{qtype.name}.gguf", "llama", qtype)
    report = parity.compare(str(a_f32), str(b))
    assert report.passed, str(report)
    assert report.comparison["candidate"]["mapping"].endswith("'llama' map")
    for layer in report.layers:
        conv = layer.conversion
        assert conv["ratio_to_conversion"] == pytest.approx(1.0, abs=1e-6)  # B is A re-quantized, exactly
        for row in conv["tensors"]:
            assert row["storage"] == ("float16" if qtype == Q.F16 else qtype.name)
            if qtype != Q.F16:
                assert row["step_source"] == "file"
                assert row["steps"]["values_beyond_step"] == 0 and 0.3 < row["steps"]["max_steps"] <= 1.01


def test_an_mxfp4_value_moved_a_grid_point_is_beyond_its_step(a_f32, llama, root):
    """MXFP4's step is the wider gap beside a value on the E2M1 grid (its block's exponent read from the file):
    a faithful export's values lie within it, one moved to a neighbouring grid point of twice the gap does not."""
    faithful = gguf_from_hf(llama, root / "mxfp4-faithful.gguf", "llama", Q.MXFP4)
    worst = max(row["steps"]["max_steps"] for layer in parity.compare(str(a_f32), str(faithful)).layers
                for row in layer.conversion["tensors"])
    assert worst <= 1.01
    state = {k: v.clone() for k, v in llama.state_dict().items()}
    state[MLP.format(1, "up")][0, :8] *= 1.6  # beyond what any block's grid rounds them to
    moved = gguf_from_hf(Edited(llama, state), root / "mxfp4-moved.gguf", "llama", Q.MXFP4)
    report = parity.compare(str(a_f32), str(moved), layers=[1])
    found = report.layers[0].diagnosis
    assert not report.passed and found.id == "quantization_exceeds_step" and "MXFP4, step from the file" in \
        found.message, str(report)


def test_a_quantized_layer_fails_when_its_deviation_exceeds_the_formats_own(a_f32, llama, root):
    """The tolerance is the re-quantization's, not a constant: Q4_0's deviation fails a Q8_0 file."""
    q8 = parity.compare(str(a_f32), str(gguf_from_hf(llama, root / "q8.gguf", "llama", Q.Q8_0)))
    q4 = parity.compare(str(a_f32), str(gguf_from_hf(llama, root / "q4.gguf", "llama", Q.Q4_0)))
    assert all(b.max_abs_diff > 4 * a.tolerance for a, b in zip(q8.layers, q4.layers, strict=True))


def test_a_faithful_gpt2_gguf_export_passes_through_its_conv1d_transposes(root):
    gpt2 = build_model("gpt2", seed=42)
    a = save(gpt2, root / "gpt2")
    report = parity.compare(str(a), str(gguf_gpt2(gpt2, root / "gpt2-q8.gguf", Q.Q8_0)))
    assert report.passed and len(report.layers) == 3
    weights = [r for r in report.layers[0].conversion["tensors"] if r["name"].endswith("weight")]
    assert {r["storage"] for r in weights} == {"Q8_0"} and all(r["steps"]["values_beyond_step"] == 0 for r in weights)


# -- each conversion mistake is named at its layer -------------------------------------------------------------

def assert_named(report, layer: int, mistake: str) -> None:
    failed = [r.layer for r in report.layers if not r.passed]
    assert failed == [layer], str(report)
    found = report.layers[layer].diagnosis
    assert found is not None and found.id == mistake, str(report)
    if found.distance is not None:  # a replay: B reproduces it, and is far from A
        assert found.distance <= report.layers[layer].tolerance < found.reference_distance
        assert any(c.id == mistake for c in found.candidates)


def test_gate_and_up_exchanged_in_a_q8_0_export(a_f32, llama, state, root):
    broken = edited(state, **{"1_gate": lambda s: s[MLP.format(1, "up")], "1_up": lambda s: s[MLP.format(1, "gate")]})
    b = gguf_from_hf(Edited(llama, broken), root / "swapped-q8.gguf", "llama", Q.Q8_0)
    assert_named(parity.compare(str(a_f32), str(b)), 1, "gate_up_exchanged")


def test_a_transposed_matrix_is_named_from_its_shape(a_f32, state, root):
    b = export(root / "transposed", a_f32, edited(state, **{"2_down": lambda s: s[MLP.format(2, "down")].t()}))
    report = parity.compare(str(a_f32), str(b))
    assert_named(report, 2, "tensor_transposed")
    assert "down_proj.weight: A [64, 128], B [128, 64]" in report.layers[2].diagnosis.message


def test_a_transposed_square_matrix_is_named_by_its_replay(root):
    square = build_model("llama", seed=43, hidden_size=64, intermediate_size=64, num_hidden_layers=2)
    a = save(square, root / "square")
    values = load_file(a / "model.safetensors")
    b = export(root / "square-t", a, edited(values, **{"0_up": lambda s: s[MLP.format(0, "up")].t()}))
    assert_named(parity.compare(str(a), str(b)), 0, "tensor_transposed")


def test_a_shifted_layer_is_found_among_the_neighbours(a_f32, state, root):
    shifted = dict(state)
    for proj in ("gate", "up", "down"):
        shifted[MLP.format(2, proj)] = state[MLP.format(1, proj)]
    report = parity.compare(str(a_f32), str(export(root / "shifted", a_f32, shifted)))
    assert_named(report, 2, "layer_shifted")
    assert "B's layer 2 holds A's layer 1" in report.layers[2].diagnosis.message


@pytest.mark.parametrize(("change", "layer", "mistake"), [
    ({"0_down": lambda s: s[MLP.format(0, "down")] * 2}, 0, "tensor_scaled"),
    ({"1_up": lambda s: -s[MLP.format(1, "up")]}, 1, "sign_flipped"),
    ({"2_gate": lambda s: torch.zeros_like(s[MLP.format(2, "gate")])}, 2, "zero_filled"),
    ({"0_up": lambda s: torch.full_like(s[MLP.format(0, "up")], 0.01)}, 0, "constant_tensor"),
    ({"1_down": lambda s: torch.cat([s[MLP.format(1, "down")][:40], torch.zeros(24, 128)])}, 1, "tensor_truncated"),
])
def test_value_mistakes_are_named(a_f32, state, root, change, layer, mistake):
    b = export(root / f"broken-{mistake}", a_f32, edited(state, **change))
    assert_named(parity.compare(str(a_f32), str(b)), layer, mistake)


def test_a_scaled_tensor_in_a_q4_0_export_is_named_through_the_quantization(a_f32, llama, state, root):
    broken = edited(state, **{"2_up": lambda s: s[MLP.format(2, "up")] * 1.5})
    b = gguf_from_hf(Edited(llama, broken), root / "scaled-q4.gguf", "llama", Q.Q4_0)
    report = parity.compare(str(a_f32), str(b))
    assert_named(report, 2, "tensor_scaled")
    assert re.search(r"up_proj\.weight x 1\.(5|4[89])", report.layers[2].diagnosis.message)  # fitted through Q4_0


def test_an_overflowing_cast_is_its_own_finding(root):
    model = build_model("llama", seed=44, **SIZES)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 5] = 1e5  # beyond float16's 65504
    a = save(model, root / "big")
    b = save(build_model("llama", seed=44, **SIZES), root / "big-f16")  # same seed: the other layers' values
    values = {k: v.to(torch.float16) for k, v in load_file(a / "model.safetensors").items()}
    save_file(values, b / "model.safetensors")
    report = parity.compare(str(a), str(b))
    assert_named(report, 1, "cast_overflow")
    assert "first at [3, 5] where A holds 100000" in report.layers[1].diagnosis.message


def test_bfloat16_bytes_read_as_float16_are_named(a_bf16, root):
    values = load_file(a_bf16 / "model.safetensors")
    broken = {k: v.to(torch.float16) for k, v in values.items()}
    broken[MLP.format(0, "gate")] = values[MLP.format(0, "gate")].view(torch.float16)
    report = parity.compare(str(a_bf16), str(export(root / "reinterpreted", a_bf16, broken)))
    assert_named(report, 0, "bytes_reinterpreted")
    assert "bfloat16 bits read as float16" in report.layers[0].diagnosis.message


def test_a_quantization_beyond_its_step_is_named(a_f32, llama, state, root):
    """Layer 2's up_proj re-quantized to Q8_0 from an already Q4_0-rounded copy: its values sit many Q8_0
    steps from A's, which the Q8_0 file's own block scales show, on a grid coarser than its step (most of a row's
    codes on one residue: named grid_too_coarse, the more specific of the two)."""
    from gguf.quants import dequantize, quantize

    def rounded(s):
        values = s[MLP.format(2, "up")].numpy()
        return torch.from_numpy(dequantize(quantize(values, Q.Q4_0), Q.Q4_0).astype(np.float32))

    b = gguf_from_hf(Edited(llama, edited(state, **{"2_up": rounded})), root / "requant.gguf", "llama", Q.Q8_0)
    report = parity.compare(str(a_f32), str(b))
    assert_named(report, 2, "grid_too_coarse")
    row = next(r for r in report.layers[2].conversion["tensors"] if r["name"] == "up_proj.weight")
    assert row["steps"]["values_beyond_step"] > 0 and row["steps"]["max_steps"] > 4


def test_the_inventory_outside_the_ffn_goes_through_ggufs_names(a_f32, llama, state, root):
    """A GGUF file holding the whole model under llama.cpp's names, in float16, without its output head and with
    one norm of another length: found from the headers, and named in A's spelling."""
    import gguf

    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 3)
    tensors = {}
    for name, value in state.items():
        if name == "lm_head.weight":
            continue
        if name == "model.layers.1.input_layernorm.weight":
            value = value[:32]
        layer_ffn = [hf for hf in HF_TO_GGUF if name.endswith("mlp." + hf)]
        gguf_name = (f"blk.{name.split('.')[2]}.{HF_TO_GGUF[layer_ffn[0]]}" if layer_ffn
                     else table.get_name(name, try_suffixes=(".weight", ".bias")))
        tensors[gguf_name] = (value.numpy(), Q.F16)
    config = llama.config
    meta = {"block_count": 3, "embedding_length": 64, "feed_forward_length": 128, "context_length": 64,
            "attention.head_count": config.num_attention_heads, "attention.head_count_kv": config.num_key_value_heads,
            "attention.layer_norm_rms_epsilon": 1e-6}
    report = parity.compare(str(a_f32), str(write_gguf(root / "whole.gguf", "llama", meta, tensors)))
    assert report.passed  # the FFN layers; the inventory never changes the verdict
    found = report.comparison["inventory"]
    assert found["headers_read"] and found["in_both"] == 20 and found["only_in_b_count"] == 0
    assert found["missing_in_b"] == ["lm_head.weight"]
    assert found["shape_differs"] == [{"name": "model.layers.1.input_layernorm.weight", "a": [64], "b": [32]}]
    assert found["dtype_changes"] == {"F32 -> F16": 20}
    assert "not judged" in report.comparison["outside_ffn"]


# -- a mixture of experts: each (layer, expert) its own unit ----------------------------------------------------

EXPERT = "model.layers.{}.block_sparse_moe.experts.{}.{}.weight"  # save_pretrained's per-expert w1/w2/w3


@pytest.fixture(scope="session")
def mixtral():
    return tiny_model("mixtral", 41, **MIXTRAL)  # 2 layers of 4 experts, d = 32, d_ff = 48


@pytest.fixture(scope="session")
def a_moe(mixtral, root):
    return save(mixtral, root / "mixtral")


def test_a_faithful_mixtral_resave_passes_every_expert(a_moe, mixtral, root, capsys):
    code, data, err = run_json(capsys, "compare", a_moe, save(mixtral, root / "mixtral-resave"))
    assert code == 0 and data["passed"], err
    experts = [u for u in data["layers"] if u["unit"] != "block"]
    assert [(u["layer"], u["expert"]) for u in experts] == [(i, e) for i in range(2) for e in range(4)]
    assert all(u["max_abs_diff"] == 0.0 and u["conversion"]["identical"] for u in experts)
    assert [(u["layer"], u["passed"]) for u in data["layers"] if u["unit"] == "block"] == [(0, True), (1, True)]


def test_two_exchanged_experts_are_named_expert_shifted(a_moe, root):
    values = load_file(a_moe / "model.safetensors")
    for w in ("w1", "w2", "w3"):
        values[EXPERT.format(1, 0, w)], values[EXPERT.format(1, 2, w)] = (values[EXPERT.format(1, 2, w)],
                                                                          values[EXPERT.format(1, 0, w)])
    report = parity.compare(str(a_moe), str(export(root / "mixtral-exchanged", a_moe, values)))
    experts = [u for u in report.layers if u.unit != "block"]
    assert [(u.layer, u.expert) for u in experts if not u.passed] == [(1, 0), (1, 2)], str(report)
    for unit, other in ((experts[4], 2), (experts[6], 0)):
        found = unit.diagnosis
        assert found.id == "expert_shifted" and found.distance <= unit.tolerance < found.reference_distance
        assert f"B's expert {unit.expert} of layer 1 holds A's expert {other}" in found.message
    # the blocks judge what no expert unit reads (router, ...): B's experts in them, they pass
    assert all(u.passed for u in report.layers if u.unit == "block")
    text = str(report)
    assert "diagnosis expert_shifted (expert 1/e0" in text and "FAIL: 2 of 10 unit(s) of B" in text


def test_experts_select_the_units_and_a_dense_b_is_no_conversion(a_moe, a_f32, tmp_path, capsys):
    from parity.engine.compare.comparison import Comparison, run_comparison
    from parity.errors import LayerRangeError

    b_moe, b_f32 = (shutil.copytree(a, tmp_path / a.name) for a in (a_moe, a_f32))  # re-saves: A itself is exit 2
    report = run_comparison(Comparison(str(a_moe), str(b_moe), experts="1"))
    assert report.passed and [(u.layer, u.expert) for u in report.layers] == [(0, 1), (1, 1)]
    code, data, err = run_json(capsys, "compare", a_moe, b_moe, "--experts", "2")  # the command line, and Python
    assert code == 0 and [(u["layer"], u["expert"]) for u in data["layers"]] == [(0, 2), (1, 2)], err
    assert [u.expert for u in parity.compare(str(a_moe), str(b_moe), layers=[0], experts=[0, 3]).layers] == [0, 3]
    from safetensors import safe_open  # every expert's tensors are the FFN's: none is inventoried as outside it

    with safe_open(str(a_moe / "model.safetensors"), "pt") as handle:
        outside = [key for key in handle.keys() if ".experts." not in key]
    assert report.comparison["inventory"]["tensors_a"] == len(outside), report.comparison["inventory"]
    with pytest.raises(LayerRangeError, match="dense"):
        Comparison(str(a_f32), str(b_f32), experts="1")
    code, _, err = run_main(capsys, "compare", a_moe, a_f32)
    assert code == 2 and "is no conversion of" in err and "4 experts per layer" in err, err


# -- the command line ---------------------------------------------------------------------------------------

def test_the_command_exits_1_and_names_the_layer_and_writes_every_view(a_f32, state, root, capsys):
    b = export(root / "cli-broken", a_f32, edited(state, **{"1_down": lambda s: s[MLP.format(1, "down")] * 2}))
    junit, html = root / "cmp.xml", root / "cmp.html"
    code, out, err = run_main(capsys, "compare", a_f32, b, "--junit", junit, "--html", html)
    assert code == 1, err
    assert "MISMATCH — tensor_scaled" in out and "FAIL: 1 of 3 layer(s) of B" in out
    assert "Values outside the FFN are not judged" in out
    cases = ET.parse(junit).getroot().findall(".//testcase")
    assert len(cases) == 3 and sum(c.find("failure") is not None for c in cases) == 1
    assert "tensor_scaled" in html.read_text(encoding="utf-8")


def test_the_json_report_validates_against_the_shipped_schema(a_f32, llama, root, capsys):
    jsonschema = pytest.importorskip("jsonschema")
    b = gguf_from_hf(llama, root / "schema-q8.gguf", "llama", Q.Q8_0)
    code, data, _ = run_json(capsys, "compare", a_f32, b, "--layers", "0,2")
    assert code == 0 and [layer["layer"] for layer in data["layers"]] == [0, 2]
    jsonschema.validate(data, json.loads(SCHEMA_FILE.read_text(encoding="utf-8")))


def test_bad_input_is_exit_2_with_one_line(a_f32, root, tmp_path, capsys):
    code, _, err = run_main(capsys, "compare", a_f32, root / "no-such-folder")
    assert code == 2 and "no-such-folder" in err and "Traceback" not in err
    b = shutil.copytree(a_f32, tmp_path / "b")
    code, _, err = run_main(capsys, "compare", a_f32, b, "--layers", "7")
    assert code == 2 and "A has 3 layers, B 3" in err


def test_another_model_is_no_conversion_and_exit_2(a_f32, root, capsys):
    other = save(build_model("gpt2", seed=5), root / "another-model")
    code, _, err = run_main(capsys, "compare", a_f32, other)
    assert code == 2 and "is no conversion of" in err and "c_fc.weight" in err and "Traceback" not in err, err


@pytest.mark.slow  # a real process: `python -m parity compare`
def test_the_command_runs_as_a_process(a_f32, llama, root):
    b = save(llama, root / "process")
    done = run_parity("compare", a_f32, b, "-q")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "PASS: 3 layer(s) of B bit-identical to A's."


# -- what a conversion can lose besides values -----------------------------------------------------------

def test_a_config_naming_another_activation_fails_every_layer(a_f32, state, root, capsys):
    b = export(root / "other-activation", a_f32, state)
    config = json.loads((b / "config.json").read_text()) | {"hidden_act": "gelu"}
    (b / "config.json").write_text(json.dumps(config))
    code, data, _ = run_json(capsys, "compare", a_f32, b)
    assert code == 1 and {u["diagnosis"]["id"] for u in data["layers"]} == {"config_changed"}


def test_a_b_with_fewer_layers_fails_the_missing_ones_and_junit_says_why(a_f32, state, root, capsys):
    b = export(root / "fewer-layers", a_f32, {k: v for k, v in state.items() if ".layers.2." not in k})
    config = json.loads((b / "config.json").read_text()) | {"num_hidden_layers": 2}
    (b / "config.json").write_text(json.dumps(config))
    junit = root / "fewer.xml"
    code, data, _ = run_json(capsys, "compare", a_f32, b, "--junit", str(junit))
    assert code == 1 and [u["passed"] for u in data["layers"]] == [True, True, False]
    assert data["layers"][2]["diagnosis"]["id"] == "layer_missing"
    assert "cannot be loaded" not in junit.read_text() and "layer_missing" in junit.read_text()


def test_a_tensor_missing_in_b_is_a_finding_not_bad_input(a_f32, state, root, capsys):
    b = export(root / "missing-tensor", a_f32, {k: v for k, v in state.items() if k != MLP.format(1, "up")})
    code, data, err = run_json(capsys, "compare", a_f32, b)
    assert code == 1, err
    assert [u["diagnosis"]["id"] if u["diagnosis"] else None for u in data["layers"]] == [None, "tensor_missing",
                                                                                        None]


def test_a_nan_in_a_same_dtype_copy_is_not_called_a_cast_overflow(a_f32, state, root, capsys):
    def with_nan(s):
        tensor = s[MLP.format(1, "up")].clone()
        tensor[0, 0] = float("nan")
        return tensor

    b = export(root / "same-dtype-nan", a_f32, edited(state, **{"1_up": with_nan}))
    code, data, _ = run_json(capsys, "compare", a_f32, b, "--layers", "1")
    assert code == 1 and data["layers"][0]["diagnosis"]["id"] == "nonfinite_values"


# -- K-quants: each block's grid read from the file ---------------------------------------------------------

K_SIZES = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2)  # rows of whole 256-value blocks


def block_grid(blocks: np.ndarray, qtype: Q) -> tuple[np.ndarray, np.ndarray]:
    """Each value's step and grid start by gguf's own dequantizer, not by parsing: the same blocks with every
    code 0 and every code 1 (Q4_K/Q5_K: qs 0x00 / 0x11 with the high bits cleared; Q6_K: ql 0x00 / 0x11)."""
    from gguf.quants import dequantize

    codes = {Q.Q4_K: (slice(16, 144), None), Q.Q5_K: (slice(48, 176), slice(16, 48)),
             Q.Q6_K: (slice(0, 128), slice(128, 192))}[qtype]
    zero, one = blocks.copy(), blocks.copy()
    for edited, byte in ((zero, 0x00), (one, 0x11)):
        edited[..., codes[0]] = byte
        if codes[1] is not None:
            edited[..., codes[1]] = 0
    low, high = dequantize(zero, qtype), dequantize(one, qtype)
    return np.abs(high - low), low


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K])
def test_a_k_quant_export_is_held_to_the_grids_in_its_file(root, qtype):
    """B: a GGUF of random valid K-quant blocks; A: B's values moved within 0.4 of each value's step (faithful),
    or 8 values moved 1.5 steps (beyond what the format allows).  The steps are gguf's own (block_grid)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    model = build_model("llama", seed=7, **K_SIZES)
    b = gguf_from_hf(model, root / f"k-{qtype.name}.gguf", "llama", qtype)
    reader = GGUFReader(str(b))
    rng = np.random.default_rng(3)
    for name in ("faithful", "beyond"):
        state = {k: v.clone() for k, v in model.state_dict().items()}
        for tensor in reader.tensors:
            layer, gguf_name = int(tensor.name.split(".")[1]), ".".join(tensor.name.split(".")[2:])
            hf = next(h for h, g in HF_TO_GGUF.items() if g == gguf_name)
            blocks = np.array(tensor.data)
            values = dequantize(blocks, qtype)
            steps, _ = block_grid(blocks, qtype)
            shift = rng.uniform(-0.4, 0.4, size=values.shape) * steps
            if name == "beyond" and (layer, hf) == (1, "up_proj.weight"):
                shift.reshape(-1)[:8] = 1.5 * steps.reshape(-1)[:8]
            state[f"model.layers.{layer}.mlp.{hf}"] = torch.from_numpy((values + shift).astype(np.float32))
        model.load_state_dict(state)
        report = parity.compare(str(save(model, root / f"k-{qtype.name}-{name}")), str(b))
        rows = [row for layer in report.layers for row in layer.conversion["tensors"]]
        assert all(row["step_source"] == "file" for row in rows)
        if name == "faithful":
            assert report.passed, str(report)
            assert max(row["steps"]["max_steps"] for row in rows) <= 0.41
        else:
            assert [u.passed for u in report.layers] == [True, False], str(report)
            assert report.layers[1].diagnosis.id == "quantization_exceeds_step"
