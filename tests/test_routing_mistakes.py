"""Routing mistakes of a whole mixture-of-experts block, named by replaying each on transformers' own block
(parity/engine/routing_replays.py, run by parity/engine/routing_mistakes.py).

Each family's block is taken from a tiny model built with transformers' own classes from its config (one MoE
layer, eager experts, float64, every parameter and the selection bias drawn afresh).  The blocks under test are
written from scratch below, the way a porter writes one: dense over the experts, from the block's tensors, with
one mistake switched on at a time.  For each family and each mistake that applies: the mistaken port is named with
that mistake's id, the correct port is named as nothing, and every replay leaves the block as it found it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parity.definitions.mistakes import MISTAKES, PRODUCED_BY, MistakeId
from parity.engine.routing_mistakes import name_mistake
from parity.engine.routing_parts import find_parts
from parity.engine.routing_replays import replays

COMMON = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
              vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
MOE = dict(num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, intermediate_size=24,
           moe_intermediate_size=24, shared_expert_intermediate_size=24, n_shared_experts=1)
NEXT = dict(linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
            layer_types=["full_attention"])
DEEPSEEK = dict(first_k_dense_replace=0, num_local_experts=8, n_routed_experts=8, n_group=2, topk_group=1,
                routed_scaling_factor=2.5, norm_topk_prob=True)

SOFTMAX_ROUTER = ["router_sigmoid_instead_of_softmax", "router_score_on_input", "router_wrong_top_k:-1",
                  "router_wrong_top_k:+1", "experts_exchanged:1,2"]
QWEN_SHARED = ["shared_expert_missing", "shared_expert_gate_missing", "shared_expert_gate_after_sum"]
# model_type -> (config values, the block's attribute on a decoder layer, how it routes, the mistakes a port of it
# is tested with: "id", or "id:variant")
FAMILIES = {
    "mixtral": ({}, "mlp", "softmax", SOFTMAX_ROUTER + ["router_renormalization_missing",
                                                        "gate_up_interleaving_misread"]),
    "qwen2_moe": ({}, "mlp", "softmax", SOFTMAX_ROUTER + QWEN_SHARED
                  + ["router_renormalization_added", "router_topk_before_softmax"]),
    "qwen3_moe": (dict(norm_topk_prob=True), "mlp", "softmax", SOFTMAX_ROUTER + ["router_renormalization_missing"]),
    "olmoe": ({}, "mlp", "softmax", SOFTMAX_ROUTER + ["router_renormalization_added", "router_topk_before_softmax"]),
    "qwen3_next": (NEXT, "mlp", "softmax", SOFTMAX_ROUTER + QWEN_SHARED + ["router_renormalization_missing"]),
    "granitemoe": ({}, "block_sparse_moe", "topk", SOFTMAX_ROUTER + ["router_softmax_before_topk"]),
    "gpt_oss": ({}, "mlp", "topk", SOFTMAX_ROUTER + ["router_softmax_before_topk", "swiglu_clamp_missing",
                                                      "swiglu_clamp_missing:0",
                                                      "swiglu_alpha_missing", "swiglu_up_plus_one_missing",
                                                      "gate_up_interleaving_misread"]),
    "deepseek_v3": (DEEPSEEK, "mlp", "sigmoid", ["router_softmax_instead_of_sigmoid", "router_score_on_input",
                                                 "router_wrong_top_k:-1", "router_wrong_top_k:+1",
                                                 "experts_exchanged:2,5", "router_renormalization_missing",
                                                 "routed_scaling_dropped", "selection_bias_in_weights",
                                                 "selection_bias_missing", "selection_bias_missing:best",
                                                 "shared_expert_missing", "gate_up_interleaving_misread"]),
    "llama4_text": (dict(interleave_moe_layer_step=1), "feed_forward", "llama4",
                    ["router_softmax_instead_of_sigmoid", "router_softmax_instead_of_sigmoid:every",
                     "router_score_on_output", "router_wrong_top_k:-1",
                     "router_wrong_top_k:+1", "experts_exchanged:1,2", "router_renormalization_added",
                     "shared_expert_missing"]),
}
CASES = [(family, mistake) for family, (*_, mistakes) in FAMILIES.items() for mistake in mistakes]
SCALE = {"gpt_oss": 24.0}  # drives GPT-OSS's gate pre-activations past swiglu_limit (7)


def tiny_block(model_type: str, values: dict | None = None, seed: int = 7):
    """transformers' own sparse block of a one-layer model, float64, eager experts, values drawn afresh."""
    from transformers import AutoConfig, AutoModelForCausalLM

    family_values, attribute, _, _ = FAMILIES[model_type]
    values = family_values if values is None else values
    config = AutoConfig.for_model(model_type, **{**COMMON, **MOE, **values})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, experts_implementation="eager")
    block = getattr(model.model.layers[0], attribute).double().eval()
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.05)
        for buffer in block.buffers():  # DeepSeek's e_score_correction_bias: a selection bias that matters
            buffer.normal_(0.0, 0.1)
    return block, config


@pytest.fixture(scope="module")
def families():
    """model_type -> (transformers' block, its config)."""
    return {family: tiny_block(family) for family in FAMILIES}


def inputs(model_type: str, seed: int = 3) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(2, 32, COMMON["hidden_size"], generator=generator, dtype=torch.float64) \
        * SCALE.get(model_type, 3.0)


# -- the ports, written from scratch ------------------------------------------------------------------------------

def tensors_of(block, model_type: str) -> dict[str, torch.Tensor]:
    """The block's tensors as a porter reads them: router [E, d], gate/up [E, ff, d], down [E, d, ff], biases."""
    p = {name: t.detach() for name, t in [*block.named_parameters(), *block.named_buffers()]}
    out = {"router": p.get("gate.weight", p.get("router.weight")), "router_bias": p.get("router.bias"),
           "selection_bias": p.get("gate.e_score_correction_bias")}
    fused, down = p["experts.gate_up_proj"], p["experts.down_proj"]
    if model_type == "gpt_oss":  # [E, d, 2ff], gate and up interleaved, with biases
        out.update(gate=fused[..., ::2].transpose(1, 2), up=fused[..., 1::2].transpose(1, 2),
                   gate_bias=p["experts.gate_up_proj_bias"][:, ::2], up_bias=p["experts.gate_up_proj_bias"][:, 1::2],
                   down=down.transpose(1, 2), down_bias=p["experts.down_proj_bias"], fused=fused,
                   fused_bias=p["experts.gate_up_proj_bias"])
    elif model_type == "llama4_text":  # [E, d, 2ff] as halves, x @ W
        gate, up = fused.chunk(2, dim=-1)
        out.update(gate=gate.transpose(1, 2), up=up.transpose(1, 2), down=down.transpose(1, 2))
    else:  # [E, 2ff, d] as halves
        gate, up = fused.chunk(2, dim=1)
        out.update(gate=gate, up=up, down=down, rows=fused)
    for prefix in ("shared_expert.", "shared_experts."):
        if f"{prefix}gate_proj.weight" in p:
            out.update({f"shared_{n}_proj": p[f"{prefix}{n}_proj.weight"] for n in ("gate", "up", "down")})
    if "shared_expert_gate.weight" in p:
        out["shared_gate"] = p["shared_expert_gate.weight"]
    return out


def route(t: dict, h: torch.Tensor, config, style: str, mistake: str, k: int) -> torch.Tensor:
    """The routing weights, dense [tokens, experts] (0 where a token does not go)."""
    logits = h @ t["router"].T + (t["router_bias"] if t["router_bias"] is not None else 0)
    renorm = getattr(config, "norm_topk_prob", style == "softmax")
    renorm = renorm ^ (mistake in ("router_renormalization_missing", "router_renormalization_added"))
    if style == "sigmoid":
        return deepseek_route(t, logits, config, mistake, k, renorm)
    if style == "softmax":
        score = torch.sigmoid if mistake == "router_sigmoid_instead_of_softmax" else lambda v: v.softmax(-1)
        if mistake == "router_topk_before_softmax":
            values, index = logits.topk(k, dim=-1)
            values = values.softmax(-1)
        else:
            values, index = score(logits).topk(k, dim=-1)
    elif style == "topk":
        if mistake == "router_softmax_before_topk":
            values, index = logits.softmax(-1).topk(k, dim=-1)
        else:
            values, index = logits.topk(k, dim=-1)
            values = values.sigmoid() if mistake == "router_sigmoid_instead_of_softmax" else values.softmax(-1)
    elif mistake == "router_softmax_instead_of_sigmoid:every":  # llama4 scored as Mixtral, not renormalised
        values, index = logits.softmax(-1).topk(k, dim=-1)
    else:  # llama4: sigmoid of the top-k logits
        values, index = logits.topk(k, dim=-1)
        values = values.softmax(-1) if mistake == "router_softmax_instead_of_sigmoid" else values.sigmoid()
    if renorm:
        values = values / values.sum(-1, keepdim=True)
    return torch.zeros_like(logits).scatter(1, index, values)


def deepseek_route(t: dict, logits, config, mistake: str, k: int, renorm: bool) -> torch.Tensor:
    scores = logits.softmax(-1) if mistake == "router_softmax_instead_of_sigmoid" else logits.sigmoid()
    choice = scores if mistake.startswith("selection_bias_missing") else scores + t["selection_bias"]
    groups = choice.view(len(choice), config.n_group, -1)
    best_two = groups.topk(2, dim=-1).values.sum(-1)
    group_scores = groups.amax(-1) if mistake == "selection_bias_missing:best" else best_two
    best_groups = group_scores.topk(config.topk_group, dim=-1).indices
    allowed = torch.zeros_like(groups[..., 0]).scatter(1, best_groups, 1.0).bool()
    index = choice.masked_fill(~allowed.repeat_interleave(groups.shape[-1], dim=1), float("-inf")).topk(k).indices
    values = (choice if mistake == "selection_bias_in_weights" else scores).gather(1, index)
    if renorm:
        values = values / values.sum(-1, keepdim=True)
    if mistake != "routed_scaling_dropped":
        values = values * config.routed_scaling_factor
    return torch.zeros_like(logits).scatter(1, index, values)


def experts_on(t: dict, per_expert: torch.Tensor, config, mistake: str) -> torch.Tensor:
    """Every expert on its own input: [tokens, experts, d] -> [tokens, experts, d]."""
    gate = torch.einsum("ted,eid->tei", per_expert, t["gate"]) + t.get("gate_bias", 0)
    up = torch.einsum("ted,eid->tei", per_expert, t["up"]) + t.get("up_bias", 0)
    if "fused" in t:  # GPT-OSS's clamped SwiGLU
        limit = 0.0 if mistake == "swiglu_clamp_missing:0" else config.swiglu_limit
        if mistake != "swiglu_clamp_missing":
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        alpha = 1.0 if mistake == "swiglu_alpha_missing" else config.swiglu_alpha
        act = (up if mistake == "swiglu_up_plus_one_missing" else up + 1) * gate * torch.sigmoid(alpha * gate)
    else:
        act = F.silu(gate) * up
    return torch.einsum("tei,edi->ted", act, t["down"]) + t.get("down_bias", 0)


def misread(t: dict, mistake: str) -> dict:
    """The block's tensors as the mistaken port loads them."""
    t = dict(t)
    if mistake.startswith("experts_exchanged"):
        first, second = (int(e) for e in mistake.split(":")[1].split(","))
        for name in ("gate", "up", "down", "gate_bias", "up_bias", "down_bias"):
            if name in t:
                t[name] = t[name].clone()
                t[name][[first, second]] = t[name][[second, first]]
    if mistake == "gate_up_interleaving_misread" and "fused" in t:  # halves of the interleaved [E, d, 2ff]
        gate, up = t["fused"].chunk(2, dim=-1)
        gate_bias, up_bias = t["fused_bias"].chunk(2, dim=-1)
        t.update(gate=gate.transpose(1, 2), up=up.transpose(1, 2), gate_bias=gate_bias, up_bias=up_bias)
    elif mistake == "gate_up_interleaving_misread":  # alternate rows of the [gate; up] halves [E, 2ff, d]
        t.update(gate=t["rows"][:, 0::2], up=t["rows"][:, 1::2])
    return t


def port(block, config, model_type: str, x: torch.Tensor, mistake: str = "") -> torch.Tensor:
    """A porter's block, from scratch: every expert on every token, combined by the dense routing weights."""
    _, _, style, _ = FAMILIES[model_type]
    t = misread(tensors_of(block, model_type), mistake)
    h = x.reshape(-1, x.shape[-1])
    k = config.num_experts_per_tok + int(mistake.split(":")[1]) if mistake.startswith("router_wrong_top_k") \
        else config.num_experts_per_tok
    weights = route(t, h, config, style, mistake, k)
    experts = weights.shape[1]
    on_input = (style == "llama4") != (mistake in ("router_score_on_output", "router_score_on_input"))
    if on_input:
        out = (experts_on(t, h[:, None, :] * weights[..., None], config, mistake) * (weights != 0)[..., None]).sum(1)
    else:
        out = (experts_on(t, h[:, None, :].expand(-1, experts, -1), config, mistake) * weights[..., None]).sum(1)
    if "shared_gate_proj" in t and mistake != "shared_expert_missing":
        shared = (F.silu(h @ t["shared_gate_proj"].T) * (h @ t["shared_up_proj"].T)) @ t["shared_down_proj"].T
        gate = torch.sigmoid(h @ t["shared_gate"].T) if "shared_gate" in t else 1.0
        if mistake == "shared_expert_gate_after_sum":
            out = gate * (out + shared)
        else:
            out = out + (shared if mistake == "shared_expert_gate_missing" else gate * shared)
    return out


# -- the tests ----------------------------------------------------------------------------------------------------

def transformers_out(block, x: torch.Tensor) -> torch.Tensor:
    out = block(x)
    return (out[0] if isinstance(out, tuple) else out).reshape(-1, x.shape[-1])


def tolerance_for(reference: torch.Tensor) -> float:
    """10^-5 of the output's scale: over 10x the float32 routing softmax's own deviation (~1e-7 relative)."""
    return 1e-5 * float(reference.abs().max())


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_the_inputs_exercise_the_routing(families, model_type):
    """Every expert chosen by some token (and, for GPT-OSS, gate pre-activations past swiglu_limit)."""
    (block, config), x = families[model_type], inputs(model_type)
    parts = find_parts(block)
    captured = []
    hook = parts.router.register_forward_hook(lambda module, args, out: captured.append(out))
    with torch.no_grad():
        block(x)
    hook.remove()
    index = next((v for v in captured[0] if not v.is_floating_point()), None)  # Llama 4: scores, 0 where unrouted
    chosen = index.flatten() if index is not None else (captured[0][0] != 0).nonzero()[:, 1]
    assert set(chosen.tolist()) == set(range(parts.num_experts)), f"{model_type}: an expert no token is routed to"
    if model_type == "gpt_oss":
        gate = torch.einsum("td,eid->tei", x.reshape(-1, x.shape[-1]), tensors_of(block, model_type)["gate"])
        assert float(gate.max()) > 1.5 * config.swiglu_limit


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_the_correct_port_matches_and_is_named_as_nothing(families, model_type):
    (block, config), x = families[model_type], inputs(model_type)
    with torch.no_grad():
        reference, got = transformers_out(block, x), port(block, config, model_type, x)
    tolerance = tolerance_for(reference)
    assert float((got - reference).abs().max()) < tolerance / 10
    assert name_mistake(block, x, got, tolerance=tolerance) == []


@pytest.mark.parametrize("model_type, mistake", CASES)
def test_each_mistaken_port_is_named(families, model_type, mistake):
    (block, config), x = families[model_type], inputs(model_type)
    with torch.no_grad():
        reference, got = transformers_out(block, x), port(block, config, model_type, x, mistake)
    tolerance = tolerance_for(reference)
    assert float((got - reference).abs().max()) > 100 * tolerance, "the mistake does not change this block's output"
    named = name_mistake(block, x, got, tolerance=tolerance)
    ids = [mistake_id for mistake_id, _ in named]
    expected = mistake.split(":")[0]
    assert expected in ids, (ids, named)
    assert len(ids) <= 2, named
    evidence = dict(named)[MistakeId(expected)]
    assert "from this replay" in evidence and type(block).__name__ in evidence
    if expected == "experts_exchanged":
        first, second = mistake.split(":")[1].split(",")
        assert f"experts {first} and {second} exchanged" in evidence


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_every_replay_restores_the_block(families, model_type):
    (block, _), x = families[model_type], inputs(model_type)
    state = {name: t.clone() for name, t in block.state_dict().items()}
    with torch.no_grad():
        before = transformers_out(block, x)
        found = replays(block)
        for replay in found:
            with replay.apply():
                during = transformers_out(block, x)
            assert not torch.equal(during, before), f"{replay} leaves the output as it was"
            assert torch.equal(transformers_out(block, x), before), replay
            assert replay.id in MISTAKES and "routing_replays" in PRODUCED_BY[replay.id]
    assert all(torch.equal(state[name], t) for name, t in block.state_dict().items())
    assert "forward" not in vars(block) and all("forward" not in vars(m) for m in block.modules())


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_the_replays_are_those_the_block_calls_for(families, model_type):
    """Found from the block: every tested mistake has a replay, and no replay needs what the block lacks."""
    found = {replay.id for replay in replays(families[model_type][0])}
    tested = {mistake.split(":")[0] for mistake in FAMILIES[model_type][3]}
    assert tested <= found
    assert (MistakeId.SWIGLU_CLAMP_MISSING in found) == (model_type == "gpt_oss")
    assert (MistakeId.SHARED_EXPERT_GATE_MISSING in found) == (model_type in ("qwen2_moe", "qwen3_next"))
    assert (MistakeId.SELECTION_BIAS_IN_WEIGHTS in found) == (model_type == "deepseek_v3")
    assert (MistakeId.SELECTION_BIAS_MISSING in found) == (model_type == "deepseek_v3")  # not GPT-OSS's router.bias
    assert (MistakeId.ROUTER_SCORE_ON_OUTPUT in found) == (model_type == "llama4_text")


def test_a_setting_decides_which_replay_applies():
    """The same class set otherwise gets other replays: norm_topk_prob on -> 'missing', off -> 'added';
    DeepSeek at routed_scaling_factor 1 has no scaling to drop."""
    def ids(model_type: str, **values) -> set[MistakeId]:
        return {r.id for r in replays(tiny_block(model_type, {**FAMILIES[model_type][0], **values})[0])}

    on, off = ids("qwen3_moe", norm_topk_prob=True), ids("qwen3_moe", norm_topk_prob=False)
    assert MistakeId.ROUTER_RENORMALIZATION_MISSING in on and MistakeId.ROUTER_RENORMALIZATION_ADDED not in on
    assert MistakeId.ROUTER_RENORMALIZATION_ADDED in off and MistakeId.ROUTER_RENORMALIZATION_MISSING not in off
    assert MistakeId.ROUTED_SCALING_DROPPED in ids("deepseek_v3")
    assert MistakeId.ROUTED_SCALING_DROPPED not in ids("deepseek_v3", routed_scaling_factor=1.0)


def test_a_selection_bias_that_chooses_nothing_is_not_replayed_missing():
    """One value for every expert (zero, as transformers initialises it, or any constant) moves every score alike and
    changes no choice: leaving it out is the correct block, so it is not a mistake to replay."""
    block, _ = tiny_block("deepseek_v3")
    for value in (0.0, 0.3):
        with torch.no_grad():
            block.gate.e_score_correction_bias.fill_(value)
        found = {r.id for r in replays(block)}
        assert MistakeId.SELECTION_BIAS_MISSING not in found and MistakeId.SELECTION_BIAS_IN_WEIGHTS in found


def test_experts_exchanged_in_a_large_block_are_found_from_the_tokens():
    """Past MAX_PAIRWISE experts no pair is replayed blindly: the pairs come from the experts only the
    mismatching tokens use, and the exchanged pair is named."""
    from parity.engine.routing_replays import MAX_PAIRWISE

    values = dict(num_local_experts=16, num_experts=16)
    block, config = tiny_block("mixtral", values)
    assert config.num_local_experts > MAX_PAIRWISE
    assert not any(r.id == MistakeId.EXPERTS_EXCHANGED for r in replays(block))
    x = inputs("mixtral")
    with torch.no_grad():
        reference, got = transformers_out(block, x), port(block, config, "mixtral", x, "experts_exchanged:3,11")
    named = name_mistake(block, x, got, tolerance=tolerance_for(reference))
    assert [mistake_id for mistake_id, _ in named] == [MistakeId.EXPERTS_EXCHANGED]
    assert "experts 3 and 11 exchanged" in named[0][1]


def test_tokens_set_aside_are_not_judged():
    """A token whose choice of experts flipped on a near-tie (here: its output replaced outright) hides the
    mistake from every replay; set aside, the mistake is named from the other tokens."""
    (block, config), x = tiny_block("qwen3_moe"), inputs("qwen3_moe")
    with torch.no_grad():
        reference = transformers_out(block, x)
        got = port(block, config, "qwen3_moe", x, "experts_exchanged:1,2")
    flipped = int((got - reference).abs().amax(-1).argmax())
    got[flipped] = -got[flipped]
    tolerance = tolerance_for(reference)
    assert name_mistake(block, x, got, tolerance=tolerance) == []
    judged = torch.ones(len(got), dtype=torch.bool)
    judged[flipped] = False
    named = name_mistake(block, x, got, tolerance=tolerance, tokens=judged)
    assert [mistake_id for mistake_id, _ in named] == [MistakeId.EXPERTS_EXCHANGED]
    assert "experts 1 and 2 exchanged" in named[0][1]


def test_an_output_of_another_shape_is_named_as_nothing(families):
    (block, _), x = families["mixtral"], inputs("mixtral")
    assert name_mistake(block, x, torch.zeros(3, 5, dtype=torch.float64), tolerance=1e-6) == []


def test_a_block_returning_hidden_and_router_logits_is_named(families):
    """transformers' own blocks return (hidden, router_logits) in some families: a port may too."""
    (block, config), x = families["mixtral"], inputs("mixtral")
    with torch.no_grad():
        reference = transformers_out(block, x)
        got = port(block, config, "mixtral", x, "router_renormalization_missing")
    named = name_mistake(block, x, (got.reshape(x.shape), torch.zeros(len(got), 4)),
                         tolerance=tolerance_for(reference))
    assert [mistake_id for mistake_id, _ in named] == [MistakeId.ROUTER_RENORMALIZATION_MISSING]
