"""The routing mistakes of a mixture-of-experts block, each a replay on transformers' own sparse block.

Under a replay's context manager, calling the same block (the very object the user's block was judged against,
never a re-implementation) computes the mistake, and leaving it restores the block bit for bit.  A replay changes
one thing: a setting the block reads (``norm_topk_prob``, ``routed_scaling_factor``, ``top_k``, GPT-OSS's
``limit`` and ``alpha``), a submodule's output (the shared expert zeroed, its gate held open), the experts' stored
values (two experts exchanged, halves of a fused gate/up interleaved), or a torch function called inside the router
or the experts (its softmax computed as a sigmoid, its top-k taken before the softmax, its division by the top-k
sum skipped, ``(up + 1)`` read as ``up``).  Which replays apply is read off the block's parts
(engine.routing_parts); two in distinct places of the block make one replay of two mistakes made at once
(``paired``).  engine.routing_mistakes runs them and names the one that fits.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from parity.definitions.mistakes import MistakeId, together
from parity.engine.gate_up_layout import interleave_rows, layout_misread
from parity.engine.module_rewrites import (
    ADDITIONS,
    DIVISIONS,
    Rule,
    adds_one,
    at_once,
    divides_by_row_sum,
    forward_replaced,
    held_setting,
    held_settings,
    holding,
    inside,
    output_replaced,
    top_two_per_group,
)
from parity.engine.routing_parts import Parts, find_parts, outputs, stands_in

MAX_PAIRWISE = 8  # blocks with at most this many experts replay every pair of them without evidence
# where in the block each mistake is: two replays of distinct places compose (a port may make both mistakes at once);
# the replays inside an expert and the exchanges of experts are not paired (each would multiply the experts built)
PLACE = {MistakeId.ROUTER_SIGMOID_INSTEAD_OF_SOFTMAX: "scoring", MistakeId.ROUTER_SOFTMAX_INSTEAD_OF_SIGMOID: "scoring",
         MistakeId.ROUTER_TOPK_BEFORE_SOFTMAX: "scoring", MistakeId.ROUTER_SOFTMAX_BEFORE_TOPK: "scoring",
         MistakeId.ROUTER_RENORMALIZATION_MISSING: "renormalisation",
         MistakeId.ROUTER_RENORMALIZATION_ADDED: "renormalisation",
         MistakeId.SELECTION_BIAS_IN_WEIGHTS: "selection bias", MistakeId.SELECTION_BIAS_MISSING: "selection bias",
         MistakeId.ROUTED_SCALING_DROPPED: "scaling", MistakeId.ROUTER_SCORE_ON_OUTPUT: "placement",
         MistakeId.ROUTER_SCORE_ON_INPUT: "placement", MistakeId.SHARED_EXPERT_MISSING: "shared expert",
         MistakeId.SHARED_EXPERT_GATE_MISSING: "shared expert", MistakeId.SHARED_EXPERT_GATE_AFTER_SUM: "shared expert",
         MistakeId.ROUTER_WRONG_TOP_K: "top-k"}


@dataclass(frozen=True)
class Replay:
    """One mistake: under ``apply()``, calling the block computes it; leaving restores the block."""

    id: MistakeId | str  # a catalogue id, or two made at once (``together``)
    detail: str
    apply: Callable[[], AbstractContextManager]
    experts: tuple[int, int] | None = None  # the pair an exchange swaps


def _expert_view(parts: Parts) -> nn.Module | None:
    """What the replays inside an expert read its settings off (limit, alpha, the gate/up layout): the experts
    module, or a stand-in's template."""
    return getattr(parts.experts, "template", None) if stands_in(parts.experts) else parts.experts


def _within(parts: Parts, key: str, change: Callable[[nn.Module], AbstractContextManager], *,
            stored: Callable[[dict], dict] | None = None) -> Callable[[], AbstractContextManager]:
    """A replay inside the experts: ``change`` applied to the experts module, or on a stand-in to each expert it
    builds (one expert alone in the same module class, so the same change computes the same mistake; it acts on
    each intermediate unit alone, so a stand-in may apply it to each slice of an expert), its pairs kept under
    ``key``.  ``stored``: the same mistake as one expert's stored tensors rearranged (a change that moves rows
    between units), which a stand-in builds its experts from instead."""
    experts = parts.experts
    if stands_in(experts):
        return (lambda: experts.each(key, stored=stored)) if stored is not None else lambda: experts.each(key, change)
    return lambda: change(experts)


# -- the rules a replay rewrites a torch call by ------------------------------------------------------------------

def _cast(args: tuple, kwargs: dict) -> torch.Tensor:
    """A softmax's input in the dtype the call asked its output in."""
    dtype = kwargs.get("dtype")
    return args[0].to(dtype) if dtype is not None else args[0]


def _as_sigmoid(func, args, kwargs):
    return torch.sigmoid(_cast(args, kwargs))


def _as_softmax(func, args, kwargs):
    return torch.softmax(args[0], dim=-1)


def _softmax_of_every_logit() -> dict[str, Rule]:
    """A sigmoid taken after the top-k (Llama 4: of the chosen logits, -inf elsewhere) computed as the softmax
    over every expert's logit, kept for the chosen: a port scoring as Mixtral does, without renormalising."""
    seen: dict[str, torch.Tensor] = {}

    def linear(func, args, kwargs):
        seen["logits"] = out = func(*args, **kwargs)
        return out

    def sigmoid(func, args, kwargs):
        scores = args[0]
        every = torch.softmax(seen["logits"].to(scores.dtype), dim=-1)
        return torch.where(torch.isneginf(scores), torch.zeros_like(every), every)
    return {"linear": linear, "sigmoid": sigmoid}


def _passed(func, args, kwargs):
    return _cast(args, kwargs).clone()


def _topk_then_softmax(func, args, kwargs):
    values, index = func(*args, **kwargs)
    return torch.softmax(values, dim=-1), index


def _softmax_then_topk(func, args, kwargs):
    return func(torch.softmax(args[0], dim=-1), *args[1:], **kwargs)


def _undivided(func, args, kwargs):
    return args[0] if divides_by_row_sum(args) else NotImplemented


def _one_dropped(func, args, kwargs):
    return args[0] if adds_one(args) else NotImplemented


def _best_of_group(func, args, kwargs):
    """A group's score its best expert's where the block sums its best two: the second of each group's top-2 read
    as 0."""
    if not top_two_per_group(args, kwargs):
        return NotImplemented
    values, index = func(*args, **kwargs)
    return torch.return_types.topk((torch.cat([values[..., :1], torch.zeros_like(values[..., 1:])], dim=-1), index))


def _biased(bias: torch.Tensor) -> Rule:
    def gather(func, args, kwargs):
        out = func(*args, **kwargs)
        index = args[2] if len(args) > 2 else kwargs["index"]
        return out + bias.reshape(-1).to(out.dtype)[index]
    return gather


# -- what a replay does to the block's modules --------------------------------------------------------------------


# -- what a replay does to the block's modules --------------------------------------------------------------------

def _renormalised(at: int) -> Callable:
    def change(out, *args):
        values = outputs(out)
        values[at] = values[at] / values[at].sum(-1, keepdim=True)
        return tuple(values)
    return change


def _scores_on_input(forward: Callable) -> Callable:
    """Experts called once per top-k rank, on the input times that rank's weight, at weight 1.  The call's tensors
    are read in order (the tokens, then the chosen experts and their weights, told apart by their dtype), so a
    stand-in taking ``*args`` (engine.check.block_replay.ExpertsOnDemand) is called as the module is."""

    def experts(*args, **kwargs):
        hidden, index, weights = [a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)][:3]
        if index.is_floating_point():
            index, weights = weights, index
        ones = torch.ones_like(weights[..., :1])
        total = None
        for rank in range(index.shape[-1]):
            part = forward(hidden * weights[..., rank:rank + 1].to(hidden.dtype), index[..., rank:rank + 1], ones)
            total = part if total is None else total + part
        return total
    return experts


@contextmanager
def _scores_on_output(parts: Parts) -> Iterator[None]:
    """The router hands the block 1 for each chosen expert (its input unscaled) and the experts' outputs,
    [experts x tokens, d] as the block stacks them, are multiplied by the scores it kept."""
    kept: dict[str, torch.Tensor] = {}

    def chosen(out, *args):
        values = outputs(out)
        kept["scores"] = scores = values[parts.weights_at]
        values[parts.weights_at] = (scores != 0).to(scores.dtype)
        return tuple(values)

    def scaled(out, *args):
        scores = kept["scores"].transpose(0, 1).unsqueeze(-1).to(out.dtype)
        return (out.reshape(parts.num_experts, -1, out.shape[-1]) * scores).reshape(out.shape)

    with output_replaced(parts.router, chosen), output_replaced(parts.experts, scaled):
        yield


def _gated_by(gate: nn.Module) -> Callable:
    return lambda out, hidden, *args: out * torch.sigmoid(gate(hidden)).to(out.dtype)


def _layout_misread(experts: nn.Module, stored_interleaved: bool) -> AbstractContextManager:
    """The fused gate/up (and its bias) rearranged so that the block, reading its own layout, computes what a port
    reading the stored tensor in the other layout computes: halves [gate; up] interleaved (gate at 0::2) for a
    block that reads interleaved rows, interleaved rows gathered into halves for one that reads halves."""
    if stored_interleaved:
        return _gate_up_rows(experts, lambda rows: interleave_rows(*rows.chunk(2, dim=0)))
    return _gate_up_rows(experts, lambda rows: torch.cat([rows[0::2], rows[1::2]], dim=0))


@contextmanager
def _gate_up_rows(experts: nn.Module, rearranged: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """The experts' fused gate_up_proj (and its bias) holding its gate/up rows ``rearranged`` (rows along dim 0,
    whichever axis the module keeps them on), put back after."""
    def moved(tensor: torch.Tensor, axis: int) -> torch.Tensor:
        return rearranged(tensor.detach().movedim(axis, 0)).movedim(0, axis)

    axis = -1 if getattr(experts, "is_transposed", False) else 1
    with ExitStack() as stack:
        stack.enter_context(holding(experts.gate_up_proj, moved(experts.gate_up_proj, axis)))
        bias = getattr(experts, "gate_up_proj_bias", None)
        if isinstance(bias, torch.Tensor):
            stack.enter_context(holding(bias, moved(bias, -1)))
        yield


@contextmanager
def _exchanged(parts: Parts, first: int, second: int) -> Iterator[None]:
    """Every per-expert tensor of the experts ([E, ...]) with the two experts' slices exchanged."""
    order = list(range(parts.num_experts))
    order[first], order[second] = second, first
    tensors = [t for t in itertools.chain(parts.experts.parameters(recurse=False), parts.experts.buffers(recurse=False))
               if t.dim() >= 1 and t.shape[0] == parts.num_experts]
    with ExitStack() as stack:
        for tensor in tensors:
            stack.enter_context(holding(tensor, tensor.detach()[order]))
        yield


# -- the replays that apply to a block ----------------------------------------------------------------------------


# -- the replays that apply to a block ----------------------------------------------------------------------------

def _scoring(parts: Parts) -> list[Replay]:
    """The score function swapped, and the top-k moved to the other side of the softmax."""
    calls, router = parts.router_calls, parts.router
    score = next((name for name in calls if name in ("softmax", "sigmoid")), None)
    found = []
    if score == "softmax":
        found.append(Replay(MistakeId.ROUTER_SIGMOID_INSTEAD_OF_SOFTMAX, "the router's softmax computed as a sigmoid",
                            lambda: inside(router, {"softmax": _as_sigmoid})))
    elif score == "sigmoid":
        found.append(Replay(MistakeId.ROUTER_SOFTMAX_INSTEAD_OF_SIGMOID, "the router's sigmoid computed as a softmax "
                            "over its input", lambda: inside(router, {"sigmoid": _as_softmax})))
        if "topk" in calls and calls.index("topk") < calls.index("sigmoid") and "linear" in calls:
            found.append(Replay(MistakeId.ROUTER_SOFTMAX_INSTEAD_OF_SIGMOID, "a softmax over every expert's logit, "
                                "the chosen kept", lambda: inside(router, _softmax_of_every_logit)))
    if "softmax" in calls and "topk" in calls:
        if calls.index("softmax") < calls.index("topk"):
            found.append(Replay(MistakeId.ROUTER_TOPK_BEFORE_SOFTMAX, "top-k of the logits, softmax over the k",
                                lambda: inside(router, {"softmax": _passed, "topk": _topk_then_softmax})))
        else:
            found.append(Replay(MistakeId.ROUTER_SOFTMAX_BEFORE_TOPK, "softmax over every expert, top-k of it",
                                lambda: inside(router, {"topk": _softmax_then_topk, "softmax": _passed})))
    return found


def _renormalisation(parts: Parts) -> list[Replay]:
    """The top-k weights' renormalisation dropped where the block has it, added where it has not."""
    router, calls = parts.router, parts.router_calls
    setting = getattr(router, "norm_topk_prob", None)
    if isinstance(setting, bool):
        mistake = MistakeId.ROUTER_RENORMALIZATION_MISSING if setting else MistakeId.ROUTER_RENORMALIZATION_ADDED
        return [Replay(mistake, f"norm_topk_prob = {not setting}",
                       lambda: held_setting(router, "norm_topk_prob", not setting))]
    if "/sum" in calls:
        return [Replay(MistakeId.ROUTER_RENORMALIZATION_MISSING, "the router's division by the top-k sum skipped",
                       lambda: inside(router, dict.fromkeys(DIVISIONS, _undivided)))]
    softmax_of_k = "topk" in calls and "softmax" in calls[calls.index("topk"):]  # its weights already sum to 1
    if parts.weights_at is None or softmax_of_k:
        return []
    return [Replay(MistakeId.ROUTER_RENORMALIZATION_ADDED, "the router's weights divided by their sum",
                   lambda: output_replaced(router, _renormalised(parts.weights_at)))]


def _router_settings(parts: Parts) -> list[Replay]:
    """routed_scaling_factor set to 1; the selection bias buffer added to the weights the router gathers."""
    found = []
    scaled = next((m for m in parts.block.modules() if isinstance(getattr(m, "routed_scaling_factor", None),
                                                                  (int, float)) and m.routed_scaling_factor != 1), None)
    if scaled is not None:
        found.append(Replay(MistakeId.ROUTED_SCALING_DROPPED, f"routed_scaling_factor {scaled.routed_scaling_factor} "
                            "-> 1", lambda: held_setting(scaled, "routed_scaling_factor", 1.0)))
    bias = selection_bias(parts)
    if bias is not None and "gather" in parts.router_calls:
        found.append(Replay(MistakeId.SELECTION_BIAS_IN_WEIGHTS, f"{bias[0]} added to the weights",
                            lambda: inside(parts.router, {"gather": _biased(bias[1])})))
    return found


def selection_bias(parts: Parts) -> tuple[str, torch.Tensor] | None:
    """The bias a router adds to the scores to choose experts: one value per expert, held as a buffer (DeepSeek's
    e_score_correction_bias) or a frozen parameter (Ernie 4.5's statics), the router's or the block's own
    (MiniMax-M2 hands its router the block's); never the experts' own, nor a bias named ``bias``, which a linear map
    adds to the logits (GPT-OSS's router: it weights as well as chooses)."""
    experts = {id(t) for t in [*parts.experts.parameters(), *parts.experts.buffers()]}
    for module in (parts.router, parts.block):
        held = [*module.named_buffers(), *((n, p) for n, p in module.named_parameters() if not p.requires_grad)]
        found = next(((name, b) for name, b in held if id(b) not in experts and name.rsplit(".", 1)[-1] != "bias"
                      and b.is_floating_point() and b.numel() == parts.num_experts), None)
        if found is not None:
            return found
    return None


def _selection_bias_missing(parts: Parts) -> list[Replay]:
    """The experts chosen without the selection bias: it held at 0; where the router scores groups of experts by
    their best two, also each group by its best alone (DeepSeek-V3's inference Gate without a bias: ``amax``).  None
    where the bias is one value for every expert (zero, as transformers initialises it): adding it chooses nothing,
    so leaving it out is the correct block."""
    bias = selection_bias(parts)
    if bias is None or not bool((bias[1] != bias[1].reshape(-1)[0]).any()):
        return []
    name, values = bias
    found = [Replay(MistakeId.SELECTION_BIAS_MISSING, f"{name} left out of the choice",
                    lambda: holding(values, torch.zeros_like(values)))]
    if "top-2/group" in parts.router_calls:
        found.append(Replay(MistakeId.SELECTION_BIAS_MISSING, f"{name} left out of the choice and each group scored "
                            "by its best expert (DeepSeek-V3's inference Gate without a bias)",
                            lambda: at_once(lambda: holding(values, torch.zeros_like(values)),
                                              lambda: inside(parts.router, {"topk": _best_of_group}))))
    return found


def _placement(parts: Parts) -> list[Replay]:
    """The router score moved to the other side of the experts: experts called with the weights scale their
    output (the mistake scales their input), experts called with the input alone get it scaled (the mistake
    scales their output)."""
    taken = len(inspect.signature(parts.experts.forward).parameters)
    if stands_in(parts.experts):  # called as the experts module it stands for is
        taken = 3 if getattr(parts.experts, "routed", True) else 1
    if taken >= 3:
        return [Replay(MistakeId.ROUTER_SCORE_ON_INPUT, "each expert run on its input times the routing weight",
                       lambda: forward_replaced(parts.experts, _scores_on_input))]
    if taken == 1 and parts.weights_at is not None:
        return [Replay(MistakeId.ROUTER_SCORE_ON_OUTPUT, "each expert's output times the router score",
                       lambda: _scores_on_output(parts))]
    return []


def _shared(parts: Parts) -> list[Replay]:
    """Each shared expert zeroed; its gate held open (sigmoid(inf) = 1), or multiplying the routed sum too."""
    names = {id(m): name for name, m in parts.block.named_children()}
    found = [Replay(MistakeId.SHARED_EXPERT_MISSING, f"{names[id(m)]} left out",
                    lambda m=m: output_replaced(m, lambda out, *args: torch.zeros_like(out))) for m in parts.shared]
    gate = parts.shared_gate
    if gate is not None and parts.shared:
        name = names[id(gate)]
        found += [Replay(MistakeId.SHARED_EXPERT_GATE_MISSING, f"{name} not applied",
                         lambda: output_replaced(gate, lambda out, *args: torch.full_like(out, float("inf")))),
                  Replay(MistakeId.SHARED_EXPERT_GATE_AFTER_SUM, f"sigmoid({name}) applied to the routed experts too",
                         lambda: output_replaced(parts.experts, _gated_by(gate)))]
    return found


def _top_k(parts: Parts) -> list[Replay]:
    holders = [m for m in (parts.router, parts.block) if getattr(m, "top_k", None) == parts.top_k]
    return [Replay(MistakeId.ROUTER_WRONG_TOP_K, f"top-{k} instead of top-{parts.top_k}",
                   lambda k=k: held_settings([(m, "top_k", k) for m in holders]))
            for k in (parts.top_k - 1, parts.top_k + 1) if 1 <= k <= parts.num_experts]


def _swiglu(parts: Parts) -> list[Replay]:
    """GPT-OSS's experts: the clamp at ``limit`` (missing, or at 0), ``alpha``, ``(up + 1)``; a fused gate/up
    read in the other layout (interleaved as halves, halves as interleaved)."""
    experts, found = _expert_view(parts), []
    if experts is None:
        return found
    limit, alpha = getattr(experts, "limit", None), getattr(experts, "alpha", None)
    if isinstance(limit, (int, float)) and "clamp" in parts.expert_calls:
        found += [Replay(MistakeId.SWIGLU_CLAMP_MISSING, f"limit {limit} -> {to}",
                         _within(parts, f"limit {to}", lambda module, to=to: held_setting(module, "limit", to)))
                  for to in (float("inf"), 0.0)]  # no clamp, or a limit read as 0
    if isinstance(alpha, (int, float)) and alpha != 1:
        found.append(Replay(MistakeId.SWIGLU_ALPHA_MISSING, f"alpha {alpha} -> 1",
                            _within(parts, "alpha 1", lambda module: held_setting(module, "alpha", 1.0))))
    if "+1" in parts.expert_calls:
        found.append(Replay(MistakeId.SWIGLU_UP_PLUS_ONE_MISSING, "(up + 1) computed as up",
                            _within(parts, "up + 1", lambda module: inside(module, dict.fromkeys(ADDITIONS,
                                                                                                 _one_dropped)))))
    concatenated = getattr(experts, "is_concatenated", None)  # set by transformers' experts decorator
    if isinstance(concatenated, bool) and isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor):
        detail = "gate_up_proj's rows 0::2, 1::2 read as gate and up" if concatenated \
            else "gate_up_proj's halves read as gate and up"
        found.append(Replay(MistakeId.GATE_UP_INTERLEAVING_MISREAD, detail, _within(
            parts, "layout", lambda module: _layout_misread(module, stored_interleaved=not concatenated),
            stored=functools.partial(layout_misread, stored_interleaved=not concatenated))))
    return found


def _gate_up(parts: Parts) -> list[Replay]:
    """Every expert's gate and up exchanged (the activation applied to the up branch), in the fused layout the
    block holds them (halves, or interleaved rows)."""
    experts = _expert_view(parts)
    if not isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor) or not getattr(experts, "has_gate", True):
        return []
    return [Replay(MistakeId.GATE_UP_SWAPPED, "every expert's gate and up exchanged",
                   _within(parts, "gate and up", _swapped))]


def _swapped(experts: nn.Module) -> AbstractContextManager:
    """The fused gate/up (and its bias) with gate's rows and up's exchanged, in the module's own layout."""
    if getattr(experts, "is_concatenated", True) is False:  # interleaved: gate at 0::2, up at 1::2
        return _gate_up_rows(experts, lambda rows: interleave_rows(rows[1::2], rows[0::2]))
    return _gate_up_rows(experts, lambda rows: torch.cat(rows.chunk(2, dim=0)[::-1], dim=0))


def _exchanges(parts: Parts, pairs: Iterable[tuple[int, int]] | None) -> list[Replay]:
    if pairs is None:
        pairs = itertools.combinations(range(parts.num_experts), 2) if parts.num_experts <= MAX_PAIRWISE else ()
    stand_in = parts.experts if stands_in(parts.experts) else None
    return [Replay(MistakeId.EXPERTS_EXCHANGED, f"experts {i} and {j} exchanged",
                   (lambda i=i, j=j: stand_in.exchanged(i, j)) if stand_in is not None else
                   (lambda i=i, j=j: _exchanged(parts, i, j)), experts=(i, j)) for i, j in pairs]


def replays_of(parts: Parts, exchanged: Iterable[tuple[int, int]] | None) -> list[Replay]:
    """Every replay that applies, in the same order on a block holding its experts and on a stand-in (``stands_in``:
    those inside an expert then change each expert it builds)."""
    return (_scoring(parts) + _renormalisation(parts) + _router_settings(parts) + _selection_bias_missing(parts)
            + _placement(parts) + _shared(parts) + _top_k(parts) + _swiglu(parts) + _gate_up(parts)
            + _exchanges(parts, exchanged))


def paired(singles: list[Replay]) -> list[Replay]:
    """Two mistakes made at once: every two of ``singles`` in distinct places of the block (PLACE: the scoring, the
    renormalisation, the selection bias, the scaling, where the score is applied, the shared expert, the top-k),
    each pair one replay applying both."""
    placed = [r for r in singles if r.id in PLACE]
    return [Replay(together(a.id, b.id), f"{a.detail}, with {b.detail}", functools.partial(at_once, a.apply, b.apply))
            for a, b in itertools.combinations(placed, 2) if PLACE[a.id] != PLACE[b.id]]


def replays(block: nn.Module, *, exchanged: Iterable[tuple[int, int]] | None = None) -> list[Replay]:
    """The routing mistakes that apply to ``block`` (transformers' sparse MoE block), each a Replay to call the
    same block under.  ``exchanged``: the pairs of experts to replay exchanged (default: every pair when the
    block has at most MAX_PAIRWISE experts; name_mistake finds the pairs from the evidence)."""
    parts = find_parts(block)
    return [] if parts is None else replays_of(parts, exchanged)


# -- naming the mistake -------------------------------------------------------------------------------------------
