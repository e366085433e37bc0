"""The oracle cannot be bent: a target that changes torch's global state fails with its own finding, and the
reference of every later layer runs on the real torch."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import parity
from parity.ffn import SwiGLU

from .support import run_main

REAL_SILU = F.silu


class PatchesSilu(SwiGLU):
    """Swapped gate/up that also makes transformers' SiLU the identity, so the patched reference agrees less
    with the truth: without the guard, layers after the first would be judged against a bent oracle."""

    def forward(self, x):
        F.silu = lambda t, inplace=False: t
        return super().forward(x)


class DefaultDtypeInInit(SwiGLU):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        torch.set_default_dtype(torch.float64)


class GradOnInForward(SwiGLU):
    def forward(self, x):
        torch.set_grad_enabled(True)
        return super().forward(x)


def llama_swiglu(cls):
    return lambda config: cls(config.hidden_size, dropout=0.0, hidden_dim=config.intermediate_size, bias=False)


@pytest.mark.parametrize(("cls", "names"), [(PatchesSilu, "torch.nn.functional.silu replaced"),
                                            (DefaultDtypeInInit, "torch.get_default_dtype() changed"),
                                            (GradOnInForward, "torch.is_grad_enabled() changed")])
def test_a_target_that_changes_torch_fails_every_layer_and_torch_is_restored(tiny, cls, names):
    report = parity.check(str(tiny["llama"]), target=llama_swiglu(cls))
    assert F.silu is REAL_SILU and torch.get_default_dtype() == torch.float32 and torch.is_grad_enabled()
    assert len(report.layers) == 3 and not report.passed
    for layer in report.layers:
        assert layer.diagnosis["id"] == "global_state_modified" and names in layer.diagnosis["message"]


def test_the_next_check_is_unaffected(tiny):
    parity.check(str(tiny["llama"]), target=llama_swiglu(PatchesSilu), layers=[0])
    assert parity.check(str(tiny["llama"]), layers=[0, 1, 2]).passed


def test_the_cli_names_it(tiny, capsys):
    (code, out, _) = run_main(capsys, tiny["llama"], "--layer", "1", "--target", "tests.test_oracle:patched_factory")
    assert code == 1 and "global_state_modified" in out and F.silu is REAL_SILU


def patched_factory(config):
    return llama_swiglu(PatchesSilu)(config)


# -- a correct module is never accused; only a projection's bias is zero-filled --------------------

class Conv1DUnderParityNames(torch.nn.Module):
    """GPT-2's own storage (transformers' Conv1D, weight [in, out]) under parity's parameter names."""

    def __init__(self, config):
        super().__init__()
        from transformers.pytorch_utils import Conv1D

        self._layer1 = Conv1D(4 * config.n_embd, config.n_embd)
        self._layer2 = Conv1D(config.n_embd, 4 * config.n_embd)

    def forward(self, x):
        return self._layer2(F.gelu(self._layer1(x), approximate="tanh"))


class ExtraGainBias(SwiGLU):
    """An extra parameter named like a bias that is no projection's bias: (1 + gain_bias) * output."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gain_bias = torch.nn.Parameter(torch.full((args[0],), 0.5))

    def forward(self, x):
        return super().forward(x) * (1 + self.gain_bias)


def test_conv1d_under_parity_names_passes(tiny):
    report = parity.check(str(tiny["gpt2"]), target=Conv1DUnderParityNames)
    assert report.passed, [(r.layer, r.diagnosis) for r in report.layers]
    assert report.routes["tensors"]["_layer1.weight"] == "c_fc.weight"  # stored as Conv1D keeps it: no transpose


def test_a_non_projection_bias_is_never_zero_filled(tiny, capsys):
    code, _, err = run_main(capsys, tiny["llama"], "--layer", "0", "--target", "tests.test_oracle:gain_bias_factory")
    assert code == 2 and "gain_bias" in err


def gain_bias_factory(config):
    return ExtraGainBias(config.hidden_size, dropout=0.0, hidden_dim=config.intermediate_size, bias=False)


class BiasedHFNames(torch.nn.Module):
    """transformers' names, nn.Linear with bias=True, on a bias-free Gemma checkpoint."""

    def __init__(self, config):
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj, self.up_proj, self.down_proj = (torch.nn.Linear(d, f), torch.nn.Linear(d, f),
                                                        torch.nn.Linear(f, d))

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


def test_a_linear_bias_on_a_bias_free_checkpoint_is_zeroed_and_said(tiny):
    report = parity.check(str(tiny["gemma3_text"]), layers=[0], target=BiasedHFNames)  # gemma routes no bias
    assert report.passed
    assert any("'gate_proj.bias' gets no checkpoint tensor: set to zero" in n for n in report.notes), report.notes


# -- a tolerance that is not parity's own says what it can no longer tell apart --------------------

def relu_ffn(config):
    from parity.ffn import FeedForward

    return FeedForward(config.n_embd, dropout=0.0, activation="relu")


def test_a_loose_atol_lists_what_it_cannot_tell_apart(tiny, capsys):
    code, out, _ = run_main(capsys, tiny["gpt2"], "--layer", "0", "--atol", "2", "--target",
                            "tests.test_oracle:relu_ffn", "--json", "-")
    report = json.loads(out)
    assert code == 0 and report["atol"] == 2
    missed = {row["id"] for row in report["layers"][0]["separability"] if not row["checked"]}
    assert {"silu_instead_of_gelu", "gelu_exact_instead_of_tanh"} <= missed
    code, out, _ = run_main(capsys, tiny["gpt2"], "--layer", "0", "--atol", "2", "-q")
    assert "Not checked with --atol 2:" in out and "drop --atol to check them" in out


def test_parity_s_own_tolerance_states_nothing(tiny):
    report = parity.check(str(tiny["gpt2"]), layers=[0])
    assert report.layers[0].separability is None and report.atol is None


# -- the reference is filled under transformers' own names, and every view says how -----------------

SWAPPING_REFERENCE = """extends = "llama"

[reference.tensors]
"gate_proj.weight" = "up_proj.weight"
"up_proj.weight" = "gate_proj.weight"
"""


def test_a_mapping_that_bends_the_reference_is_refused(tiny, tmp_path, capsys):
    mapping = tmp_path / "bent.toml"
    mapping.write_text(SWAPPING_REFERENCE)
    code, _, err = run_main(capsys, tiny["llama"], "--layer", "0", "--mapping", mapping, "--target",
                            "tests.mutants:SwappedSwiGLU")
    assert code == 2 and "bends the reference itself" in err and "gate_proj.weight" in err


def test_a_converted_format_s_reference_routes_are_allowed_and_shown(tiny, capsys):
    code, out, _ = run_main(capsys, tiny["llama"], "--layer", "0", "--json", "-")
    report = json.loads(out)
    assert code == 0 and report["reference_routes"]["gate_proj.weight"] == "gate_proj.weight"
    code, out, _ = run_main(capsys, tiny["llama"], "--layer", "0")
    assert "filled      under transformers' own names" in out


# -- TorchScript modules are targets ---------------------------------------------------------------

class HFNamed(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = torch.nn.Linear(d, f, bias=False)
        self.up_proj = torch.nn.Linear(d, f, bias=False)
        self.down_proj = torch.nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.parametrize("build", [
    lambda c: torch.jit.script(SwiGLU(c.hidden_size, dropout=0.0, hidden_dim=c.intermediate_size, bias=False)),
    lambda c: torch.jit.script(HFNamed(c))], ids=["parity-names", "inferred-routes"])
def test_a_torchscript_target_is_checked(tiny, build):
    report = parity.check(str(tiny["llama"]), layers=[0, 1], target=build)
    assert report.passed, [r.diagnosis for r in report.layers]


# -- a typed report: a library user reads attributes --------------------------------------------------

def test_a_diagnosis_is_a_record_with_attributes(tiny):
    from parity.definitions.mistakes import PRODUCED_BY, MistakeId
    from parity.engine.results import Diagnosis

    report = parity.check(str(tiny["llama"]), layers=[1], target="tests.mutants:SwappedSwiGLU")
    found = report.layers[0].diagnosis
    assert isinstance(found, Diagnosis) and found.id == "gate_up_swapped" and found.candidates[0].distance >= 0
    assert json.loads(report.to_json())["layers"][0]["diagnosis"]["id"] == "gate_up_swapped"
    assert set(PRODUCED_BY) == set(MistakeId)  # every id says which replay or finding produces it
