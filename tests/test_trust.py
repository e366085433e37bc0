"""A green light that cannot lie: every way a check could pass without evidence, as a user meets it."""

import json
import math
import xml.etree.ElementTree as ET

import pytest
import torch

import parity
from parity.errors import LayerRangeError, SyntheticWeightsError, TargetError, UsageError

from .conftest import build_model, save
from .support import offline_home, run_main, run_parity


def expect(run, code, *needles):
    """``run``: (exit code, stdout, stderr) of run_main.  The exit code and every needle in the output; never a
    traceback."""
    returncode, stdout, stderr = run
    text = stdout + stderr
    assert returncode == code, text
    assert "Traceback" not in text and "internal error" not in text, text
    for needle in needles:
        assert needle in text, (needle, text)


def llama_with(tmp_path, name, edit):
    """A tiny LLaMA checkpoint whose layer-0 MLP tensors were changed by ``edit(mlp)``."""
    model = build_model("llama", seed=21)
    with torch.no_grad():
        edit(model.model.layers[0].mlp)
    return save(model, tmp_path / name)


# -- nothing checked -------------------------------------------------------------------------------

@pytest.mark.parametrize("layers", ["[]", '"2-0"'])
def test_project_check_of_no_layer_is_not_a_pass(tiny, tmp_path, layers, monkeypatch, capsys):
    (tmp_path / "parity.toml").write_text(f'[[checks]]\nmodel = "{tiny["llama"]}"\nlayers = {layers}\n')
    monkeypatch.chdir(tmp_path)
    expect(run_main(capsys, "check"), 2, "checks[0]", "no layer" if layers == "[]" else "empty range")


def test_api_check_of_no_layer_raises(tiny):
    with pytest.raises(LayerRangeError, match="selects no layer"):
        parity.check(str(tiny["llama"]), layers=[])


def test_huge_layer_range_is_refused_before_it_is_built(tiny, capsys):
    out = run_main(capsys, tiny["llama"], "--layers", "0-149999999")
    expect(out, 2, "149999999 is out of range")


# -- synthetic weights say so, and can be refused --------------------------------------------------

def test_quiet_synthetic_pass_says_synthetic_everywhere(tmp_path, monkeypatch, capsys):
    junit, report = tmp_path / "j.xml", tmp_path / "r.json"
    offline_home(monkeypatch, tmp_path)
    out = run_main(capsys, "gpt2", "--layers", "0", "--quiet", "--junit", junit, "--json", report)
    expect(out, 0, "PASS", "SYNTHETIC")
    (case,) = ET.parse(junit).getroot().iter("testcase")
    assert "synthetic" in case.get("name")
    data = json.loads(report.read_text())
    assert data["weights"] == "synthetic" and [layer["weights"] for layer in data["layers"]] == ["synthetic"]


def test_require_real_refuses_synthetic(tmp_path, monkeypatch, capsys):
    offline_home(monkeypatch, tmp_path)
    out = run_main(capsys, "gpt2", "--layers", "0", "--require-real")
    expect(out, 2, "real weights are required", "--checkpoint")


def test_project_check_requires_real_weights_by_default(tmp_path, monkeypatch, capsys):
    offline_home(monkeypatch, tmp_path)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "parity.toml").write_text('[[checks]]\nmodel = "gpt2"\nlayers = [0]\n')
    expect(run_main(capsys, "check"), 2, "real weights are required")
    (tmp_path / "parity.toml").write_text('[[checks]]\nmodel = "gpt2"\nlayers = [0]\nrequire_real = false\n')
    expect(run_main(capsys, "check"), 0, "SYNTHETIC")


def test_api_require_real(tmp_path, monkeypatch):
    offline_home(monkeypatch, tmp_path)
    with pytest.raises(SyntheticWeightsError, match="real weights are required"):
        parity.check("gpt2", layers=[0], require_real=True)


# -- tolerances that admit anything ----------------------------------------------------------------

@pytest.mark.parametrize("atol", ["inf", "nan", "-1.0", "0.0"])
def test_project_atol_must_be_positive_and_finite(tiny, tmp_path, atol, capsys):
    (tmp_path / "parity.toml").write_text(f'[[checks]]\nmodel = "{tiny["llama"]}"\nlayers = [0]\n'
                                          f'target = "tests.mutants:SwappedSwiGLU"\natol = {atol}\n')
    expect(run_main(capsys, "check", "--config", tmp_path / "parity.toml"), 2, "atol")


@pytest.mark.parametrize("atol", [math.inf, math.nan, -1.0, 0.0])
def test_api_atol_must_be_positive_and_finite(tiny, atol):
    with pytest.raises(UsageError, match="atol"):
        parity.check(str(tiny["llama"]), layers=[0], atol=atol)


# -- the module under test: its input, its output, its exits ---------------------------------------

@pytest.mark.parametrize("target", ["ZeroesInput", "ClampsInput", "InplaceSiLU"])
def test_a_module_that_changes_its_input_fails(tiny, target, capsys):
    out = run_main(capsys, tiny["llama"], "--layer", "1", "--target", f"tests.hostile_targets:{target}", "--json", "-")
    expect(out, 1, "input_mutated", "input elements changed")
    (layer,) = json.loads(out[1])["layers"]
    assert layer["diagnosis"]["id"] == "input_mutated" and not layer["passed"]


@pytest.mark.parametrize("target, where", [("NaNOutput", "batch 0, token 2, channel 7"),
                                           ("InfOutput", "batch 1, token 0, channel 3")])
def test_nonfinite_output_is_its_own_finding(tiny, target, where, capsys):
    out = run_main(capsys, tiny["llama"], "--layer", "0", "--target", f"tests.hostile_targets:{target}", "--json", "-")
    expect(out, 1, "nonfinite_output", where)
    (layer,) = json.loads(out[1])["layers"]
    assert layer["deterministic"] is True and layer["diagnosis"]["id"] == "nonfinite_output"


@pytest.mark.parametrize("target", ["ExitsInForward", "ExitsInInit"])
def test_sys_exit_in_the_target_is_a_target_error(tiny, target, capsys):
    expect(run_main(capsys, tiny["llama"], "--layer", "0", "--target", f"tests.hostile_targets:{target}"), 2,
           "SystemExit")


def test_sys_exit_in_the_target_via_api(tiny):
    with pytest.raises(TargetError, match="SystemExit"):
        parity.check(str(tiny["llama"]), layers=[0], target="tests.hostile_targets:ExitsInForward")


@pytest.mark.slow  # a real interpreter: its exit after a KeyboardInterrupt prints no traceback either
def test_ctrl_c_exits_130_without_traceback(tiny):
    out = run_parity(tiny["llama"], "--layer", "0", "--target", "tests.hostile_targets:InterruptedInForward")
    assert out.returncode == 130 and "Traceback" not in out.stderr and "interrupted" in out.stderr


def test_keyboard_interrupt_in_the_target_is_exit_130_in_process(tiny, capsys):
    try:
        code, _, err = run_main(capsys, tiny["llama"], "--layer", "0", "--target",
                                "tests.hostile_targets:InterruptedInForward")
    except KeyboardInterrupt:  # would end this pytest session: fail the test instead
        pytest.fail("KeyboardInterrupt escaped parity.cli.main")
    assert code == 130 and "Traceback" not in err and err.strip().endswith("parity: interrupted")


# -- checkpoints whose comparison cannot see anything ----------------------------------------------

def test_all_zero_weights_are_unverifiable(tmp_path, capsys):
    folder = llama_with(tmp_path, "zeros", lambda mlp: [p.zero_() for p in mlp.parameters()])
    out = run_main(capsys, folder, "--layer", "0", "--target", "tests.mutants:SwappedSwiGLU", "--json", "-")
    expect(out, 2, "UNVERIFIABLE", "all zeros")
    data = json.loads(out[1])
    assert data["passed"] is False and data["status"] == "unverifiable"
    assert data["layers"][0]["status"] == "unverifiable"


def test_overflowing_reference_is_unverifiable(tmp_path, capsys):
    folder = llama_with(tmp_path, "huge", lambda mlp: mlp.down_proj.weight.mul_(1e37 / 0.05))
    for target in ("tests.mutants:SwappedSwiGLU", "tests.hostile_targets:AllZeros"):
        out = run_main(capsys, folder, "--layer", "0", "--target", target, "--json", "-")
        expect(out, 2, "UNVERIFIABLE", "overflows")
        assert json.loads(out[1])["layers"][0]["passed"] is False


def test_identical_gate_and_up_are_unverifiable(tmp_path, capsys):
    folder = llama_with(tmp_path, "twins", lambda mlp: mlp.up_proj.weight.copy_(mlp.gate_proj.weight))
    expect(run_main(capsys, folder, "--layer", "0", "--target", "tests.mutants:SwappedSwiGLU"), 2, "identical")


def test_unverifiable_layer_is_a_junit_error(tmp_path, capsys):
    folder = llama_with(tmp_path, "zeros", lambda mlp: [p.zero_() for p in mlp.parameters()])
    junit = tmp_path / "j.xml"
    expect(run_main(capsys, folder, "--layers", "0,1", "--junit", junit), 2)
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite.get("errors") == "1" and suite.get("failures") == "0"


def test_other_layers_of_a_degenerate_checkpoint_still_pass(tmp_path):
    """Only the layer that cannot be judged is flagged: the check is not blanket-refused."""
    folder = llama_with(tmp_path, "zeros", lambda mlp: [p.zero_() for p in mlp.parameters()])
    report = parity.check(str(folder), layers=[0, 1, 2])
    assert [r.unverifiable is not None for r in report.layers] == [True, False, False]
    assert [r.passed for r in report.layers] == [False, True, True] and not report.passed


def test_a_tolerance_as_large_as_the_output_is_unverifiable(tiny, capsys):
    """A finite --atol can still admit anything: one at the output's own scale lets zeros pass."""
    out = run_main(capsys, tiny["llama"], "--layer", "0", "--target", "tests.hostile_targets:AllZeros",
                   "--atol", "1e30")
    expect(out, 2, "UNVERIFIABLE", "outputs zeros would pass")
