"""Issue 28: the mistakes inside an expert of a block too large to hold are named as on a held block.

A streamed block (engine.check.block_check, experts past HELD_BYTES) has its mistakes replayed around
engine.check.block_replay.ExpertsOnDemand; the replays inside an expert (GPT-OSS's clamp, alpha and up + 1, gate and
up exchanged, the fused gate/up read in the other layout) change each expert the stand-in builds, one at a time.  The
blocks here are forced onto that path (HELD_BYTES 0) and must get the held block's verdict and name; Llama 4's block,
which hands its experts its tokens once per expert already scaled, is replayed too."""

from __future__ import annotations

import weakref

import pytest
import torch

from parity.api import check

from . import moe_block_ports as ports
from .moe_blocks import assert_named_as_held, recorded_builds, streamed_check


class GptOssWritten(ports.GptOssBlock):
    """GPT-OSS's block with one switchable mistake inside its experts beyond moe_block_ports' (``MISTAKE``)."""

    def expert(self, e, x):
        ex = self.experts
        both = x @ ex.gate_up_proj[e] + ex.gate_up_proj_bias[e]
        gate, up = both[..., ::2], both[..., 1::2]
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        alpha = 1.0 if self.MISTAKE == "no_alpha" else self.alpha
        glu = gate * torch.sigmoid(alpha * gate)
        return (glu * (up if self.MISTAKE == "no_plus_one" else up + 1)) @ ex.down_proj[e] + ex.down_proj_bias[e]


class GptOssNoAlpha(GptOssWritten):
    MISTAKE = "no_alpha"


class GptOssNoPlusOne(GptOssWritten):
    MISTAKE = "no_plus_one"


class QwenGateUpSwapped(ports.SoftmaxTopK):
    """Qwen3-MoE's block with each expert's activation applied to its up projection."""

    def __init__(self, config):
        super().__init__(config, names=("up_proj", "gate_proj", "down_proj"))


EXPERT_MISTAKES = [("gpt_oss", ports.GptOssNoClamp, "swiglu_clamp_missing"),
                   ("gpt_oss", GptOssNoAlpha, "swiglu_alpha_missing"),
                   ("gpt_oss", GptOssNoPlusOne, "swiglu_up_plus_one_missing"),
                   ("gpt_oss", ports.GptOssHalves, "gate_up_interleaving_misread"),
                   ("mixtral", ports.StackedMixtralGateUpSwapped, "gate_up_swapped"),
                   ("qwen3_moe", QwenGateUpSwapped, "gate_up_swapped"),
                   ("llama4_text", ports.Llama4ScoreOnOutput, "router_score_on_output")]


@pytest.mark.parametrize("sliced", [False, True], ids=["whole", "sliced"])
@pytest.mark.parametrize(("model_type", "port", "named"), EXPERT_MISTAKES,
                         ids=[p.__name__ for _, p, _ in EXPERT_MISTAKES])
def test_a_streamed_block_with_a_mistake_inside_its_experts_is_named_as_when_held(blocks, monkeypatch, model_type,
                                                                                   port, named, sliced):
    """Also where the streamed pass computes each expert a few units at a time (``sliced``): every expert a replay
    builds is computed so too (no whole float64 copy: the memory goal holds through the replays), the changes that
    act on each unit alone applied to each slice, the fused gate/up read in the other layout (rows moved between
    units) built from the expert's stored tensors rearranged."""
    held = check(str(blocks[model_type]), target=port)
    built = recorded_builds(monkeypatch, slice_units=5 if sliced else None)
    streamed = streamed_check(monkeypatch, blocks[model_type], port)
    assert built and (set(built) == {"SlicedExpert"}) == sliced, set(built)
    assert_named_as_held(held, streamed, named)


@pytest.mark.parametrize(("model_type", "port"), [("llama4_text", ports.Llama4Block), ("gpt_oss", GptOssWritten),
                                                  ("qwen3_moe", ports.SoftmaxTopK)],
                         ids=lambda v: getattr(v, "__name__", str(v)))
def test_a_correct_block_passes_streamed_as_held(blocks, monkeypatch, model_type, port):
    held = check(str(blocks[model_type]), target=port)
    streamed = streamed_check(monkeypatch, blocks[model_type], port)
    assert held.passed and streamed.passed, streamed
    assert all(b.diagnosis is None and b.max_abs_diff <= b.tolerance for b in streamed.layers)


class Affine(torch.nn.Module):
    """Expert e as x * (e + 1) + shift, called as transformers' experts module is (tokens, index, weights) or with
    the tokens alone; ``shift`` is what a replay changes."""

    def __init__(self, expert: int, routed: bool):
        super().__init__()
        self.expert, self.routed, self.shift = expert, routed, 0.0

    def forward(self, x, index=None, weights=None):
        out = x * (self.expert + 1) + self.shift
        return out * weights if self.routed else out


def _builder(routed: bool):
    built, alive = [], []

    def build(expert, *, stored=None):
        assert all(ref() is None for ref in alive), "an expert built while another is held"
        built.append(expert)
        module = Affine(expert, routed)
        alive.append(weakref.ref(module))
        return module
    return build, built


def _shifted(module):
    """A replay inside an expert: its shift set to 1 while the pairs are computed."""
    import contextlib

    @contextlib.contextmanager
    def change():
        module.shift = 1.0
        try:
            yield
        finally:
            module.shift = 0.0
    return change()


def test_a_replay_inside_an_expert_changes_each_expert_built_and_keeps_its_pairs_apart():
    """Under ``each`` every expert built computes the changed function, one held at a time; its pairs are kept under
    the replay's key, apart from the correct ones (asked again, nothing is built), and a probe (key None) keeps
    nothing."""
    from parity.engine.check.block_replay import ExpertsOnDemand

    build, built = _builder(routed=True)
    stand_in = ExpertsOnDemand(3, build)
    x = torch.randn(2, 4, dtype=torch.float64)
    index, weights = torch.tensor([[0, 2], [1, 2]]), torch.tensor([[0.5, 0.5], [0.25, 0.75]], dtype=torch.float64)
    truth = torch.stack([x[0] * (0.5 * 1 + 0.5 * 3), x[1] * (0.25 * 2 + 0.75 * 3)])
    assert torch.allclose(stand_in(x, index, weights), truth, rtol=1e-12, atol=0) and sorted(built) == [0, 1, 2]
    with stand_in.each("shift", _shifted):
        shifted = stand_in(x, index, weights)
    assert torch.allclose(shifted, truth + 1.0, rtol=1e-12, atol=0) and len(built) == 6  # weights sum to 1: + 1
    with stand_in.each("shift", _shifted):
        assert torch.allclose(stand_in(x, index, weights), shifted, rtol=1e-12, atol=0) and len(built) == 6
    assert torch.allclose(stand_in(x, index, weights), truth, rtol=1e-12, atol=0) and len(built) == 6
    with stand_in.each(None, _shifted):
        stand_in(x, index, weights)
        stand_in(x, index, weights)
    assert len(built) == 12


def test_tokens_handed_once_per_expert_are_each_computed_by_that_expert_and_zero_rows_stay_zero():
    """Llama 4's call: [experts x tokens, d], each token scaled by its routing weight, zero where the expert is not
    chosen: a row is computed by the expert whose block of rows holds it; an exchange computes the other's."""
    from parity.engine.check.block_replay import ExpertsOnDemand

    build, built = _builder(routed=False)
    stand_in = ExpertsOnDemand(3, build, routed=False)
    x = torch.randn(2, 4, dtype=torch.float64)
    hidden = torch.zeros(6, 4, dtype=torch.float64)
    hidden[0], hidden[5] = 0.5 * x[0], 0.25 * x[1]  # token 0 to expert 0, token 1 to expert 2
    out = stand_in(hidden)
    assert torch.allclose(out[0], 0.5 * x[0], rtol=1e-12, atol=0) and torch.allclose(out[5], 0.75 * x[1], rtol=1e-12,
                                                                                     atol=0)
    assert not bool(out[1:5].any()) and sorted(built) == [0, 2]
    with stand_in.exchanged(0, 2):
        swapped = stand_in(hidden)
    assert torch.allclose(swapped[0], 1.5 * x[0], rtol=1e-12, atol=0) and torch.allclose(swapped[5], 0.25 * x[1],
                                                                                         rtol=1e-12, atol=0)
