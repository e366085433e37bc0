"""Name the routing mistake behind a mixture-of-experts block that disagrees with transformers' block.

Each known mistake is replayed on transformers' own sparse block for the layer, the very object the user's
block was judged against, never on a re-implementation: under a replay's context manager, calling the same
block computes the mistake, and leaving it restores the block bit for bit.  A replay changes one thing:
a setting the block reads (``norm_topk_prob``, ``routed_scaling_factor``, ``top_k``, GPT-OSS's ``limit`` and
``alpha``), a submodule's output (the shared expert zeroed, its gate held open), the experts' stored values
(two experts exchanged, halves of a fused gate/up interleaved), or a torch function called inside the router
or the experts (a ``TorchFunctionMode`` active only inside that module's forward: its softmax computed as a
sigmoid, its top-k taken before the softmax, its division by the top-k sum skipped, ``(up + 1)`` read as
``up``).  Which replays apply is read off the block itself: its attributes, buffers and submodules, and what
its router and experts call when run once on a probe input; never the family's name.

The replay whose output reproduces the user's block within the tolerance, and clearly closer than the
correct block does, names the mistake; where two replays reproduce it equally both are named.  Where none alone
does, two mistakes made at once (DeepSeek-V3's inference Gate scoring with a softmax also skips the renormalisation)
are replayed together, pairs of replays in distinct places of the block (``paired``), and named together.  Experts
exchanged are replayed pairwise among the experts the mismatching tokens use (every token routed only to
other experts matches), so a block of 256 experts replays a handful of pairs, not 32,640.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from parity.definitions.mistakes import MistakeId, together
from parity.engine.experts import interleave_rows, layout_misread

CLEARLY = 4.0  # a replay names the mistake when the block is at least this x farther from the correct block
MAX_PAIRWISE = 8  # blocks with at most this many experts replay every pair of them without evidence
MAX_SUSPECTS = 12  # at most this many suspect experts are replayed pairwise (66 pairs)
PROBE_TOKENS = 4  # what a router and its experts call is seen on a few tokens: k experts each, not every expert
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
DIVISIONS = {"__itruediv__", "__truediv__", "div", "div_", "true_divide"}
ADDITIONS = {"__add__", "__radd__", "add", "__iadd__", "add_"}


def stands_in(experts: nn.Module) -> bool:
    """Whether ``experts`` stands where a block's experts module is, computing the (token, expert) pairs the block
    asks for without holding every expert (engine.check.block_replay.ExpertsOnDemand: a block too large to hold),
    exchanging two experts under its own ``exchanged(first, second)`` and running each expert it builds under a
    replay's change under ``each(key, change)``: the replays inside an expert change each expert alone (``_within``),
    their settings read off its ``template`` (the experts module on the meta device; none: they are not replayed)."""
    return isinstance(experts, nn.Module) and callable(getattr(experts, "exchanged", None)) \
        and callable(getattr(experts, "each", None)) and isinstance(getattr(experts, "num_experts", None), int)


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


@dataclass(frozen=True)
class Replay:
    """One mistake: under ``apply()``, calling the block computes it; leaving restores the block."""

    id: MistakeId | str  # a catalogue id, or two made at once (``together``)
    detail: str
    apply: Callable[[], AbstractContextManager]
    experts: tuple[int, int] | None = None  # the pair an exchange swaps


@dataclass
class Parts:
    """Where a block's routing lives, found from its children and what they call."""

    block: nn.Module
    router: nn.Module
    experts: nn.Module
    num_experts: int
    top_k: int
    shared: list[nn.Module] = field(default_factory=list)
    shared_gate: nn.Linear | None = None
    router_calls: list[str] = field(default_factory=list)
    expert_calls: list[str] = field(default_factory=list)
    weights_at: int | None = None  # which of the router's outputs holds the routing weights

    @property
    def width(self) -> int:
        """The block's hidden size d, from the router's [E, d] weight."""
        return _router_weight(self.router).shape[1]


# -- torch functions, seen or rewritten inside one module's forward ---------------------------------------------

Rule = Callable[[Callable, tuple, dict], object]  # returns NotImplemented to let the call through


class _Rewrite(TorchFunctionMode):
    """Every torch call passes through, but those a rule rewrites (by the function's name); every name seen is
    recorded, with ``+1`` for an addition of the number 1, ``/sum`` for a division by a row sum and ``top-2/group``
    for the best two of each of several groups of experts (DeepSeek V3's group score)."""

    def __init__(self, rules: dict[str, Rule] | None = None, seen: list[str] | None = None):
        super().__init__()
        self.rules, self.seen = rules or {}, seen if seen is not None else []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        self.seen.append(name)
        if name in ADDITIONS and _adds_one(args):
            self.seen.append("+1")
        if name in DIVISIONS and _divides_by_row_sum(args):
            self.seen.append("/sum")
        if name == "topk" and _top_two_per_group(args, kwargs):
            self.seen.append("top-2/group")
        rule = self.rules.get(name)
        if rule is not None:
            out = rule(func, args, kwargs)
            if out is not NotImplemented:
                return out
        return func(*args, **kwargs)


def _adds_one(args: tuple) -> bool:
    return len(args) == 2 and isinstance(args[0], torch.Tensor) and not isinstance(args[1], torch.Tensor) \
        and isinstance(args[1], (int, float)) and args[1] == 1


def _top_two_per_group(args: tuple, kwargs: dict) -> bool:
    """``scores.view(tokens, groups, per_group).topk(2, dim=-1)``, more than one group: the group scores DeepSeek V3
    sums (its inference Gate without a selection bias takes each group's best alone)."""
    k = args[1] if len(args) > 1 else kwargs.get("k")
    scores = args[0] if args else None
    return isinstance(scores, torch.Tensor) and scores.dim() == 3 and scores.shape[1] > 1 and k == 2 \
        and kwargs.get("dim", args[2] if len(args) > 2 else -1) in (-1, 2)


def _divides_by_row_sum(args: tuple) -> bool:
    """``w / w.sum(-1, keepdim=True)`` (DeepSeek adds 1e-20): the top-k weights renormalised."""
    if len(args) != 2 or not all(isinstance(a, torch.Tensor) for a in args):
        return False
    weights, divisor = args
    if weights.dim() != divisor.dim() or divisor.shape[-1] != 1 or weights.shape[-1] < 2:
        return False
    return bool(torch.allclose(divisor.double(), weights.double().sum(-1, keepdim=True), rtol=1e-6, atol=1e-12))


@contextmanager
def _forward_replaced(module: nn.Module, wrap: Callable[[Callable], Callable]) -> Iterator[None]:
    """``module.forward`` replaced by ``wrap(forward)`` for the block's next calls; the instance's own
    attribute (if it had one) put back after."""
    had, old = "forward" in module.__dict__, module.__dict__.get("forward")
    module.forward = wrap(module.forward)
    try:
        yield
    finally:
        if had:
            module.forward = old
        else:
            del module.forward


def _inside(module: nn.Module, rules: dict[str, Callable[[], Rule]] | Callable[[], dict[str, Rule]],
            seen: list[str] | None = None) -> AbstractContextManager:
    """Calls of ``module`` run under a fresh ``_Rewrite`` (fresh rules per call: rules may keep state)."""
    def wrap(forward: Callable) -> Callable:
        def rewritten(*args, **kwargs):
            with _Rewrite(rules() if callable(rules) else rules, seen):
                return forward(*args, **kwargs)
        return rewritten
    return _forward_replaced(module, wrap)


@contextmanager
def _setting(module: nn.Module, name: str, value) -> Iterator[None]:
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


@contextmanager
def _values(tensor: torch.Tensor, new: torch.Tensor) -> Iterator[None]:
    """``tensor`` holds ``new`` in place (the block's own parameter object), its values put back after."""
    saved = tensor.detach().clone()
    with torch.no_grad():
        tensor.copy_(new)
    try:
        yield
    finally:
        with torch.no_grad():
            tensor.copy_(saved)


# -- the block's parts, found from the block ----------------------------------------------------------------------

def find_parts(block: nn.Module) -> Parts | None:
    """The router (a child with an int ``top_k`` and an [E, d] ``weight``), the experts (a child with an int
    ``num_experts`` holding 3-D parameters), a shared expert's gate (a Linear to one output) and the shared
    experts (every other child with parameters); None when the block has no router or no experts.  The block is
    run once on a probe input to see what its router and experts call."""
    children = dict(block.named_children())
    router = next((c for c in children.values() if isinstance(getattr(c, "top_k", None), int)
                   and _router_weight(c) is not None), None)
    experts = next((c for c in children.values() if c is not router
                    and isinstance(getattr(c, "num_experts", None), int)
                    and (stands_in(c) or any(p.dim() == 3 for p in c.parameters(recurse=False)))),
                   None)
    if router is None or experts is None:
        return None
    gate = next((c for c in children.values() if isinstance(c, nn.Linear) and c is not router
                 and c.out_features == 1), None)
    shared = [c for c in children.values() if all(c is not m for m in (router, experts, gate))
              and next(c.parameters(), None) is not None]
    parts = Parts(block, router, experts, experts.num_experts, router.top_k, shared, gate)
    _probe(parts)
    return parts


def _router_weight(router: nn.Module) -> torch.Tensor | None:
    """The router's [E, d] weight: its own (a Linear, or a parameter named weight), or its one Linear's
    (HunYuan's gate.wg)."""
    weight = getattr(router, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return weight
    linears = [c for c in router.children() if isinstance(c, nn.Linear)]
    return linears[0].weight if len(linears) == 1 else None


def _probe(parts: Parts) -> None:
    """Run the block once on seeded values: what its router and experts call, which router output holds the
    routing weights."""
    param = next(parts.experts.parameters(), None)
    param = _router_weight(parts.router) if param is None else param  # a stand-in holds no expert
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, PROBE_TOKENS, parts.width, generator=generator, dtype=torch.float64)
    captured: list = []
    hook = parts.router.register_forward_hook(lambda module, args, out: captured.append(out))
    try:
        # a stand-in's own bookkeeping is not the experts' computation: the calls are seen inside each expert it builds
        seeing = parts.experts.each(None, lambda expert: _inside(expert, {}, parts.expert_calls)) \
            if stands_in(parts.experts) else _inside(parts.experts, {}, parts.expert_calls)
        with torch.no_grad(), _inside(parts.router, {}, parts.router_calls), seeing:
            parts.block(x.to(device=param.device, dtype=param.dtype))
    finally:
        hook.remove()
    parts.weights_at = _weights_position(captured[0], parts.top_k) if captured else None


def _outputs(out) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _weights_position(out, top_k: int) -> int | None:
    """The router output holding the routing weights: floating, non-negative, at most top_k nonzero per row
    (logits have a value for every expert)."""
    for at, value in enumerate(_outputs(out)):
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() == 2 \
                and bool((value >= 0).all()) and int((value != 0).sum(-1).max()) <= top_k:
            return at
    return None


def _routing_mask(out, parts: Parts) -> torch.Tensor | None:
    """[tokens, experts]: which experts each token was routed to, from the router's output."""
    values = _outputs(out)
    index = next((v for v in values if isinstance(v, torch.Tensor) and not v.is_floating_point()
                  and v.dim() == 2), None)
    if index is not None:
        mask = torch.zeros(index.shape[0], parts.num_experts + 1, dtype=torch.bool, device=index.device)
        return mask.scatter_(1, index.clamp(0, parts.num_experts), True)[:, :parts.num_experts].cpu()
    if parts.weights_at is not None and values[parts.weights_at].shape[-1] == parts.num_experts:
        return (values[parts.weights_at] != 0).cpu()
    return None


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
    return args[0] if _divides_by_row_sum(args) else NotImplemented


def _one_dropped(func, args, kwargs):
    return args[0] if _adds_one(args) else NotImplemented


def _best_of_group(func, args, kwargs):
    """A group's score its best expert's where the block sums its best two: the second of each group's top-2 read
    as 0."""
    if not _top_two_per_group(args, kwargs):
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

def _replaced_output(module: nn.Module, change: Callable) -> AbstractContextManager:
    """``module``'s output passed through ``change(output, *args)``."""
    def wrap(forward):
        return lambda *args, **kwargs: change(forward(*args, **kwargs), *args)
    return _forward_replaced(module, wrap)


def _renormalised(at: int) -> Callable:
    def change(out, *args):
        values = _outputs(out)
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
        values = _outputs(out)
        kept["scores"] = scores = values[parts.weights_at]
        values[parts.weights_at] = (scores != 0).to(scores.dtype)
        return tuple(values)

    def scaled(out, *args):
        scores = kept["scores"].transpose(0, 1).unsqueeze(-1).to(out.dtype)
        return (out.reshape(parts.num_experts, -1, out.shape[-1]) * scores).reshape(out.shape)

    with _replaced_output(parts.router, chosen), _replaced_output(parts.experts, scaled):
        yield


def _gated_by(gate: nn.Module) -> Callable:
    return lambda out, hidden, *args: out * torch.sigmoid(gate(hidden)).to(out.dtype)


@contextmanager
def _settings(pairs: list[tuple[nn.Module, str, object]]) -> Iterator[None]:
    with ExitStack() as stack:
        for module, name, value in pairs:
            stack.enter_context(_setting(module, name, value))
        yield


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
        stack.enter_context(_values(experts.gate_up_proj, moved(experts.gate_up_proj, axis)))
        bias = getattr(experts, "gate_up_proj_bias", None)
        if isinstance(bias, torch.Tensor):
            stack.enter_context(_values(bias, moved(bias, -1)))
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
            stack.enter_context(_values(tensor, tensor.detach()[order]))
        yield


# -- the replays that apply to a block ----------------------------------------------------------------------------

def _scoring(parts: Parts) -> list[Replay]:
    """The score function swapped, and the top-k moved to the other side of the softmax."""
    calls, router = parts.router_calls, parts.router
    score = next((name for name in calls if name in ("softmax", "sigmoid")), None)
    found = []
    if score == "softmax":
        found.append(Replay(MistakeId.ROUTER_SIGMOID_INSTEAD_OF_SOFTMAX, "the router's softmax computed as a sigmoid",
                            lambda: _inside(router, {"softmax": _as_sigmoid})))
    elif score == "sigmoid":
        found.append(Replay(MistakeId.ROUTER_SOFTMAX_INSTEAD_OF_SIGMOID, "the router's sigmoid computed as a softmax "
                            "over its input", lambda: _inside(router, {"sigmoid": _as_softmax})))
        if "topk" in calls and calls.index("topk") < calls.index("sigmoid") and "linear" in calls:
            found.append(Replay(MistakeId.ROUTER_SOFTMAX_INSTEAD_OF_SIGMOID, "a softmax over every expert's logit, "
                                "the chosen kept", lambda: _inside(router, _softmax_of_every_logit)))
    if "softmax" in calls and "topk" in calls:
        if calls.index("softmax") < calls.index("topk"):
            found.append(Replay(MistakeId.ROUTER_TOPK_BEFORE_SOFTMAX, "top-k of the logits, softmax over the k",
                                lambda: _inside(router, {"softmax": _passed, "topk": _topk_then_softmax})))
        else:
            found.append(Replay(MistakeId.ROUTER_SOFTMAX_BEFORE_TOPK, "softmax over every expert, top-k of it",
                                lambda: _inside(router, {"topk": _softmax_then_topk, "softmax": _passed})))
    return found


def _renormalisation(parts: Parts) -> list[Replay]:
    """The top-k weights' renormalisation dropped where the block has it, added where it has not."""
    router, calls = parts.router, parts.router_calls
    setting = getattr(router, "norm_topk_prob", None)
    if isinstance(setting, bool):
        mistake = MistakeId.ROUTER_RENORMALIZATION_MISSING if setting else MistakeId.ROUTER_RENORMALIZATION_ADDED
        return [Replay(mistake, f"norm_topk_prob = {not setting}",
                       lambda: _setting(router, "norm_topk_prob", not setting))]
    if "/sum" in calls:
        return [Replay(MistakeId.ROUTER_RENORMALIZATION_MISSING, "the router's division by the top-k sum skipped",
                       lambda: _inside(router, dict.fromkeys(DIVISIONS, _undivided)))]
    softmax_of_k = "topk" in calls and "softmax" in calls[calls.index("topk"):]  # its weights already sum to 1
    if parts.weights_at is None or softmax_of_k:
        return []
    return [Replay(MistakeId.ROUTER_RENORMALIZATION_ADDED, "the router's weights divided by their sum",
                   lambda: _replaced_output(router, _renormalised(parts.weights_at)))]


def _router_settings(parts: Parts) -> list[Replay]:
    """routed_scaling_factor set to 1; the selection bias buffer added to the weights the router gathers."""
    found = []
    scaled = next((m for m in parts.block.modules() if isinstance(getattr(m, "routed_scaling_factor", None),
                                                                  (int, float)) and m.routed_scaling_factor != 1), None)
    if scaled is not None:
        found.append(Replay(MistakeId.ROUTED_SCALING_DROPPED, f"routed_scaling_factor {scaled.routed_scaling_factor} "
                            "-> 1", lambda: _setting(scaled, "routed_scaling_factor", 1.0)))
    bias = selection_bias(parts)
    if bias is not None and "gather" in parts.router_calls:
        found.append(Replay(MistakeId.SELECTION_BIAS_IN_WEIGHTS, f"{bias[0]} added to the weights",
                            lambda: _inside(parts.router, {"gather": _biased(bias[1])})))
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
                    lambda: _values(values, torch.zeros_like(values)))]
    if "top-2/group" in parts.router_calls:
        found.append(Replay(MistakeId.SELECTION_BIAS_MISSING, f"{name} left out of the choice and each group scored "
                            "by its best expert (DeepSeek-V3's inference Gate without a bias)",
                            lambda: _together(lambda: _values(values, torch.zeros_like(values)),
                                              lambda: _inside(parts.router, {"topk": _best_of_group}))))
    return found


@contextmanager
def _together(*applies: Callable[[], AbstractContextManager]) -> Iterator[None]:
    """Changes made at once, undone in the reverse order."""
    with ExitStack() as stack:
        for apply in applies:
            stack.enter_context(apply())
        yield


def _placement(parts: Parts) -> list[Replay]:
    """The router score moved to the other side of the experts: experts called with the weights scale their
    output (the mistake scales their input), experts called with the input alone get it scaled (the mistake
    scales their output)."""
    taken = len(inspect.signature(parts.experts.forward).parameters)
    if stands_in(parts.experts):  # called as the experts module it stands for is
        taken = 3 if getattr(parts.experts, "routed", True) else 1
    if taken >= 3:
        return [Replay(MistakeId.ROUTER_SCORE_ON_INPUT, "each expert run on its input times the routing weight",
                       lambda: _forward_replaced(parts.experts, _scores_on_input))]
    if taken == 1 and parts.weights_at is not None:
        return [Replay(MistakeId.ROUTER_SCORE_ON_OUTPUT, "each expert's output times the router score",
                       lambda: _scores_on_output(parts))]
    return []


def _shared(parts: Parts) -> list[Replay]:
    """Each shared expert zeroed; its gate held open (sigmoid(inf) = 1), or multiplying the routed sum too."""
    names = {id(m): name for name, m in parts.block.named_children()}
    found = [Replay(MistakeId.SHARED_EXPERT_MISSING, f"{names[id(m)]} left out",
                    lambda m=m: _replaced_output(m, lambda out, *args: torch.zeros_like(out))) for m in parts.shared]
    gate = parts.shared_gate
    if gate is not None and parts.shared:
        name = names[id(gate)]
        found += [Replay(MistakeId.SHARED_EXPERT_GATE_MISSING, f"{name} not applied",
                         lambda: _replaced_output(gate, lambda out, *args: torch.full_like(out, float("inf")))),
                  Replay(MistakeId.SHARED_EXPERT_GATE_AFTER_SUM, f"sigmoid({name}) applied to the routed experts too",
                         lambda: _replaced_output(parts.experts, _gated_by(gate)))]
    return found


def _top_k(parts: Parts) -> list[Replay]:
    holders = [m for m in (parts.router, parts.block) if getattr(m, "top_k", None) == parts.top_k]
    return [Replay(MistakeId.ROUTER_WRONG_TOP_K, f"top-{k} instead of top-{parts.top_k}",
                   lambda k=k: _settings([(m, "top_k", k) for m in holders]))
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
                         _within(parts, f"limit {to}", lambda module, to=to: _setting(module, "limit", to)))
                  for to in (float("inf"), 0.0)]  # no clamp, or a limit read as 0
    if isinstance(alpha, (int, float)) and alpha != 1:
        found.append(Replay(MistakeId.SWIGLU_ALPHA_MISSING, f"alpha {alpha} -> 1",
                            _within(parts, "alpha 1", lambda module: _setting(module, "alpha", 1.0))))
    if "+1" in parts.expert_calls:
        found.append(Replay(MistakeId.SWIGLU_UP_PLUS_ONE_MISSING, "(up + 1) computed as up",
                            _within(parts, "up + 1", lambda module: _inside(module, dict.fromkeys(ADDITIONS,
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


def _replays(parts: Parts, exchanged: Iterable[tuple[int, int]] | None) -> list[Replay]:
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
    return [Replay(together(a.id, b.id), f"{a.detail}, with {b.detail}", functools.partial(_together, a.apply, b.apply))
            for a, b in itertools.combinations(placed, 2) if PLACE[a.id] != PLACE[b.id]]


def replays(block: nn.Module, *, exchanged: Iterable[tuple[int, int]] | None = None) -> list[Replay]:
    """The routing mistakes that apply to ``block`` (transformers' sparse MoE block), each a Replay to call the
    same block under.  ``exchanged``: the pairs of experts to replay exchanged (default: every pair when the
    block has at most MAX_PAIRWISE experts; name_mistake finds the pairs from the evidence)."""
    parts = find_parts(block)
    return [] if parts is None else _replays(parts, exchanged)


# -- naming the mistake -------------------------------------------------------------------------------------------

def _flat(out, width: int) -> torch.Tensor:
    """A block's hidden output as [tokens, d] in float64 on the CPU (GPT-OSS and Llama 4 return a tuple; Llama 4
    flattens the tokens)."""
    hidden = _outputs(out)[0]
    return hidden.detach().reshape(-1, width).cpu().double()


def _reference(parts: Parts, x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The correct block's output, and which experts it routed each token to."""
    captured: list = []
    hook = parts.router.register_forward_hook(lambda module, args, out: captured.append(out))
    try:
        out = _flat(parts.block(x), width)
    finally:
        hook.remove()
    return out, (_routing_mask(captured[-1], parts) if captured else None)


def suspect_pairs(uses: torch.Tensor | None, wrong: torch.Tensor,
                  judged: torch.Tensor) -> list[tuple[int, int]] | None:
    """Pairs among the experts only mismatching tokens use (and experts no token uses): a token routed to
    neither of two exchanged experts comes out right.  None: no evidence narrows it (replay the default)."""
    if uses is None or not bool(wrong.any()):
        return None
    clean = uses[judged & ~wrong].any(0)
    suspects = ((uses[wrong].any(0) & ~clean) | ~uses.any(0)).nonzero().flatten().tolist()
    if not 2 <= len(suspects) <= MAX_SUSPECTS:
        return None
    return list(itertools.combinations(suspects, 2))


def _distance(block: nn.Module, replay: Replay, x: torch.Tensor, got: torch.Tensor, width: int,
              judged: torch.Tensor) -> float | None:
    """How far ``got`` is from the block run under ``replay``, over the judged tokens."""
    try:
        with replay.apply():
            out = _flat(block(x), width)
    except Exception:  # noqa: BLE001 - a replay the block cannot run (a top-k its router refuses) is not the mistake
        return None
    distance = (out - got)[judged].abs().max()
    return float(distance) if bool(torch.isfinite(distance)) else None


def name_mistake(block: nn.Module, x: torch.Tensor, got: torch.Tensor | tuple, *, tolerance: float,
                 tokens: torch.Tensor | None = None) -> list[tuple[MistakeId, str]]:
    """The routing mistakes whose replay on ``block`` (transformers' block for the layer, filled with its tensors)
    reproduces ``got``, the user's block's output on ``x``, each with its evidence in words (``replay_fits``)."""
    name = type(block).__name__
    return [(mistake, f"{detail}: the block's output is {distance:.3g} from this replay and {reference:.3g} from "
             f"transformers' {name} (tolerance {tolerance:.3g})")
            for mistake, detail, distance, reference in replay_fits(block, x, got, tolerance=tolerance, tokens=tokens)]


def replay_fits(block: nn.Module, x: torch.Tensor, got: torch.Tensor | tuple, *, tolerance: float,
                tokens: torch.Tensor | None = None, exchanged: Iterable[tuple[int, int]] | None = None
                ) -> list[tuple[MistakeId | str, str, float, float]]:
    """(id, what the replay changes, the output's distance from the replay, its distance from the correct block) of
    each replay reproducing ``got`` (``replay_search``'s ``fits``)."""
    return replay_search(block, x, got, tolerance=tolerance, tokens=tokens, exchanged=exchanged).fits


@dataclass
class Search:
    """What naming a block's mistake replayed and found."""

    fits: list[tuple[MistakeId | str, str, float, float]] = field(default_factory=list)
    tried: list[str] = field(default_factory=list)  # the ids replayed alone, each once, in order
    pairs: int = 0  # the pairs of mistakes replayed together (none where one alone fits)
    stopped: str = ""  # why some pairs were not replayed

    def untold(self) -> str:
        """What was replayed, for a failure none of it explains."""
        if not self.tried:
            return ""
        pairs = f"; {self.pairs} pairs of them in distinct places of the block, together" if self.pairs else ""
        return f"replayed alone: {', '.join(self.tried)}{pairs}{'; ' + self.stopped if self.stopped else ''}"


def replay_search(block: nn.Module, x: torch.Tensor, got: torch.Tensor | tuple, *, tolerance: float,
                  tokens: torch.Tensor | None = None, exchanged: Iterable[tuple[int, int]] | None = None) -> Search:
    """The replays reproducing ``got``: within ``tolerance`` (max abs) and at least CLEARLY times closer than the
    correct block is.  Closest first; those that fit equally (within CLEARLY of the closest, or all within tolerance /
    CLEARLY) are all returned.  Where no replay alone fits, two made at once (``paired``) are replayed, and those that
    fit named together; on a stand-in for the experts (``stands_in``) the pairs stop once they have built as many
    experts as the replays alone did.  No fits when the block agrees, no replay fits, or ``got`` is not the block's
    shape.  ``tokens``: a bool mask over the flattened tokens, the ones judged (near-tied tokens, whose choice of
    experts may flip legitimately, set aside).  ``exchanged``: the pairs of experts to replay exchanged, found from
    more tokens than ``x`` holds (default: ``suspect_pairs`` on ``x``'s own evidence)."""
    parts = find_parts(block)
    if parts is None:
        return Search()
    width, got = parts.width, _outputs(got)[0]  # a block may return (hidden, router_logits)
    got = _flat(got, width) if isinstance(got, torch.Tensor) and got.numel() == x.numel() else None
    if got is None:
        return Search()
    stand_in = parts.experts if stands_in(parts.experts) else None
    with torch.no_grad():
        reference, uses = _reference(parts, x, width)
        judged = torch.ones(len(got), dtype=torch.bool) if tokens is None else tokens.reshape(-1).cpu()
        got = torch.where(judged[:, None], got, reference)  # a token set aside counts as agreeing
        wrong = (reference - got).abs().amax(-1) > tolerance
        reference_distance = float((reference - got).abs().max())
        if not reference_distance > tolerance:
            return Search()
        pairs = suspect_pairs(uses, wrong, judged) if exchanged is None else exchanged
        singles = _replays(parts, pairs)
        search = Search(tried=list(dict.fromkeys(str(replay.id) for replay in singles)))
        reads = getattr(stand_in, "reads", 0)
        fits = _fitting(block, singles, x, got, width, judged, tolerance, reference_distance)
        if not fits:
            budget = getattr(stand_in, "reads", 0) - reads  # the experts the replays alone built
            reads += budget
            together = paired(singles)
            if stand_in is not None:  # each such pair runs the experts on new inputs: every expert chosen built again
                costly = [r for r in together if MistakeId.ROUTER_SCORE_ON_INPUT in str(r.id).split(" + ")]
                together = [r for r in together if r not in costly]
                if costly:
                    search.stopped = (f"the {len(costly)} pairs with {MistakeId.ROUTER_SCORE_ON_INPUT} not replayed "
                                      "around experts read on demand: each would build every expert it chooses again")
            for done, replay in enumerate(together):
                if stand_in is not None and stand_in.reads - reads > budget:
                    search.stopped = "; ".join(filter(None, [search.stopped, (
                        f"the other {len(together) - done} pairs not replayed: those replayed had built as many "
                        f"experts as the replays alone ({budget})")]))
                    break
                search.pairs += 1
                fits += _fitting(block, [replay], x, got, width, judged, tolerance, reference_distance, order=done)
    # replays that compute the same function (top-k before the softmax, and renormalising after it) land within float
    # noise of each other in either order: at or below tolerance / CLEARLY they are one distance, so the first named
    # is the same on every layer and seed instead of whichever rounding favoured
    fits.sort(key=lambda fit: (max(fit[0], tolerance / CLEARLY), fit[1]))
    bound = max(min(distance for distance, _, _ in fits) * CLEARLY, tolerance / CLEARLY) if fits else 0.0
    search.fits = [(replay.id, replay.detail, distance, reference_distance)
                   for distance, _, replay in fits if distance <= bound]
    return search


def _fitting(block: nn.Module, replays: list[Replay], x: torch.Tensor, got: torch.Tensor, width: int,
             judged: torch.Tensor, tolerance: float, reference_distance: float, *, order: int = 0
             ) -> list[tuple[float, int, Replay]]:
    """(distance, order, replay) of each of ``replays`` within ``tolerance`` of ``got`` and CLEARLY closer than the
    correct block."""
    fits = []
    for at, replay in enumerate(replays, start=order):
        distance = _distance(block, replay, x, got, width, judged)
        if distance is not None and distance <= tolerance and distance * CLEARLY <= reference_distance:
            fits.append((distance, at, replay))
    return fits
