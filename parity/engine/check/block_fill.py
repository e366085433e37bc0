"""Filling a user's whole MoE block with a layer's tensors, under whichever names its port uses.

A port of a sparse block holds the router, the experts and the shared experts under names of its own.  Three
spellings of the same tensors are offered, each exact: transformers' own block (``gate.weight``,
``experts.gate_up_proj``, ``shared_expert.up_proj.weight``), the checkpoint's names relative to the block
(``block_sparse_moe.experts.3.w1.weight`` -> ``experts.3.w1.weight``), and one module per expert whose projections
carry a role name from aliases.toml (``experts.3.gate_proj.weight``, ``experts.3.w3.weight``).  A parameter none of
them names is the router (the block's one [E, d] matrix) or its bias only where exactly one tensor of that shape
exists; anything else is an error listing what the port holds and what the layer offers.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from parity.errors import MappingError, ShapeMismatchError

_EXPERT = re.compile(r"(?:^|\.)(\d+)\.(.+)$")  # '...experts.3.w1.weight' -> ('3', 'w1.weight')


def fill_block(module: nn.Module, spellings: dict[str, dict[str, torch.Tensor]],
               experts: Callable[[int], dict[str, torch.Tensor]], count: int, where: str) -> dict[str, str]:
    """Copy into every parameter and persistent buffer of ``module`` its tensor; returns target name -> where it came
    from.  ``spellings``: label -> {name: tensor} (transformers' names first); ``experts(e)``: expert e's gate, up,
    down (and biases), [out, in]."""
    from parity.definitions.aliases import load_aliases

    aliases = load_aliases()
    state = module.state_dict()
    offered = dict(spellings)
    whole = next((label for label, names in offered.items() if set(state) <= set(names)), None)
    sources: dict[str, str] = {}
    values: dict[str, torch.Tensor] = {}
    by_suffix: dict[str, str] = {}  # parameter -> its tensor, where only the names' last parts matched
    for name in state:
        if whole is not None:
            values[name], sources[name] = offered[whole][name], name
            continue
        found = _by_name(name, offered) or _by_role(name, aliases, experts, count, offered) \
            or _stacked(name, state[name], aliases, experts, count) or _fused(name, state[name], aliases, offered)
        if found is None and (suffixed := _by_suffix(name, state[name], offered)) is not None:
            # a name read off its last parts alone claims no tensor another parameter claims so too (a router's
            # 'router.gate.weight' and a shared expert's 'common.gate.weight' both end in transformers' 'gate.weight')
            rival = next((other for other, source in by_suffix.items() if source == suffixed[1]), None)
            if rival is not None:
                raise MappingError(_unfilled(name, state, offered, where))
            found, by_suffix[name] = suffixed, suffixed[1]
        found = found or _by_shape(name, state[name], offered) or _absent_bias(name, state[name], count, offered)
        if found is None:
            raise MappingError(_unfilled(name, state, offered, where))
        values[name], sources[name] = found
    with torch.no_grad():
        for name, target in state.items():
            value = values[name]
            if tuple(value.shape) != tuple(target.shape):
                raise ShapeMismatchError(f"{where}: parameter '{name}' is {list(target.shape)}, but its tensor "
                                         f"({sources[name]}) is {list(value.shape)}")
            target.copy_(value.to(target.dtype))
    return sources


def _by_name(name: str, offered: dict[str, dict[str, torch.Tensor]]) -> tuple[torch.Tensor, str] | None:
    for names in offered.values():
        if name in names:
            return names[name], name
    return None


EXPERT_ROLES = ("gate", "up", "down")  # what an expert holds: a name that may also be a classic FFN's is read so


def _expert_role(name: str, aliases: Any) -> tuple[str, str] | None:
    """(role, "weight" | "bias") of an expert's projection named ``name``, among an expert's roles only (``w1`` is a
    gate here, never a classic FFN's fc_in); None unless exactly one."""
    roles = {(role, kind) for role, kind in aliases.roles_of(name) if role in EXPERT_ROLES}
    return next(iter(roles)) if len(roles) == 1 else None


def _by_role(name: str, aliases: Any, experts: Callable[[int], dict[str, torch.Tensor]], count: int,
             offered: dict[str, dict[str, torch.Tensor]]) -> tuple[torch.Tensor, str] | None:
    """An expert's projection (``experts.3.w1.weight``: expert 3's gate) or a shared expert's, by its role name."""
    match = _EXPERT.search(name)
    if match is not None and int(match.group(1)) < count and "shared" not in name:
        found = _expert_role(match.group(2), aliases)
        if found is not None:
            key = found[0] if found[1] == "weight" else f"{found[0]}_bias"
            tensors = experts(int(match.group(1)))
            if key in tensors:
                return tensors[key], f"expert {match.group(1)}'s {key}"
    if "shared" in name:
        role = _expert_role(name, aliases)
        names = offered[next(iter(offered))]
        found = [n for n in names if "shared" in n and role is not None and _expert_role(n, aliases) == role]
        if len(found) == 1:
            return names[found[0]], f"transformers: {found[0]}"
    return None


def _stacked(name: str, target: torch.Tensor, aliases: Any, experts: Callable[[int], dict[str, torch.Tensor]],
             count: int) -> tuple[torch.Tensor, str] | None:
    """Every expert's projection of one role stacked in one parameter ([E, out, in], or [E, in, out] for a module
    computing x @ W: MLX's switch_mlp.gate_proj, a port's experts.w1), told apart by shape alone; None where the shape
    fits both (a square projection).  One that fits neither is still that role's stack, held at a width or model size
    other than the layer's: returned as stored, so the copy fails as a shape mismatch (the block's own sizes are
    wrong, a verdict) instead of as a name parity cannot route."""
    if target.dim() not in (2, 3) or target.shape[0] != count or "shared" in name:
        return None
    found = _expert_role(name, aliases)
    if found is None:
        return None
    key = found[0] if found[1] == "weight" else f"{found[0]}_bias"
    first = experts(0).get(key)
    if first is None or first.dim() != target.dim() - 1:
        return None
    if first.dim() == 1:  # every expert's bias of one role, [E, out] (gpt-oss's mlp2_bias)
        return (torch.stack([experts(e)[key] for e in range(count)]), f"every expert's {key}") \
            if tuple(target.shape[1:]) == tuple(first.shape) else None
    as_stored, transposed = tuple(target.shape[1:]) == tuple(first.shape), tuple(target.shape[1:]) == first.shape[::-1]
    if as_stored and transposed:
        return None
    if not as_stored and not transposed:  # named for the role, sized otherwise: the block's width, said as a mismatch
        return torch.stack([experts(e)[key] for e in range(count)]), f"every expert's {key}"
    stack = torch.stack([experts(e)[key] if as_stored else experts(e)[key].t() for e in range(count)])
    return stack, f"every expert's {key}" + ("" if as_stored else " (transposed: x @ W)")


def _fused(name: str, target: torch.Tensor, aliases: Any, offered: dict[str, dict[str, torch.Tensor]]
           ) -> tuple[torch.Tensor, str] | None:
    """Every expert's gate and up fused in one stacked parameter under a name of its own (a port's ``experts.w13``
    [E, 2I, d]): transformers' own fused stack, in the layout the layer holds it (halves, or interleaved
    rows), transposed where the parameter's shape says x @ W; None where the shape fits neither or both."""
    kind = "weight" if target.dim() == 3 else "bias"  # a bias [E, 2I] laid out as the weight is (gpt-oss's mlp1_bias)
    if target.dim() not in (2, 3) or "shared" in name or ("gate_up", kind) not in aliases.roles_of(name):
        return None
    names = offered[next(iter(offered))]
    found = [n for n in names if n.startswith("experts.") and names[n].dim() == target.dim()
             and ("gate_up", kind) in aliases.roles_of(n)]
    if len(found) != 1:
        return None
    stack, source = names[found[0]], f"transformers: {found[0]}"
    if kind == "bias":
        return (stack, source) if tuple(stack.shape) == tuple(target.shape) else None
    as_held = tuple(stack.shape) == tuple(target.shape)
    if as_held == (tuple(stack.transpose(1, 2).shape) == tuple(target.shape)):
        return None
    return (stack, source) if as_held else (stack.transpose(1, 2), f"{source} (transposed)")


def _by_suffix(name: str, target: torch.Tensor, offered: dict[str, dict[str, torch.Tensor]]
               ) -> tuple[torch.Tensor, str] | None:
    """A tensor whose name and the parameter's differ only by the modules above them (a port holding the experts'
    ``gate_up_proj`` on the block itself, where transformers holds it under ``experts.``): one name ending in the
    other at a dot, of the parameter's shape, and the only such name (else another rule, or the error, decides)."""
    found = {n: (names[n], label) for label, names in reversed(offered.items()) for n in names
             if (n.endswith("." + name) or name.endswith("." + n)) and tuple(names[n].shape) == tuple(target.shape)}
    if len(found) != 1:
        return None
    (match, (tensor, label)), = found.items()
    return tensor, f"{label}: {match}"


def _by_shape(name: str, target: torch.Tensor, offered: dict[str, dict[str, torch.Tensor]]
              ) -> tuple[torch.Tensor, str] | None:
    """The router's weight or bias, the shared experts' gate: the one tensor outside the experts of its shape; else,
    where none has it, the one of its shape transposed (a router held [d, E] for ``x @ W``: Meta's Llama 4
    ``router_DE``)."""
    names = offered[next(iter(offered))]
    outside = [n for n in names if not n.startswith("experts.")]
    found = [n for n in outside if tuple(names[n].shape) == tuple(target.shape)]
    if found or target.dim() != 2 or target.shape[0] == target.shape[1]:
        return (names[found[0]], f"transformers: {found[0]} (the one tensor of shape {list(target.shape)})") \
            if len(found) == 1 else None
    found = [n for n in outside if names[n].dim() == 2 and tuple(names[n].shape) == tuple(target.shape)[::-1]]
    return (names[found[0]].t(), f"transformers: {found[0]} (transposed: the one tensor of shape "
                                 f"{list(target.shape)[::-1]}, used as x @ W)") if len(found) == 1 else None


def _absent_bias(name: str, target: torch.Tensor, count: int, offered: dict[str, dict[str, torch.Tensor]]
                 ) -> tuple[torch.Tensor, str] | None:
    """A per-expert bias, [E], in a block whose layer holds no per-expert vector outside its experts: zero, the value
    transformers' block computes with.  torchtitan's MoE registers its selection bias (``expert_bias``) for every
    family, Qwen3-MoE's and Llama 4's included, and their checkpoints hold none (its own loaders leave it zero).  Only
    an additive bias, by its name: zero is neutral there and nowhere else (a per-expert scale would be ones)."""
    leaf = name.rsplit(".", 1)[-1].lower()
    if target.dim() != 1 or target.shape[0] != count or "bias" not in leaf:
        return None
    names = offered[next(iter(offered))]
    if any(names[n].dim() == 1 and names[n].shape[0] == count for n in names if not n.startswith("experts.")):
        return None
    return torch.zeros_like(target), f"zero: the layer holds no per-expert vector of shape {[count]}"


def _unfilled(name: str, state: dict[str, torch.Tensor], offered: dict[str, dict[str, torch.Tensor]],
              where: str) -> str:
    transformers_names = ", ".join(offered[next(iter(offered))])
    if any("norm" in part for part in name.lower().split(".")[:-1] + [name.lower()]) and state[name].dim() == 1:
        # gpt-oss's MLPBlock computes x + experts(norm(x)): the decoder layer's norm and residual inside the block
        return (f"{where}: your block holds '{name}' {list(state[name].shape)}, a normalisation's weight; "
                "transformers' block is the sparse block alone (the norm before it and the residual added after it "
                "belong to the decoder layer), and so is what parity compares. Check the block without them: a "
                "factory that sets the norm to nn.Identity() and returns the block's output minus its input "
                "(--target mymodel:make_block)")
    return (f"{where}: parity cannot tell which of the layer's tensors fills your block's '{name}' "
            f"{list(state[name].shape)}. It fills a block whose parameters carry transformers' names "
            f"({transformers_names}), the checkpoint's names relative to the block, or one module per expert "
            "(experts.N.gate_proj/up_proj/down_proj, w1/w3/w2, ...); rename the parameter, or write a factory that "
            "loads your block (--target mymodel:make_block)")
