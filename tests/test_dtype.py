"""--device and --dtype: the target built, filled and run where and in what it really runs, held to the
reference's own error in that dtype; which mistakes a low precision can still tell apart, and which not.

Everything device-independent runs on the CPU in bfloat16 and float16; CUDA and MPS runs are skipped
with the reason where the hardware is absent.  The truths are float64; every bound below has a wide
margin over what was measured (docs/precision.md)."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import parity
from parity import cli
from parity.definitions.project import parse_project
from parity.definitions.values import device_value, dtype_value
from parity.engine.verdict import LOW_PRECISION_FACTOR, NOISE_FACTOR, RELATIVE_FLOOR
from parity.errors import ParityAssertionError, ProjectConfigError, UsageError
from parity.outputs.text import summary_line
from parity.testing import assert_parity

from . import mutants as m
from .conftest import build_model, save
from .support import run_main

LOW = ["bfloat16", "float16"]
GATED = ["llama", "mistral", "qwen2", "gemma", "gemma2", "gemma3_text"]
FAMILIES = ["gpt2", "openai-gpt", *GATED]
NO_CUDA = "no CUDA device on this machine (torch.cuda.is_available() is False)"
NO_MPS = "no Apple MPS device on this machine (torch.backends.mps.is_available() is False)"


# -- independent correct modules: other op orders and roundings than transformers' -----------------

class FusedSwiGLU(nn.Module):
    """gate and up in one matmul (w13), torch's fused SiLU; parameter names as parity.ffn.SwiGLU."""

    def __init__(self, emb_size, hidden_dim, bias, dropout):
        super().__init__()
        self._gate = nn.Linear(emb_size, hidden_dim, bias=bias)
        self._up = nn.Linear(emb_size, hidden_dim, bias=bias)
        self._down = nn.Linear(hidden_dim, emb_size, bias=bias)

    def forward(self, x):
        gate, up = F.linear(x, torch.cat([self._gate.weight, self._up.weight])).chunk(2, dim=-1)
        return self._down(F.silu(gate) * up)


class Float32InsideSwiGLU(FusedSwiGLU):
    """A fused kernel's numerics: low-precision weights and input, float32 inside, one rounding at the end."""

    def forward(self, x):
        w = {name: lin.weight.float() for name, lin in (("g", self._gate), ("u", self._up), ("d", self._down))}
        h = F.silu(F.linear(x.float(), w["g"])) * F.linear(x.float(), w["u"])
        return F.linear(h, w["d"]).to(x.dtype)


class TorchGeGLU(FusedSwiGLU):
    """GeGLU with torch's fused tanh GELU (transformers' Gemma runs gelu_pytorch_tanh)."""

    def forward(self, x):
        return self._down(F.gelu(self._gate(x), approximate="tanh") * self._up(x))


CORRECT = {"llama": [None, FusedSwiGLU, Float32InsideSwiGLU], "mistral": [None, FusedSwiGLU],
           "qwen2": [None, Float32InsideSwiGLU], "gemma": [None, TorchGeGLU], "gemma2": [None],
           "gemma3_text": [None, TorchGeGLU], "gpt2": [None], "openai-gpt": [None]}
SWAPPED = {"llama": m.SwappedSwiGLU, "mistral": m.SwappedSwiGLU, "qwen2": m.SwappedSwiGLU, "gemma": m.SwappedGeGLU,
           "gemma2": m.SwappedGeGLU, "gemma3_text": m.SwappedGeGLU}


# -- one rule for each value -------------------------------------------------------------------

def test_dtype_and_device_values():
    assert [dtype_value(v) for v in ("float32", "BF16", "bfloat16", "fp16", "half")] == \
        ["float32", "bfloat16", "bfloat16", "float16", "float16"]
    assert [device_value(v) for v in ("cpu", "CUDA", "cuda:1", "mps")] == ["cpu", "cuda", "cuda:1", "mps"]
    for bad in ("int8", "float64", "", None, 16):
        with pytest.raises(ValueError, match="float32, bfloat16, float16"):
            dtype_value(bad)
    for bad in ("gpu", "cuda:", "cuda:x", "tpu", "", None):
        with pytest.raises(ValueError, match="cpu, cuda, cuda:N"):
            device_value(bad)


def test_bad_values_through_every_front_door(tiny, tmp_path, capsys):
    for option, value, needle in (("--dtype", "int8", "float32, bfloat16, float16"), ("--device", "gpu", "cuda:N")):
        with pytest.raises(SystemExit) as exited:  # argparse's usage error
            cli.main([str(tiny["llama"]), option, value])
        err = capsys.readouterr().err
        assert exited.value.code == 2 and f"argument {option}" in err and needle in err
    with pytest.raises(UsageError, match="dtype='int8'"):
        parity.check(str(tiny["llama"]), dtype="int8")
    with pytest.raises(UsageError, match="device='tpu'"):
        parity.check(str(tiny["llama"]), device="tpu")
    with pytest.raises(ProjectConfigError, match=r"checks\[0\].*'dtype' must be one of"):
        parse_project({"checks": [{"model": "gpt2", "dtype": "int4"}]}, tmp_path / "parity.toml")
    project = parse_project({"defaults": {"dtype": "bf16", "device": "CPU"}, "checks": [{"model": "gpt2"}]},
                            tmp_path / "parity.toml")
    assert (project.checks[0].dtype, project.checks[0].device) == ("bfloat16", "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the error path cannot be seen")
def test_missing_cuda_is_a_clear_error(tiny, capsys):
    code, _, err = run_main(capsys, tiny["llama"], "--device", "cuda", "--dtype", "bfloat16")
    assert code == 2 and "--device cuda: no CUDA device is available" in err and "Traceback" not in err
    with pytest.raises(UsageError, match="no CUDA device"):
        parity.check(str(tiny["llama"]), device="cuda:1")


@pytest.mark.skipif(getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available(),
                    reason="this machine has MPS: the error path cannot be seen")
def test_missing_mps_is_a_clear_error(tiny):
    with pytest.raises(UsageError, match="--device mps: the Apple GPU"):
        parity.check(str(tiny["llama"]), device="mps")


# -- correct modules pass, held to the reference's own error ----------------------------------------

@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("family", FAMILIES)
def test_correct_modules_pass_at_low_precision(tiny, family, dtype):
    for target in CORRECT[family]:
        report = parity.check(str(tiny[family]), target=target, dtype=dtype)
        assert report.passed, (target, [(r.ratio_to_reference_error, r.diagnosis) for r in report.layers])
        assert (report.dtype, report.device) == (dtype, "cpu")
        for layer in report.layers:
            # the reference's own error is that of a half-precision format, far above float32's
            assert layer.reference_error > 100 * layer.noise_floor
            assert layer.tolerance == pytest.approx(LOW_PRECISION_FACTOR * layer.reference_error)
            # measured: at most 2.4 over 904 layers (docs/precision.md); the factor leaves room above it
            assert layer.ratio_to_reference_error <= 0.8 * LOW_PRECISION_FACTOR
            assert layer.diagnosis is None and layer.separability


def test_float32_runs_keep_the_float32_rule(tiny):
    """The default is today's check: the same tolerance formula, no low-precision fields."""
    report = parity.check(str(tiny["llama"]), layers=[0])
    (layer,) = report.layers
    assert (report.dtype, report.device) == ("float32", "cpu") and not report.low_precision
    scale = layer.max_abs_diff / layer.max_rel_diff
    assert layer.tolerance == pytest.approx(max(NOISE_FACTOR * layer.noise_floor, RELATIVE_FLOOR * scale), rel=1e-9)
    assert layer.reference_error is None and layer.ratio_to_reference_error is None and layer.separability is None
    data = report.to_dict()
    assert data["dtype"] == "float32" and data["layers"][0]["ratio_to_reference_error"] is None


def test_a_bf16_module_checked_in_float32_is_still_low_precision_compute(tiny):
    report = parity.check(str(tiny["llama"]), target=m.bf16_swiglu)
    assert not report.passed
    assert {r.diagnosis["id"] for r in report.layers} == {"low_precision_compute"}
    # ... and the same module checked at the precision it computes in passes
    assert parity.check(str(tiny["llama"]), target=m.bf16_swiglu, dtype="bfloat16").passed


# -- mistakes that stay visible ------------------------------------------------------------------

@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("family", GATED)
def test_swapped_gate_up_fails_and_is_named(tiny, family, dtype):
    report = parity.check(str(tiny[family]), target=SWAPPED[family], dtype=dtype)
    assert not report.passed
    for layer in report.layers:
        assert layer.diagnosis["id"] == "gate_up_swapped", layer.diagnosis
        assert layer.ratio_to_reference_error > 10 * LOW_PRECISION_FACTOR  # measured: >= 93
        assert layer.diagnosis["distance"] <= layer.tolerance < layer.diagnosis["reference_distance"]
        ids = {c["id"]: c["distance"] for c in layer.diagnosis["candidates"]}
        assert ids["gate_up_swapped"] == layer.diagnosis["distance"] and len(ids) >= 2
        assert all(row["checked"] for row in layer.separability if row["id"] == "gate_up_swapped")


@pytest.mark.parametrize("dtype", LOW)
def test_swapped_experts_and_fused_gate_up_at_low_precision(tmp_path, dtype):
    from .builders import MIXTRAL, tiny_model

    folder = tmp_path / "mixtral"
    tiny_model("mixtral", 41, **MIXTRAL).save_pretrained(folder)
    assert parity.check(str(folder), layers=[1], experts="0,2", dtype=dtype).passed
    report = parity.check(str(folder), layers=[1], experts="0,2", dtype=dtype, target=m.SwappedSwiGLU)
    assert [r.diagnosis["id"] for r in report.layers] == ["gate_up_swapped"] * 2


@pytest.mark.parametrize("dtype", LOW)
def test_other_mistakes_are_diagnosed_as_in_float32(tiny, tmp_path, dtype):
    cases = [(tiny["llama"], m.llama_with_dropout, "dropout_active"),
             (tiny["llama"], "tests.hostile_targets:ClampsInput", "input_mutated"),
             (tiny["llama"], m.llama_four_d, "intermediate_size_mismatch"),
             (tiny["gemma"], m.gemma_doubled_dff, "intermediate_size_mismatch"),
             (tiny["gpt2"], m.gpt2_silu, "silu_instead_of_gelu")]
    for folder, target, expected in cases:
        report = parity.check(str(folder), target=target, dtype=dtype, layers=[0])
        assert [r.diagnosis["id"] for r in report.layers] == [expected], (target, report.layers[0].diagnosis)
    square = save(build_model("llama", seed=23, intermediate_size=32), tmp_path / "square")
    from .builders import mapping_variant

    mapping = mapping_variant(tmp_path, "llama", '"_down.weight" = "down_proj.weight"',
                              '"_down.weight" = { from = "down_proj.weight", transform = "transpose" }')
    report = parity.check(str(square), mapping=mapping, layers=[0], dtype=dtype)
    assert report.layers[0].diagnosis["id"] == "missing_transpose"


def test_a_module_computing_in_bfloat16_fails_a_float16_check(tiny):
    """bfloat16 autocast inside a module checked at float16: its error is bfloat16's, and named."""
    report = parity.check(str(tiny["gemma3_text"]), target=m.AutocastGeGLU, dtype="float16")
    for layer in report.layers:
        assert not layer.passed and layer.ratio_to_reference_error > LOW_PRECISION_FACTOR
        assert layer.diagnosis["id"] == "low_precision_compute" and "bfloat16" in layer.diagnosis["message"]


def test_float16_overflow_of_the_reference_is_unverifiable(tmp_path):
    def grow(mlp):
        mlp.down_proj.weight.mul_(1e5)

    model = build_model("llama", seed=31)
    with torch.no_grad():
        grow(model.model.layers[0].mlp)
    folder = save(model, tmp_path / "big")
    report = parity.check(str(folder), layers=[0], dtype="float16")
    assert report.status == "unverifiable" and "overflows float16 itself" in report.layers[0].unverifiable
    assert parity.check(str(folder), layers=[0], dtype="bfloat16").passed  # bfloat16 has float32's range


# -- what a low precision cannot see ------------------------------------------------------------------

def test_gelu_variant_is_not_checked_at_bfloat16(tiny):
    for family, target in (("gpt2", m.gpt2_exact_gelu), ("gemma3_text", m.geglu_exact_gelu)):
        report = parity.check(str(tiny[family]), target=target, dtype="bfloat16")
        for layer in report.layers:
            row = next(r for r in layer.separability if r["id"] == "gelu_exact_instead_of_tanh")
            # measured from this layer: the mistake moves the output far less than bfloat16's own error
            assert not row["checked"] and row["distance"] < 0.2 * layer.reference_error
            assert ("gelu_exact_instead_of_tanh (reference runs gelu_pytorch_tanh) not checked at bfloat16: run with "
                    "--dtype float32 to check it" in row["message"].replace("gelu_new", "gelu_pytorch_tanh"))
            assert f"{row['distance']:.2e}" in row["message"] and f"{layer.reference_error:.2e}" in row["message"]
            assert layer.diagnosis is None or layer.diagnosis["id"] != "gelu_exact_instead_of_tanh"
        assert report.passed and "Not checked at bfloat16: gelu_exact_instead_of_tanh" in summary_line(report)
        # float32 sees it
        assert parity.check(str(tiny[family]), target=target, layers=[0]).layers[0].diagnosis["id"] == \
            "gelu_exact_instead_of_tanh"


def test_gelu_variant_not_checked_through_the_cli(tiny, capsys, tmp_path):
    code, out, _ = run_main(capsys, tiny["gpt2"], "--dtype", "bfloat16", "--target", "tests.mutants:gpt2_exact_gelu",
                            "--json", tmp_path / "r.json")
    assert "gelu_exact_instead_of_tanh (reference runs gelu_new) not checked at bfloat16: run with --dtype float32 " \
           "to check it" in out
    assert "Not checked at bfloat16: gelu_exact_instead_of_tanh" in out.splitlines()[-1]
    assert "ref err" in out and "×ref" in out and "compute     bfloat16 on cpu" in out
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["dtype"] == "bfloat16" and data["device"] == "cpu"
    for layer in data["layers"]:
        assert layer["ratio_to_reference_error"] is not None and layer["reference_error"] > 0
        assert any(r["id"] == "gelu_exact_instead_of_tanh" and not r["checked"] for r in layer["separability"])
    # the rest of the layer matches (exit 0), and the report says what that pass does not cover
    assert code == 0 and data["passed"]
    # one line per mistake over all layers, quoting the layer where it comes closest to passing, and saying which
    layers = data["layers"]
    least = min(layers, key=lambda r: next(s["distance"] for s in r["separability"]
                                           if s["id"] == "gelu_exact_instead_of_tanh") / r["tolerance"])
    gelu = next(line for line in out.splitlines()
                if line.startswith("layers ") and "gelu_exact_instead_of_tanh" in line)
    assert gelu.startswith(f"layers {', '.join(str(r['layer']) for r in layers)}; the figures are layer "
                           f"{least['layer']}'s, where it is least visible: gelu_exact_instead_of_tanh")


def test_swapped_through_the_cli_and_assert_parity(tiny, capsys):
    code, out, _ = run_main(capsys, tiny["qwen2"], "--dtype", "fp16", "--target", "tests.mutants:SwappedSwiGLU")
    assert code == 1 and "MISMATCH — gate_up_swapped" in out and "(at float16 on cpu)" in out
    with pytest.raises(ParityAssertionError, match="gate_up_swapped"):
        assert_parity(str(tiny["qwen2"]), target=m.SwappedSwiGLU, dtype="bfloat16")
    report = assert_parity(str(tiny["gemma"]), target=TorchGeGLU, dtype="bfloat16")
    assert report.passed and report.dtype == "bfloat16"


def test_project_file_runs_at_its_dtype(tiny, tmp_path, capsys, monkeypatch):
    (tmp_path / "parity.toml").write_text(
        f'[defaults]\nrequire_real = false\n[[checks]]\nmodel = "{tiny["llama"]}"\nlayers = [0]\ndtype = "bf16"\n'
        f'[[checks]]\nmodel = "{tiny["llama"]}"\nlayers = [0]\ntarget = "tests.mutants:SwappedSwiGLU"\n'
        'dtype = "float16"\n')
    monkeypatch.chdir(tmp_path)
    code, out, _ = run_main(capsys, "check", "--json", tmp_path / "suite.json")
    assert code == 1
    checks = json.loads((tmp_path / "suite.json").read_text())["checks"]
    assert [c["report"]["dtype"] for c in checks] == ["bfloat16", "float16"]
    assert [c["report"]["passed"] for c in checks] == [True, False]


def test_float32_diagnosis_records_every_replay(tiny):
    (layer,) = parity.check(str(tiny["llama"]), target=m.SwappedSwiGLU, layers=[0]).layers
    candidates = layer.diagnosis["candidates"]
    assert {c["id"] for c in candidates} >= {"gate_up_swapped", "gelu_instead_of_silu"}
    assert min(candidates, key=lambda c: c["distance"])["id"] == "gate_up_swapped"
    assert all(set(c) == {"id", "detail", "distance"} for c in candidates)


# -- devices this machine may not have ----------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
@pytest.mark.parametrize("dtype", ["float32", *LOW])
def test_cuda(tiny, dtype):
    report = parity.check(str(tiny["llama"]), device="cuda", dtype=dtype)
    assert report.passed and report.device.startswith("cuda")
    report = parity.check(str(tiny["llama"]), device="cuda", dtype=dtype, target=m.SwappedSwiGLU)
    assert {r.diagnosis["id"] for r in report.layers} == {"gate_up_swapped"}


@pytest.mark.skipif(getattr(torch.backends, "mps", None) is None or not torch.backends.mps.is_available(),
                    reason=NO_MPS)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_mps(tiny, dtype):
    report = parity.check(str(tiny["llama"]), device="mps", dtype=dtype)
    assert report.passed and report.device == "mps"
    report = parity.check(str(tiny["llama"]), device="mps", dtype=dtype, target=m.SwappedSwiGLU)
    assert {r.diagnosis["id"] for r in report.layers} == {"gate_up_swapped"}
