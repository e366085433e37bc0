"""Whole MoE blocks written from scratch, as a porter writes them from a family's paper and config (not from
transformers' code), each with a switch for one real mistake.  Used by tests/test_moe_block.py through
``--target moe_block_ports:Name``; ``MISTAKE`` on a subclass picks the mistake."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Expert(nn.Module):
    """One SwiGLU expert: down(silu(gate(x)) * up(x)), its projections named as given (gate_proj, w1, ...)."""

    def __init__(self, d: int, f: int, names=("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        self.names = names
        setattr(self, names[0], nn.Linear(d, f, bias=False))
        setattr(self, names[1], nn.Linear(d, f, bias=False))
        setattr(self, names[2], nn.Linear(f, d, bias=False))

    def forward(self, x):
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(F.silu(gate(x)) * up(x))


def combine(x, experts, weights, index, on_input=False):
    """sum over each token's chosen experts of weight * expert(token) (or expert(weight * token))."""
    out = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        token, slot = (index == e).nonzero(as_tuple=True)
        if len(token):
            w = weights[token, slot, None].to(x.dtype)
            out.index_add_(0, token, expert(x[token] * w) if on_input else expert(x[token]) * w)
    return out


class SoftmaxTopK(nn.Module):
    """Mixtral / Qwen-MoE / OLMoE: softmax over every expert, top-k, renormalised where the config says so."""

    MISTAKE = None

    def __init__(self, config, names=("gate_proj", "up_proj", "down_proj"), width=None):
        super().__init__()
        d = config.hidden_size
        count = getattr(config, "num_local_experts", None) or config.num_experts
        width = width or config.moe_intermediate_size
        self.k, self.renorm = config.num_experts_per_tok, getattr(config, "norm_topk_prob", True)
        self.gate = nn.Linear(d, count, bias=False)
        self.experts = nn.ModuleList(Expert(d, width, names) for _ in range(count))

    def route(self, x):
        logits = self.gate(x)
        if self.MISTAKE == "topk_before_softmax":
            values, index = logits.topk(self.k, dim=-1)
            return values.softmax(-1), index
        scores = logits.sigmoid() if self.MISTAKE == "sigmoid" else logits.softmax(-1)
        weights, index = scores.topk(self.k, dim=-1)
        renorm = self.renorm if self.MISTAKE != "renorm_flipped" else not self.renorm
        return (weights / weights.sum(-1, keepdim=True) if renorm else weights), index

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, index = self.route(x)
        return combine(x, self.experts, weights, index).reshape(shape)


class MixtralBlock(SoftmaxTopK):
    """Mixtral's block under the names its checkpoints use: gate, experts.N.w1/w3/w2."""

    def __init__(self, config):
        super().__init__(config, names=("w1", "w3", "w2"), width=config.intermediate_size)


class MixtralNoRenorm(MixtralBlock):
    MISTAKE = "renorm_flipped"


class QwenSharedBlock(SoftmaxTopK):
    """Qwen2-MoE: routed experts plus a shared expert scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, config):
        super().__init__(config)
        d = config.hidden_size
        self.shared_expert = Expert(d, config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(d, 1, bias=False)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, index = self.route(x)
        routed = combine(x, self.experts, weights, index)
        shared = self.shared_expert(x)
        if self.MISTAKE == "shared_missing":
            return routed.reshape(shape)
        if self.MISTAKE == "shared_gate_after_sum":
            return ((routed + shared) * torch.sigmoid(self.shared_expert_gate(x))).reshape(shape)
        return (routed + torch.sigmoid(self.shared_expert_gate(x)) * shared).reshape(shape)


class QwenSharedMissing(QwenSharedBlock):
    MISTAKE = "shared_missing"


class QwenSharedGateAfterSum(QwenSharedBlock):
    MISTAKE = "shared_gate_after_sum"


class DeepSeekRouter(nn.Module):
    def __init__(self, config):
        super().__init__()
        count = config.n_routed_experts
        self.weight = nn.Parameter(torch.empty(count, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(count))


class DeepSeekBlock(nn.Module):
    """DeepSeek V3: sigmoid scores; the selection bias only chooses; group-limited top-k; renormalised; scaled."""

    MISTAKE = None

    def __init__(self, config):
        super().__init__()
        d, width = config.hidden_size, config.moe_intermediate_size
        self.config = config
        self.gate = DeepSeekRouter(config)
        self.experts = nn.ModuleList(Expert(d, width) for _ in range(config.n_routed_experts))
        self.shared_experts = Expert(d, width * config.n_shared_experts)

    def route(self, x):
        c = self.config
        scores = F.linear(x.float(), self.gate.weight.float()).sigmoid()
        biased = scores + self.gate.e_score_correction_bias
        groups = biased.view(len(x), c.n_group, -1)
        group_score = groups.topk(min(2, groups.shape[-1]), dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_score).scatter_(1, group_score.topk(c.topk_group, dim=-1).indices, 1.0)
        masked = biased.masked_fill(~keep.bool().repeat_interleave(groups.shape[-1], dim=1), float("-inf"))
        index = masked.topk(c.num_experts_per_tok, dim=-1).indices
        weights = (biased if self.MISTAKE == "bias_in_weights" else scores).gather(1, index)
        if c.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        scale = 1.0 if self.MISTAKE == "scaling_dropped" else c.routed_scaling_factor
        return weights * scale, index

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, index = self.route(x)
        return (combine(x, self.experts, weights, index) + self.shared_experts(x)).reshape(shape)


class DeepSeekBiasInWeights(DeepSeekBlock):
    MISTAKE = "bias_in_weights"


class DeepSeekScalingDropped(DeepSeekBlock):
    MISTAKE = "scaling_dropped"


class GptOssBlock(nn.Module):
    """GPT-OSS under transformers' names: top-k of the router's logits (with bias), softmax over those; experts
    [E, d, 2ff] with gate and up interleaved, biases, gate clamped above and up on both sides at swiglu_limit,
    gate * sigmoid(alpha * gate) * (up + 1)."""

    MISTAKE = None

    def __init__(self, config):
        super().__init__()
        d, f, count = config.hidden_size, config.intermediate_size, config.num_local_experts
        self.k, self.limit, self.alpha = config.num_experts_per_tok, config.swiglu_limit, config.swiglu_alpha
        self.router = nn.Linear(d, count)
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.empty(count, d, 2 * f))
        self.experts.gate_up_proj_bias = nn.Parameter(torch.empty(count, 2 * f))
        self.experts.down_proj = nn.Parameter(torch.empty(count, f, d))
        self.experts.down_proj_bias = nn.Parameter(torch.empty(count, d))

    def expert(self, e, x):
        ex = self.experts
        both = x @ ex.gate_up_proj[e] + ex.gate_up_proj_bias[e]
        if self.MISTAKE == "halves":
            gate, up = both.chunk(2, dim=-1)
        else:
            gate, up = both[..., ::2], both[..., 1::2]
        if self.MISTAKE != "no_clamp":
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return (gate * torch.sigmoid(self.alpha * gate) * (up + 1)) @ ex.down_proj[e] + ex.down_proj_bias[e]

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        values, index = self.router(x).topk(self.k, dim=-1)
        weights = values.softmax(-1)
        out = torch.zeros_like(x)
        for e in range(self.experts.down_proj.shape[0]):
            token, slot = (index == e).nonzero(as_tuple=True)
            if len(token):
                out.index_add_(0, token, self.expert(e, x[token]) * weights[token, slot, None])
        return out.reshape(shape), values


class GptOssHalves(GptOssBlock):
    MISTAKE = "halves"


class GptOssNoClamp(GptOssBlock):
    MISTAKE = "no_clamp"


class Llama4Block(nn.Module):
    """Llama 4: top-k of the router's logits, sigmoid of those; the score multiplies the expert's INPUT; experts
    [E, d, 2ff] as x @ W with [gate | up] halves; a shared expert added.  Returns [batch·tokens, d]."""

    MISTAKE = None

    def __init__(self, config):
        super().__init__()
        d, f, count = config.hidden_size, config.intermediate_size, config.num_local_experts
        self.k = config.num_experts_per_tok
        self.router = nn.Linear(d, count, bias=False)
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.empty(count, d, 2 * f))
        self.experts.down_proj = nn.Parameter(torch.empty(count, f, d))
        self.shared_expert = Expert(d, f)

    def expert(self, e, x):
        gate, up = (x @ self.experts.gate_up_proj[e]).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ self.experts.down_proj[e]

    def forward(self, x):
        x = x.reshape(-1, x.shape[-1])
        values, index = self.router(x).topk(self.k, dim=-1)
        scores = values.sigmoid()
        out = self.shared_expert(x)
        for e in range(self.experts.down_proj.shape[0]):
            token, slot = (index == e).nonzero(as_tuple=True)
            if len(token):
                s = scores[token, slot, None]
                routed = self.expert(e, x[token]) * s if self.MISTAKE == "score_on_output" else \
                    self.expert(e, x[token] * s)
                out = out.index_add(0, token, routed)
        return out


class Llama4ScoreOnOutput(Llama4Block):
    MISTAKE = "score_on_output"


class OwnNamesQwenBlock(nn.Module):
    """Qwen2-MoE under a porter's own names: router, experts.N.w1/w3/w2, shared_mlp.w_gate/w_up/w_down."""

    def __init__(self, config):
        super().__init__()
        d = config.hidden_size
        self.k = config.num_experts_per_tok
        self.router = nn.Linear(d, config.num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(d, config.moe_intermediate_size, ("w1", "w3", "w2"))
                                     for _ in range(config.num_experts))
        self.shared_mlp = Expert(d, config.shared_expert_intermediate_size, ("w_gate", "w_up", "w_down"))
        self.shared_expert_gate = nn.Linear(d, 1, bias=False)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, index = self.router(x).softmax(-1).topk(self.k, dim=-1)
        routed = combine(x, self.experts, weights, index)
        return (routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_mlp(x)).reshape(shape)


class DeepSeekDropsExpert7(DeepSeekBlock):
    """A port that silently leaves expert 7 out (a real class of bug: an off-by-one over the experts' list)."""

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, index = self.route(x)
        weights = weights.masked_fill(index == 7, 0.0)
        return (combine(x, self.experts, weights, index) + self.shared_experts(x)).reshape(shape)


class StackedMixtralBlock(nn.Module):
    """Mixtral with every expert's projections stacked per role under a porter's own names (as MLX-LM's SwitchGLU
    keeps them): switch_mlp.gate_proj / up_proj [E, ff, d], down_proj [E, d, ff], router gate.weight."""

    def __init__(self, config):
        super().__init__()
        d, f, count = config.hidden_size, config.intermediate_size, config.num_local_experts
        self.k = config.num_experts_per_tok
        self.gate = nn.Linear(d, count, bias=False)
        self.switch_mlp = nn.Module()
        self.switch_mlp.gate_proj = nn.Parameter(torch.empty(count, f, d))
        self.switch_mlp.up_proj = nn.Parameter(torch.empty(count, f, d))
        self.switch_mlp.down_proj = nn.Parameter(torch.empty(count, d, f))

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, index = self.gate(x).softmax(-1).topk(self.k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        m = self.switch_mlp
        for e in range(m.gate_proj.shape[0]):
            token, slot = (index == e).nonzero(as_tuple=True)
            if len(token):
                h = x[token]
                y = (F.silu(h @ m.gate_proj[e].t()) * (h @ m.up_proj[e].t())) @ m.down_proj[e].t()
                out.index_add_(0, token, y * weights[token, slot, None])
        return out.reshape(shape)


class StackedMixtralGateUpSwapped(StackedMixtralBlock):
    """The stacked port with each expert's activation applied to the up branch."""

    def forward(self, x):
        m = self.switch_mlp
        with torch.no_grad():
            m.gate_proj, m.up_proj = m.up_proj, m.gate_proj
        try:
            return super().forward(x)
        finally:
            with torch.no_grad():
                m.gate_proj, m.up_proj = m.up_proj, m.gate_proj
