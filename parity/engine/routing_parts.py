"""Where a mixture-of-experts block's routing lives: its router, experts, shared experts and shared-expert gate,
found from the block's children and from what its router and experts call when run once on a probe input, never
from the family's name (engine.routing_replays builds the replays that apply from them)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from parity.engine.module_rewrites import inside

PROBE_TOKENS = 4  # what a router and its experts call is seen on a few tokens: k experts each, not every expert


def stands_in(experts: nn.Module) -> bool:
    """Whether ``experts`` stands where a block's experts module is, computing the (token, expert) pairs the block
    asks for without holding every expert (engine.check.block_replay.ExpertsOnDemand: a block too large to hold),
    exchanging two experts under its own ``exchanged(first, second)`` and running each expert it builds under a
    replay's change under ``each(key, change)``: the replays inside an expert change each expert alone
    (``routing_replays._within``), their settings read off its ``template`` (the experts module on the meta device;
    none: they are not replayed)."""
    return isinstance(experts, nn.Module) and callable(getattr(experts, "exchanged", None)) \
        and callable(getattr(experts, "each", None)) and isinstance(getattr(experts, "num_experts", None), int)


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
        return router_weight(self.router).shape[1]


# -- torch functions, seen or rewritten inside one module's forward ---------------------------------------------


def find_parts(block: nn.Module) -> Parts | None:
    """The router (a child with an int ``top_k`` and an [E, d] ``weight``), the experts (a child with an int
    ``num_experts`` holding 3-D parameters), a shared expert's gate (a Linear to one output) and the shared
    experts (every other child with parameters); None when the block has no router or no experts.  The block is
    run once on a probe input to see what its router and experts call."""
    children = dict(block.named_children())
    router = next((c for c in children.values() if isinstance(getattr(c, "top_k", None), int)
                   and router_weight(c) is not None), None)
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


def router_weight(router: nn.Module) -> torch.Tensor | None:
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
    param = router_weight(parts.router) if param is None else param  # a stand-in holds no expert
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, PROBE_TOKENS, parts.width, generator=generator, dtype=torch.float64)
    captured: list = []
    hook = parts.router.register_forward_hook(lambda module, args, out: captured.append(out))
    try:
        # a stand-in's own bookkeeping is not the experts' computation: the calls are seen inside each expert it builds
        seeing = parts.experts.each(None, lambda expert: inside(expert, {}, parts.expert_calls)) \
            if stands_in(parts.experts) else inside(parts.experts, {}, parts.expert_calls)
        with torch.no_grad(), inside(parts.router, {}, parts.router_calls), seeing:
            parts.block(x.to(device=param.device, dtype=param.dtype))
    finally:
        hook.remove()
    parts.weights_at = _weights_position(captured[0], parts.top_k) if captured else None


def outputs(out) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _weights_position(out, top_k: int) -> int | None:
    """The router output holding the routing weights: floating, non-negative, at most top_k nonzero per row
    (logits have a value for every expert)."""
    for at, value in enumerate(outputs(out)):
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() == 2 \
                and bool((value >= 0).all()) and int((value != 0).sum(-1).max()) <= top_k:
            return at
    return None


def routing_mask(out, parts: Parts) -> torch.Tensor | None:
    """[tokens, experts]: which experts each token was routed to, from the router's output."""
    values = outputs(out)
    index = next((v for v in values if isinstance(v, torch.Tensor) and not v.is_floating_point()
                  and v.dim() == 2), None)
    if index is not None:
        mask = torch.zeros(index.shape[0], parts.num_experts + 1, dtype=torch.bool, device=index.device)
        return mask.scatter_(1, index.clamp(0, parts.num_experts), True)[:, :parts.num_experts].cpu()
    if parts.weights_at is not None and values[parts.weights_at].shape[-1] == parts.num_experts:
        return (values[parts.weights_at] != 0).cpu()
    return None


# -- the rules a replay rewrites a torch call by ------------------------------------------------------------------
