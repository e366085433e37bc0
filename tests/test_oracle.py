"""The oracle cannot be bent: a target that changes torch's global state fails with its own finding, and the
reference of every later layer runs on the real torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import parity
from parity.ffn import SwiGLU

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
    from .support import run_main

    (code, out, _) = run_main(capsys, tiny["llama"], "--layer", "1", "--target", "tests.test_oracle:patched_factory")
    assert code == 1 and "global_state_modified" in out and F.silu is REAL_SILU


def patched_factory(config):
    return llama_swiglu(PatchesSilu)(config)
