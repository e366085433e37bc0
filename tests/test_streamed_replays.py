"""Issue 28: the routing mistakes of a block too large to hold are named as on a held block.

A block whose experts take more than HELD_BYTES in float64 is streamed (engine.check.block_check); its mistakes are
replayed on a few of the tokens where it fails around engine.check.block_replay.ExpertsOnDemand, which computes each
(token, expert) pair from that expert's stored values, one expert at a time.  The blocks here are forced onto that
path (HELD_BYTES 0) and must be named exactly as the same blocks held whole are."""

from __future__ import annotations

import weakref

import pytest

from parity.api import check

from . import moe_block_ports as ports
from .moe_blocks import assert_named_as_held, streamed_check


class MixtralExchanged(ports.MixtralBlock):
    """A port that hands expert 0's tokens to expert 1 and back (two entries of its expert list exchanged)."""

    PAIR = (0, 1)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, index = self.route(x)
        experts = list(self.experts)
        first, second = self.PAIR
        experts[first], experts[second] = experts[second], experts[first]
        return ports.combine(x, experts, weights, index).reshape(shape)


class DeepSeekExchanged(ports.DeepSeekBlock):
    """DeepSeek V3's block with experts 5 and 41 exchanged (of 64: more than every pair can be replayed)."""

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, index = self.route(x)
        experts = list(self.experts)
        experts[5], experts[41] = experts[41], experts[5]
        return (ports.combine(x, experts, weights, index) + self.shared_experts(x)).reshape(shape)


class DeepSeekScoreOnInput(ports.DeepSeekBlock):
    """DeepSeek V3's block with each expert run on its token times the routing weight (the weight belongs on the
    expert's output)."""

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, index = self.route(x)
        return (ports.combine(x, self.experts, weights, index, on_input=True) + self.shared_experts(x)).reshape(shape)


BROKEN = [("deepseek_v3", ports.DeepSeekScalingDropped, "routed_scaling_dropped"),
          ("deepseek_v3", DeepSeekScoreOnInput, "router_score_on_input"),
          ("deepseek_v3", ports.DeepSeekBiasInWeights, "selection_bias_in_weights"),
          ("mixtral", ports.MixtralNoRenorm, "router_renormalization_missing"),
          ("qwen2_moe", ports.QwenSharedMissing, "shared_expert_missing"),
          ("qwen2_moe", ports.QwenSharedGateAfterSum, "shared_expert_gate_after_sum"),
          ("mixtral", MixtralExchanged, "experts_exchanged")]


@pytest.mark.parametrize(("model_type", "port", "named"), BROKEN, ids=[p.__name__ for _, p, _ in BROKEN])
def test_a_streamed_block_with_a_routing_mistake_is_named_as_when_held(blocks, monkeypatch, model_type, port, named):
    held = check(str(blocks[model_type]), target=port)
    streamed = streamed_check(monkeypatch, blocks[model_type], port)
    assert_named_as_held(held, streamed, named)


def test_experts_exchanged_among_many_are_found_from_every_token_of_a_streamed_block(many_experts, monkeypatch):
    """64 experts: the pairs replayed come from which experts the failing tokens use (all of them, not only the few
    replayed), and the pair named is the one exchanged."""
    streamed = streamed_check(monkeypatch, many_experts, DeepSeekExchanged)
    assert not streamed.passed
    assert [r.diagnosis.id for r in streamed.layers] == ["experts_exchanged"], streamed
    assert "experts 5 and 41 exchanged" in streamed.layers[0].diagnosis.message


def test_a_correct_block_of_many_experts_passes_streamed(many_experts, monkeypatch):
    streamed = streamed_check(monkeypatch, many_experts, ports.DeepSeekBlock)
    assert streamed.passed and streamed.layers[0].coverage["never_chosen"] == [], streamed


def test_experts_on_demand_computes_each_pair_once_one_expert_at_a_time():
    """Asked again for the same tokens and experts it builds nothing; each expert is built once per call for every
    token needing it, the one before it let go; an exchange computes the other expert's function."""
    import torch

    from parity.engine.check.block_replay import ExpertsOnDemand

    built, alive = [], []

    class Scale(torch.nn.Module):
        def __init__(self, expert):
            super().__init__()
            self.expert = expert

        def forward(self, x, index, weights):
            return x * (self.expert + 1) * weights

    def build(expert, *, stored=None):
        assert all(ref() is None for ref in alive), "an expert built while another is held"
        built.append(expert)
        module = Scale(expert)
        alive.append(weakref.ref(module))
        return module

    stand_in = ExpertsOnDemand(4, build)
    x = torch.randn(3, 5, dtype=torch.float64)
    index = torch.tensor([[0, 2], [2, 3], [0, 3]])
    weights = torch.tensor([[0.5, 0.5], [0.25, 0.75], [1.0, 2.0]], dtype=torch.float64)
    out = stand_in(x, index, weights)
    truth = torch.stack([x[0] * (0.5 * 1 + 0.5 * 3), x[1] * (0.25 * 3 + 0.75 * 4), x[2] * (1.0 * 1 + 2.0 * 4)])
    assert torch.allclose(out, truth, rtol=1e-12, atol=0) and sorted(built) == [0, 2, 3]
    again = stand_in(x.clone(), index, weights * 2)
    assert torch.allclose(again, 2 * truth, rtol=1e-12, atol=0) and len(built) == 3  # every pair kept
    with stand_in.exchanged(0, 1):
        swapped = stand_in(x, index, weights)
    assert torch.allclose(swapped[0], x[0] * (0.5 * 2 + 0.5 * 3), rtol=1e-12, atol=0) and built[3:] == [1]
    assert torch.allclose(stand_in(x, index, weights), truth, rtol=1e-12, atol=0) and len(built) == 4


class DeepSeekWritten(ports.DeepSeekBlock):
    """DeepSeek V3's block with one switchable routing mistake beyond moe_block_ports' (``MISTAKE``)."""

    def route(self, x):
        import torch
        import torch.nn.functional as F

        c, mistake = self.config, self.MISTAKE
        logits = F.linear(x.float(), self.gate.weight.float())
        scores = logits.softmax(-1) if mistake == "softmax" else logits.sigmoid()
        biased = scores + self.gate.e_score_correction_bias
        groups = biased.view(len(x), c.n_group, -1)
        group_score = groups.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_score).scatter_(1, group_score.topk(c.topk_group, dim=-1).indices, 1.0)
        masked = biased.masked_fill(~keep.bool().repeat_interleave(groups.shape[-1], dim=1), float("-inf"))
        index = masked.topk(c.num_experts_per_tok - (mistake == "k-1"), dim=-1).indices
        weights = scores.gather(1, index)
        if mistake != "no_renorm":
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * c.routed_scaling_factor, index

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, index = self.route(x)
        shared = 0 if self.MISTAKE == "no_shared" else self.shared_experts(x)
        return (ports.combine(x, self.experts, weights, index) + shared).reshape(shape)


WRITTEN = {"softmax": "router_softmax_instead_of_sigmoid", "k-1": "router_wrong_top_k",
           "no_renorm": "router_renormalization_missing", "no_shared": "shared_expert_missing",
           None: None}


@pytest.mark.parametrize("mistake", list(WRITTEN), ids=str)
def test_a_streamed_block_of_many_experts_is_named_as_when_held(many_experts, monkeypatch, mistake):
    """64 experts, top-8 of 4 groups in 8 (DeepSeek V3's shape, narrower): each routing mistake is named streamed as
    held; the correct block passes both ways."""
    port = type(f"DeepSeek_{mistake}", (DeepSeekWritten,), {"MISTAKE": mistake})
    held = check(str(many_experts), target=port)
    streamed = streamed_check(monkeypatch, many_experts, port)
    assert [r.diagnosis and r.diagnosis.id for r in held.layers] == [WRITTEN[mistake]], held
    assert [r.diagnosis and r.diagnosis.id for r in streamed.layers] == [WRITTEN[mistake]], streamed
    assert streamed.passed is held.passed is (mistake is None)


def test_a_correct_mixtral_block_passes_streamed(blocks, monkeypatch):
    streamed = streamed_check(monkeypatch, blocks["mixtral"], ports.MixtralBlock)
    assert streamed.passed and all(r.diagnosis is None for r in streamed.layers), streamed
