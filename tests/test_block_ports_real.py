"""Whole MoE blocks in the style of real projects' code, against transformers' block.

Real ports were run against `parity CKPT --target wrapper:Block --block` (docs/formats.md, "checked on real
projects' code"): mistral-inference's MoeLayer, Meta's llama-models Llama 4 MoE, openai/gpt-oss's torch MLPBlock,
DeepSeek-V3's inference MoE.  Each was refused, or failed without a name, for a reason of parity's, not of the port.
The ports here are small blocks of our own written in each project's style (its parameter names, shapes, dtypes and
forward signature), one per fix; each test fails without its fix.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from parity.api import check

from .support import run_main

HERE = "tests.test_block_ports_real"


# -- mistral-inference style: a block that takes its tokens flattened, [tokens, d] --------------------------------

class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class FlatTokensMoe(nn.Module):
    """Top-k of the logits, a softmax over the k; ``torch.where`` over [tokens, k] (two dimensions, so a
    [batch, tokens, d] input cannot be unpacked): the layer is called on its tokens flattened."""

    def __init__(self, config):
        super().__init__()
        self.k = config.num_experts_per_tok
        self.experts = nn.ModuleList(SwiGLU(config.hidden_size, config.intermediate_size)
                                     for _ in range(config.num_local_experts))
        self.gate = nn.Linear(config.hidden_size, config.num_local_experts, bias=False)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        weights, chosen = torch.topk(self.gate(inputs), self.k)
        weights = F.softmax(weights, dim=1, dtype=torch.float).to(inputs.dtype)
        out = torch.zeros_like(inputs)
        for i, expert in enumerate(self.experts):
            rows, nth = torch.where(chosen == i)
            out[rows] += weights[rows, nth, None] * expert(inputs[rows])
        return out


class FlatTokensMoeExchanged(FlatTokensMoe):
    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        self.experts = nn.ModuleList([self.experts[1], self.experts[0], *self.experts[2:]])
        try:
            return super().forward(inputs)
        finally:
            self.experts = nn.ModuleList([self.experts[1], self.experts[0], *self.experts[2:]])


@pytest.mark.parametrize("seed", [0, 2])
def test_a_block_taking_its_tokens_flattened_is_called_so_and_passes(blocks, seed):
    report = check(str(blocks["mixtral"]), target=FlatTokensMoe, block=True, seed=seed)
    assert report.passed, report
    assert [r.unit for r in report.layers] == ["block"] * len(report.layers)
    assert any("[batch·tokens, d]" in note for note in report.notes), report.notes


def test_a_block_taking_its_tokens_flattened_is_named_when_it_exchanges_two_experts(blocks, capsys):
    code, out, err = run_main(capsys, str(blocks["mixtral"]), "--target", f"{HERE}:FlatTokensMoeExchanged", "--block")
    assert code == 1, err
    assert "Traceback" not in out + err
    assert "experts_exchanged" in out and "experts 0 and 1 exchanged" in out, out


# -- gpt-fast style: built from the config's fields under the project's own names ------------------------------

class StackedByIndex(nn.Module):
    def __init__(self, config):
        super().__init__()
        e, d, i = config.num_experts, config.dim, config.intermediate_size
        self.w1, self.w3 = nn.Parameter(torch.empty(e, i, d)), nn.Parameter(torch.empty(e, i, d))
        self.w2 = nn.Parameter(torch.empty(e, d, i))

    def forward(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        gated = F.silu(torch.einsum("ti,taoi->tao", x, self.w1[index]))
        return torch.einsum("tao,taio->tai", gated * torch.einsum("ti,taoi->tao", x, self.w3[index]), self.w2[index])


class ReadsActivatedExperts(nn.Module):
    """Reads config.dim, config.num_experts and config.num_activated_experts, none a transformers config field."""

    def __init__(self, config):
        super().__init__()
        self.gate = nn.Linear(config.dim, config.num_experts, bias=False)
        self.cond_ffn = StackedByIndex(config)
        self.dim, self.k = config.dim, config.num_activated_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(-1, self.dim)
        weights, index = torch.topk(F.softmax(self.gate(x), dim=-1), self.k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return torch.einsum("tai,ta->ti", self.cond_ffn(x, index), weights)


def test_a_block_reading_the_experts_counts_under_its_projects_names_is_built_from_the_config(blocks):
    report = check(str(blocks["mixtral"]), target=ReadsActivatedExperts, block=True)
    assert report.passed, report
    assert report.routes["tensors"]["cond_ffn.w1"] == "every expert's gate", report.routes


# -- Meta llama-models Llama 4 style: the router held [D, E], experts stacked [E, D, F] for x @ W ------------------

class RouterDE(nn.Module):
    """Sigmoid of the top-k logits multiplied into each expert's input; every expert runs on every token (the others
    scaled to zero); a shared SwiGLU beside them."""

    def __init__(self, config):
        super().__init__()
        e, d, f = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.k = config.num_experts_per_tok
        self.router_DE = nn.Parameter(torch.empty(d, e))
        self.w1 = nn.Parameter(torch.empty(e, d, f))
        self.w2 = nn.Parameter(torch.empty(e, f, d))
        self.w3 = nn.Parameter(torch.empty(e, d, f))
        self.shared_expert = SwiGLU(d, f)

    def forward(self, x_bsD: torch.Tensor) -> torch.Tensor:  # noqa: N803 - the project's shape-suffix names
        _, slen, d = x_bsD.shape
        x_aD = x_bsD.reshape(-1, d)
        scores_aE = x_aD @ self.router_DE
        top, index = torch.topk(scores_aE, self.k, dim=1)
        scores_aE = torch.full_like(scores_aE, float("-inf")).scatter(1, index, top).sigmoid()
        routed_EaD = x_aD.unsqueeze(0) * self.scored(scores_aE).t().unsqueeze(-1)
        hidden = F.silu(torch.bmm(routed_EaD, self.w1)) * torch.bmm(routed_EaD, self.w3)
        out_aD = self.shared_expert(x_aD) + self.combined(torch.bmm(hidden, self.w2), scores_aE)
        return out_aD.view(-1, slen, d)

    def scored(self, scores_aE: torch.Tensor) -> torch.Tensor:
        return scores_aE

    def combined(self, out_EaD: torch.Tensor, scores_aE: torch.Tensor) -> torch.Tensor:
        return out_EaD.sum(0)


class RouterDEScoreOnOutput(RouterDE):
    def scored(self, scores_aE: torch.Tensor) -> torch.Tensor:
        return (scores_aE > 0).to(scores_aE.dtype)

    def combined(self, out_EaD: torch.Tensor, scores_aE: torch.Tensor) -> torch.Tensor:
        return (out_EaD * scores_aE.t().unsqueeze(-1)).sum(0)


def test_a_router_held_d_by_e_for_x_at_w_is_filled_transposed_and_passes(blocks):
    report = check(str(blocks["llama4_text"]), target=RouterDE, block=True, seed=1)
    assert report.passed, report
    assert "transposed" in report.routes["tensors"]["router_DE"], report.routes


def test_a_router_held_d_by_e_scoring_the_output_is_named(blocks):
    report = check(str(blocks["llama4_text"]), target=RouterDEScoreOnOutput, block=True)
    assert not report.passed
    assert {r.diagnosis.id for r in report.layers} == {"router_score_on_output"}


# -- openai/gpt-oss style: mlp1_weight [E, 2I, d] interleaved, mlp1_bias, mlp2_weight [E, d, I], mlp2_bias --------

class Mlp1Mlp2(nn.Module):
    """gate (with bias), softmax over the top-k logits, einsums over the chosen experts' stacked weights, the
    clamped SwiGLU on alternate rows (gate 0::2, up 1::2) with alpha and up + 1."""

    def __init__(self, config):
        super().__init__()
        e, d, i = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.k, self.limit = config.num_experts_per_tok, config.swiglu_limit
        self.gate = nn.Linear(d, e)
        self.mlp1_weight = nn.Parameter(torch.empty(e, 2 * i, d))
        self.mlp1_bias = nn.Parameter(torch.empty(e, 2 * i))
        self.mlp2_weight = nn.Parameter(torch.empty(e, d, i))
        self.mlp2_bias = nn.Parameter(torch.empty(e, d))

    def halves(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return t[..., ::2], t[..., 1::2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        t = x.reshape(-1, shape[-1])
        top = torch.topk(self.gate(t), k=self.k, dim=-1, sorted=True)
        weights, index = torch.softmax(top.values, dim=1), top.indices
        h = torch.einsum("beck,bk->bec", self.mlp1_weight[index], t) + self.mlp1_bias[index]
        glu, lin = self.halves(h)
        glu, lin = glu.clamp(max=self.limit), lin.clamp(min=-self.limit, max=self.limit)
        h = glu * torch.sigmoid(1.702 * glu) * (lin + 1)
        h = torch.einsum("beck,bek->bec", self.mlp2_weight[index], h) + self.mlp2_bias[index]
        return torch.einsum("bec,be->bc", h, weights).reshape(shape)


class Mlp1Mlp2ReadAsHalves(Mlp1Mlp2):
    def halves(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(t.chunk(2, dim=-1))


class NormInside(Mlp1Mlp2):
    """gpt-oss's MLPBlock as the project writes it: x + experts(norm(x)), the decoder layer's norm inside."""

    def __init__(self, config):
        super().__init__(config)
        self.norm = nn.RMSNorm(config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + super().forward(self.norm(x))


class ResidualInside(Mlp1Mlp2):
    """The norm taken out of gpt-oss's MLPBlock, its residual left in: x + experts(x)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + super().forward(x)


def test_a_block_adding_its_input_to_its_output_is_named(blocks):
    report = check(str(blocks["gpt_oss"]), target=ResidualInside, block=True)
    assert not report.passed
    assert {r.diagnosis.id for r in report.layers} == {"block_residual_included"}


def test_stacked_mlp1_mlp2_weights_and_biases_are_filled_and_pass(blocks):
    report = check(str(blocks["gpt_oss"]), target=Mlp1Mlp2, block=True, seed=2)
    assert report.passed, report
    tensors = report.routes["tensors"]
    assert tensors["mlp1_bias"].endswith("experts.gate_up_proj_bias"), tensors
    assert tensors["mlp2_bias"] == "every expert's down_bias", tensors


def test_stacked_mlp1_read_as_halves_is_named(blocks, capsys):
    code, out, err = run_main(capsys, str(blocks["gpt_oss"]), "--target", f"{HERE}:Mlp1Mlp2ReadAsHalves", "--block")
    assert code == 1, err
    assert out.count("MISMATCH — gate_up_interleaving_misread") == 2, out


def test_a_block_holding_the_layers_norm_is_told_what_the_block_is(blocks, capsys):
    code, out, err = run_main(capsys, str(blocks["gpt_oss"]), "--target", f"{HERE}:NormInside", "--block")
    assert code == 2, out
    assert "Traceback" not in out + err
    assert "'norm.weight'" in err and "nn.Identity()" in err and "minus its input" in err, err


# -- DeepSeek-V3 inference style: a Linear class whose default dtype is bfloat16 -----------------------------------

class HalfLinear(nn.Module):
    dtype = torch.bfloat16  # the project's class attribute: generate.py runs the model in bfloat16

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=HalfLinear.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class HalfExpert(nn.Module):
    def __init__(self, dim: int, inter_dim: int):
        super().__init__()
        self.w1, self.w2, self.w3 = HalfLinear(dim, inter_dim), HalfLinear(inter_dim, dim), HalfLinear(dim, inter_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class HalfExpertsMoe(nn.Module):
    """A softmax router (float32, an nn.Parameter of the default dtype) beside experts whose Linear is bfloat16."""

    def __init__(self, config):
        super().__init__()
        self.k = config.num_experts_per_tok
        self.weight = nn.Parameter(torch.empty(config.num_local_experts, config.hidden_size))
        self.experts = nn.ModuleList(HalfExpert(config.hidden_size, config.intermediate_size)
                                     for _ in range(config.num_local_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, index = torch.topk(F.linear(x, self.weight).softmax(-1), self.k)
        weights = weights / weights.sum(-1, keepdim=True)
        y = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            rows, top = torch.where(index == i)
            y[rows] += (expert(x[rows].to(self.experts[0].w1.weight.dtype)) * weights[rows, top, None]).to(y.dtype)
        return y.view(shape)


class HalfEverywhere(HalfExpertsMoe):
    """The same built under torch.set_default_dtype(torch.bfloat16), as generate.py builds it: every parameter
    bfloat16, the input cast to it."""

    def __init__(self, config):
        super().__init__(config)
        self.weight.data = self.weight.data.bfloat16()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.bfloat16()).float()


class Uncast(HalfExpertsMoe):
    """A forward that does not cast the input to the experts' dtype: torch refuses float32 @ bfloat16."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.experts[0].w2.weight @ self.experts[0].w1.weight)


def test_a_block_with_parameters_of_two_dtypes_that_fails_says_so(blocks, capsys):
    code, out, err = run_main(capsys, str(blocks["mixtral"]), "--target", f"{HERE}:Uncast", "--block")
    assert code == 2, out
    assert "Traceback" not in out + err
    assert "more than one dtype" in err and "float32: weight" in err and "bfloat16: experts.0.w1.weight" in err, err


def test_a_block_built_in_bfloat16_is_named_low_precision_compute(blocks):
    report = check(str(blocks["mixtral"]), target=HalfEverywhere, block=True)
    assert not report.passed
    assert {r.diagnosis.id for r in report.layers} == {"low_precision_compute"}
    assert all("bfloat16 parameters" in r.diagnosis.message for r in report.layers)


class Float32Moe(HalfExpertsMoe):
    def __init__(self, config):
        super().__init__(config)
        self.float()


def test_a_block_built_in_float32_passes_where_its_bfloat16_build_is_named(blocks):
    assert check(str(blocks["mixtral"]), target=Float32Moe, block=True).passed


def test_a_whole_block_is_not_reported_at_a_dtype_it_did_not_run_in(blocks, capsys):
    code, out, err = run_main(capsys, str(blocks["mixtral"]), "--target", f"{HERE}:Float32Moe", "--block",
                              "--dtype", "bfloat16")
    assert code == 2, out
    assert "float32 on the CPU only" in err and "--dtype bfloat16" in err, err


# -- torchtitan style: router.gate, experts stacked under shape-suffixed names, a selection-bias buffer for every
#    family, the experts computed in bfloat16 inside the forward --------------------------------------------------

class SuffixRouter(nn.Module):
    """Softmax of ``gate`` in float32, top-k of the scores plus a selection bias, the weights gathered from the scores
    without it, renormalised where asked."""

    def __init__(self, d: int, e: int, k: int, renormalise: bool):
        super().__init__()
        self.gate = nn.Linear(d, e, bias=False)
        self.top_k, self.renormalise = k, renormalise

    def forward(self, x_TD: torch.Tensor, bias_E: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: N803
        scores_TE = F.softmax(self.gate(x_TD).float(), dim=-1)
        ids_TK = (scores_TE if bias_E is None else scores_TE + bias_E).topk(self.top_k, dim=-1).indices
        weights_TK = scores_TE.gather(-1, ids_TK)
        if self.renormalise:
            weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True)
        return weights_TK, ids_TK


class SuffixNamedMoe(nn.Module):
    """Every expert's gate, down and up stacked as ``w1_EFD`` [E, F, D], ``w2_EDF`` [E, D, F], ``w3_EFD`` (a shape
    suffix, one capital per dimension), a ``tokens_per_expert_E`` counter not persistent; the tokens sorted by expert,
    each expert run on its slice in ``compute``, the outputs scaled in float32 and scatter-added back.  Takes its
    tokens as [T, D] (a [batch, tokens, D] input does not unpack)."""

    compute = torch.float32

    def __init__(self, config):
        super().__init__()
        e, d, k = config.num_experts, config.hidden_size, config.num_experts_per_tok
        f = self.width(config)
        self.router = SuffixRouter(d, e, k, self.renormalise(config))
        self.w1_EFD, self.w3_EFD = nn.Parameter(torch.empty(e, f, d)), nn.Parameter(torch.empty(e, f, d))
        self.w2_EDF = nn.Parameter(torch.empty(e, d, f))
        self.register_buffer("tokens_per_expert_E", torch.zeros(e), persistent=False)

    def width(self, config) -> int:
        return config.moe_intermediate_size

    def renormalise(self, config) -> bool:
        return config.norm_topk_prob

    def selection_bias(self) -> torch.Tensor | None:
        return None

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:  # noqa: N803
        _, _ = x_TD.shape
        weights_TK, ids_TK = self.router(x_TD, self.selection_bias())
        order_N = ids_TK.reshape(-1).argsort(stable=True)
        counts = torch.bincount(ids_TK.reshape(-1), minlength=self.w1_EFD.shape[0]).tolist()
        tokens_N = order_N // ids_TK.shape[1]
        c = self.compute
        outs = [(F.silu(x_e @ self.w1_EFD[e].to(c).T) * (x_e @ self.w3_EFD[e].to(c).T)) @ self.w2_EDF[e].to(c).T
                for e, x_e in enumerate(x_TD[tokens_N].to(c).split(counts))]
        y_ND = torch.cat(outs).float() * weights_TK.reshape(-1)[order_N, None]
        return torch.zeros_like(x_TD).index_add_(0, tokens_N, y_ND.to(x_TD.dtype))


class SuffixNamedWithBias(SuffixNamedMoe):
    """A persistent ``expert_bias_E`` selection-bias buffer, registered whatever the family (zero when built)."""

    def __init__(self, config):
        super().__init__(config)
        self.register_buffer("expert_bias_E", torch.zeros(config.num_experts))

    def selection_bias(self) -> torch.Tensor | None:
        return self.expert_bias_E


class SuffixNamedOtherWidth(SuffixNamedMoe):
    def width(self, config) -> int:
        return config.intermediate_size  # the dense FFN's width, not an expert's


class HalfInside(SuffixNamedMoe):
    """Parameters float32, the experts computed in bfloat16: the tokens and each expert's weights cast in forward."""

    compute = torch.bfloat16


class HalfInsideRenormalising(HalfInside):
    def renormalise(self, config) -> bool:
        return not config.norm_topk_prob


def test_stacks_under_shape_suffixed_names_are_filled_and_pass(blocks):
    report = check(str(blocks["qwen3_moe"]), target=SuffixNamedMoe, block=True, seed=1)
    assert report.passed, report
    tensors = report.routes["tensors"]
    assert tensors["w1_EFD"] == "every expert's gate" and tensors["w2_EDF"] == "every expert's down", tensors
    assert tensors["router.gate.weight"].endswith("gate.weight"), tensors


def test_a_selection_bias_buffer_is_zero_where_the_family_has_none(blocks):
    report = check(str(blocks["qwen3_moe"]), target=SuffixNamedWithBias, block=True)
    assert report.passed, report
    assert report.routes["tensors"]["expert_bias_E"].startswith("zero"), report.routes


def test_a_selection_bias_buffer_gets_the_layers_where_the_family_has_one(blocks, capsys):
    code, out, err = run_main(capsys, str(blocks["deepseek_v3"]), "--target", f"{HERE}:SuffixNamedWithBias", "--block")
    assert "Traceback" not in out + err
    assert "expert_bias_E ← transformers: gate.e_score_correction_bias" in out, out + err


def test_stacked_experts_of_another_width_are_a_shape_mismatch(blocks):
    report = check(str(blocks["qwen3_moe"]), target=SuffixNamedOtherWidth, block=True)
    assert not report.passed
    assert {r.diagnosis.id for r in report.layers} == {"shape_mismatch"}
    assert all("'w1_EFD' is [4, 72, 32]" in r.diagnosis.message for r in report.layers), report.layers[0].diagnosis


def test_a_block_computing_its_experts_in_bfloat16_inside_is_named_low_precision_compute(blocks):
    report = check(str(blocks["qwen3_moe"]), target=HalfInside, block=True)
    assert not report.passed
    assert {r.diagnosis.id for r in report.layers} == {"low_precision_compute"}
    for layer in report.layers:
        message = layer.diagnosis.message
        assert "bfloat16 inside its forward" in message and "computes what transformers' block does" in message
        assert layer.max_abs_diff > 100 * layer.tolerance  # bfloat16's error, far beyond float32's tolerance


def test_a_block_computing_in_bfloat16_inside_is_named_for_its_routing_mistake(blocks):
    report = check(str(blocks["qwen3_moe"]), target=HalfInsideRenormalising, block=True)
    assert not report.passed
    for layer in report.layers:  # top-k of the logits then a softmax over them is the same function: said equally
        assert layer.diagnosis.id in {"router_renormalization_added", "router_topk_before_softmax"}, layer.diagnosis
        assert "router_renormalization_added" in {c.id for c in layer.diagnosis.candidates}, layer.diagnosis
        assert "matched at bfloat16's precision" in layer.diagnosis.message
