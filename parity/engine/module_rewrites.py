"""Change one module for the span of a context, and put it back bit for bit after: its torch calls seen or rewritten
(a ``TorchFunctionMode`` active only inside its forward), its forward or its output replaced, a setting or a
tensor's values held.  The routing replays (engine.routing_replays) are built from these; kept apart because none of
them knows about routing: each acts on any module."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

DIVISIONS = {"__itruediv__", "__truediv__", "div", "div_", "true_divide"}
ADDITIONS = {"__add__", "__radd__", "add", "__iadd__", "add_"}
Rule = Callable[[Callable, tuple, dict], object]  # returns NotImplemented to let the call through


class Rewrite(TorchFunctionMode):
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
        if name in ADDITIONS and adds_one(args):
            self.seen.append("+1")
        if name in DIVISIONS and divides_by_row_sum(args):
            self.seen.append("/sum")
        if name == "topk" and top_two_per_group(args, kwargs):
            self.seen.append("top-2/group")
        rule = self.rules.get(name)
        if rule is not None:
            out = rule(func, args, kwargs)
            if out is not NotImplemented:
                return out
        return func(*args, **kwargs)


def adds_one(args: tuple) -> bool:
    return len(args) == 2 and isinstance(args[0], torch.Tensor) and not isinstance(args[1], torch.Tensor) \
        and isinstance(args[1], (int, float)) and args[1] == 1


def top_two_per_group(args: tuple, kwargs: dict) -> bool:
    """``scores.view(tokens, groups, per_group).topk(2, dim=-1)``, more than one group: the group scores DeepSeek V3
    sums (its inference Gate without a selection bias takes each group's best alone)."""
    k = args[1] if len(args) > 1 else kwargs.get("k")
    scores = args[0] if args else None
    return isinstance(scores, torch.Tensor) and scores.dim() == 3 and scores.shape[1] > 1 and k == 2 \
        and kwargs.get("dim", args[2] if len(args) > 2 else -1) in (-1, 2)


def divides_by_row_sum(args: tuple) -> bool:
    """``w / w.sum(-1, keepdim=True)`` (DeepSeek adds 1e-20): the top-k weights renormalised."""
    if len(args) != 2 or not all(isinstance(a, torch.Tensor) for a in args):
        return False
    weights, divisor = args
    if weights.dim() != divisor.dim() or divisor.shape[-1] != 1 or weights.shape[-1] < 2:
        return False
    return bool(torch.allclose(divisor.double(), weights.double().sum(-1, keepdim=True), rtol=1e-6, atol=1e-12))


@contextmanager
def forward_replaced(module: nn.Module, wrap: Callable[[Callable], Callable]) -> Iterator[None]:
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


def inside(module: nn.Module, rules: dict[str, Callable[[], Rule]] | Callable[[], dict[str, Rule]],
            seen: list[str] | None = None) -> AbstractContextManager:
    """Calls of ``module`` run under a fresh ``Rewrite`` (fresh rules per call: rules may keep state)."""
    def wrap(forward: Callable) -> Callable:
        def rewritten(*args, **kwargs):
            with Rewrite(rules() if callable(rules) else rules, seen):
                return forward(*args, **kwargs)
        return rewritten
    return forward_replaced(module, wrap)


def output_replaced(module: nn.Module, change: Callable) -> AbstractContextManager:
    """``module``'s output passed through ``change(output, *args)``."""
    def wrap(forward):
        return lambda *args, **kwargs: change(forward(*args, **kwargs), *args)
    return forward_replaced(module, wrap)


@contextmanager
def held_setting(module: nn.Module, name: str, value) -> Iterator[None]:
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


@contextmanager
def held_settings(pairs: list[tuple[nn.Module, str, object]]) -> Iterator[None]:
    with ExitStack() as stack:
        for module, name, value in pairs:
            stack.enter_context(held_setting(module, name, value))
        yield


@contextmanager
def holding(tensor: torch.Tensor, new: torch.Tensor) -> Iterator[None]:
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


@contextmanager
def at_once(*applies: Callable[[], AbstractContextManager]) -> Iterator[None]:
    """Changes made at once, undone in the reverse order."""
    with ExitStack() as stack:
        for apply in applies:
            stack.enter_context(apply())
        yield
