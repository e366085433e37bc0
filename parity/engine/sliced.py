"""transformers' MLP of a very large layer, computed in slices along d_ff.

An FFN is a sum over its intermediate units: ``down[:, s] · act(gate[s] x) * up[s] x``, plus the
output bias once.  Upcast whole, the float64 reference of a Llama-3.1-405B layer (d = 16384,
d_ff = 53248) would need 21 GB beside the target's own 10.5 GB of float32 weights.  So a layer whose
float64 weights exceed ``SLICE_BYTES`` is computed as that sum: transformers' own MLP class, built for
the slice width (the config's d_ff set to it, on the meta device), holds one slice of the stored
tensors at a time, converted to the compute dtype only while it runs.  Only the float64 summation
order changes (tests/test_sliced.py measures it against the whole-layer run).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from parity.engine.upcast import upcast_on_call

SLICE_BYTES = 512 * 2**20  # float64 bytes of one slice's weights


@dataclass(frozen=True)
class SlicePlan:
    bounds: tuple[tuple[int, int], ...]  # [start, stop) of each slice along d_ff
    axes: dict[str, int | None]  # each tensor's d_ff axis; None: an output bias, added by the first slice only


def plan_slices(shapes: dict[str, tuple[int, ...]], d_ff: int | None, hidden: int | None,
                slice_bytes: int = SLICE_BYTES) -> SlicePlan | None:
    """How to cut a layer with these reference tensors, or None when it is small or cannot be cut: every
    tensor must have exactly one axis of size d_ff, or be the output bias (d values)."""
    total = sum(math.prod(shape) for shape in shapes.values()) * 8
    if total <= slice_bytes or not d_ff or not hidden or d_ff == hidden:
        return None
    axes: dict[str, int | None] = {}
    for name, shape in shapes.items():
        hits = [axis for axis, size in enumerate(shape) if size == d_ff]
        if len(hits) == 1:
            axes[name] = hits[0]
        elif tuple(shape) == (hidden,) and name.endswith("bias"):
            axes[name] = None
        else:
            return None
    if not any(axis is not None for axis in axes.values()):
        return None
    return SlicePlan(slice_bounds(d_ff, math.ceil(total / slice_bytes)), axes)


def slice_bounds(d_ff: int, count: int) -> tuple[tuple[int, int], ...]:
    """``count`` near-equal slices (widths w and w+1: at most two MLP widths to build)."""
    count = max(1, min(count, d_ff))
    width, extra = divmod(d_ff, count)
    bounds, start = [], 0
    for i in range(count):
        stop = start + width + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return tuple(bounds)


class SlicedMLP(nn.Module):
    """Behaves as the layer's MLP (forward, ``to(dtype)``, an activation child to hook or swap) while
    holding only views of the stored tensors; each slice module exists only while it runs."""

    def __init__(self, tensors: dict[str, torch.Tensor], plan: SlicePlan,
                 slice_module: Callable[[int, nn.Module], nn.Module], act: nn.Module, on_call: bool = False):
        super().__init__()
        self.act = act  # the one activation every slice runs: a hook on it or a swapped activation reaches them all
        self.stored = dict(tensors)  # a plain attribute: never converted or moved as a whole
        self.plan = plan
        self.slice_module = slice_module
        self.on_call = on_call  # upcast each projection as it runs (engine.upcast): a probe up to the activation
        # converts only the projections before it
        self.compute_dtype = torch.float32
        self.device = torch.device("cpu")

    def slices(self) -> Iterator[nn.Module]:
        """Each slice as transformers' MLP of its width (``slice_module(width, act)``: running ``act``)."""
        for i, (start, stop) in enumerate(self.plan.bounds):
            module = self.slice_module(stop - start, self.act)
            part = {}
            for name, tensor in self.stored.items():
                axis = self.plan.axes[name]
                part[name] = (tensor.narrow(axis, start, stop - start) if axis is not None
                              else tensor if i == 0 else torch.zeros_like(tensor))
            module.load_state_dict(part, strict=True, assign=True)
            if self.on_call and self.device.type == "cpu" and self.compute_dtype in (torch.float32, torch.float64):
                yield upcast_on_call(module, self.compute_dtype).eval()
            else:
                yield module.to(device=self.device, dtype=self.compute_dtype).eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = None
        for module in self.slices():
            part = module(x.to(device=self.device, dtype=self.compute_dtype)).double()
            total = part if total is None else total.add_(part)
            del module
        return total.to(self.compute_dtype)

    def to(self, *args, **kwargs) -> SlicedMLP:
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        self.device = torch.device(device) if device is not None else self.device
        self.compute_dtype = dtype if dtype is not None else self.compute_dtype
        self.act.to(device=self.device)
        return self

    def float(self) -> SlicedMLP:
        return self.to(torch.float32)

    def double(self) -> SlicedMLP:
        return self.to(torch.float64)

    def cpu(self) -> SlicedMLP:
        return self.to("cpu")
