"""A whole MoE block that computes in half precision inside its forward, its parameters float32.

torchtitan's ``GroupedExperts`` casts the tokens and the stacked weights to bfloat16 for ``torch._grouped_mm`` and its
output back, the router and the shared experts in float32: the block's parameters say float32, so nothing held says
half precision (engine.check.block_check.half_precision reads the parameters), and a float32 check fails it by
bfloat16's error, unexplained.  What it computes in is seen instead, while it runs (``HalfSeen``); the yardstick is
transformers' own block with its routed experts computing in that dtype (``experts_in``): an output within
LOW_PRECISION_RATIO of that block's own error is the block computing transformers' function at that precision, and
one further away is matched against the routing mistakes' replays at that precision's tolerance instead of float32's,
so a block computing in bfloat16 that also drops the renormalisation is named for the renormalisation.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from parity.definitions.mistakes import MistakeId, diagnosis, fit_diagnosis
from parity.definitions.records import Diagnosis

Fits = Callable[..., list]  # fits(tolerance=...): engine.routing_mistakes.replay_fits's answer on the block's output

HALF = (torch.bfloat16, torch.float16)
# docs/precision.md: a correct module's error is at most 1.61x the reference's own at bfloat16 (2.44 at float16);
# 4 is the low-precision runs' tolerance ratio, the same one here
LOW_PRECISION_RATIO = 4.0


class HalfSeen(TorchFunctionMode):
    """Records each torch function (by name) that returns a half-precision tensor while the block runs."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[torch.dtype, list[str]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dtype in HALF:
            names = self.seen.setdefault(out.dtype, [])
            name = getattr(func, "__name__", str(func))
            if name not in names:
                names.append(name)
        return out

    def dtype(self) -> torch.dtype | None:
        """The half-precision dtype the block computed in (the one most functions returned), if any."""
        return max(self.seen, key=lambda d: len(self.seen[d])) if self.seen else None

    def said(self) -> str:
        dtype = self.dtype()
        names = self.seen.get(dtype, []) if dtype is not None else []
        listed = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        return f"{str(dtype).removeprefix('torch.')} tensors returned by {listed}"


@contextlib.contextmanager
def experts_in(block: nn.Module, experts: str, dtype: torch.dtype) -> Iterator[None]:
    """``block`` with its routed experts module computing in ``dtype``: a copy of it cast to ``dtype``, its floating
    inputs cast on the way in and its output cast back to the block's dtype on the way out; the original restored."""
    original = block.get_submodule(experts)
    low = copy.deepcopy(original).to(dtype)
    back = next(original.parameters()).dtype

    def cast_in(_module, args, kwargs):
        def cast(a):
            return a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}

    def cast_out(_module, _args, _kwargs, out):
        return out.to(back) if isinstance(out, torch.Tensor) else tuple(
            o.to(back) if isinstance(o, torch.Tensor) and o.is_floating_point() else o for o in out)

    low.register_forward_pre_hook(cast_in, with_kwargs=True)
    low.register_forward_hook(cast_out, with_kwargs=True)
    block.set_submodule(experts, low)
    try:
        yield
    finally:
        block.set_submodule(experts, original)


def low_precision_mistake(low: torch.Tensor, out64: torch.Tensor, got: torch.Tensor, kept: torch.Tensor,
                          seen: HalfSeen, fits: Fits, *, max_abs_diff: float | None) -> Diagnosis:
    """The diagnosis of a failing block seen computing in half precision, ``low`` transformers' block's output with
    its experts in that dtype (``experts_in``): ``low_precision_compute`` where the block's output is within
    LOW_PRECISION_RATIO of that block's own error, else the routing mistake whose replay ``fits`` at that tolerance,
    else ``unexplained`` saying the block is further away than that."""
    name = str(seen.dtype()).removeprefix("torch.")
    width = out64.shape[-1]
    flat64 = out64.reshape(-1, width)[kept]
    error = float((low.reshape(-1, width)[kept] - flat64).abs().max())
    distance = float((got.double().reshape(-1, width)[kept] - flat64).abs().max())
    tolerance = LOW_PRECISION_RATIO * error
    said = (f"it computes in {name} inside its forward ({seen.said()}), its parameters float32: transformers' block "
            f"with its routed experts in {name} deviates from float64 by {error:.2e}")
    if distance <= tolerance:  # its distance: from transformers' block computing so, as a replay's would be
        from_low = float((got.double().reshape(-1, width)[kept] - low.reshape(-1, width)[kept]).abs().max())
        return diagnosis(MistakeId.LOW_PRECISION_COMPUTE, from_low, max_abs_diff,
                         f"{said}, this block by {distance:.2e} ({distance / error:.1f}x): at {name}'s precision it "
                         f"computes what transformers' block does; compute its experts in float32 to check them at "
                         f"float32's")
    found = fits(tolerance=tolerance)
    if not found:  # beyond what the precision explains: a mistake, not named; the precision said beside it
        return diagnosis(MistakeId.UNEXPLAINED, None, max_abs_diff,
                         f"{said}, this block by {distance:.2e}, more than {LOW_PRECISION_RATIO:g}x that: not the "
                         f"precision, and no routing mistake replayed at {name}'s tolerance reproduces it")
    return fit_diagnosis(found, note=f"; matched at {name}'s precision, within {LOW_PRECISION_RATIO:g}x "
                         f"transformers' own {name} error ({tolerance:.2e}): {said}")
