"""MLX-LM's affine quantization (``parity.sources.mlx_affine``) judged against its own grid, for ``parity compare``:
each value's step is its group's scale (w = scale x code + bias, codes 0 .. 2^bits - 1), A re-quantized the way
mlx_lm.convert does (A cast to the dtype B's scales are stored in, then ``mlx.core.quantize`` with B's group size and
bits), and the conversion mistakes a writer of the format makes that keep its shapes, replayed on A's tensor: scales
and biases exchanged, a square scale grid transposed.  (Another group size, another bit width and a non-square grid
transposed change the shapes: the reader names those from the file, ``mlx_affine.check_shapes``.)

A value of B may lie its step from A's (``conversion.STEP_SLACK``) plus what storing the scale and bias in their dtype
moves it by, and at a clamped end of its group a step more (``allowance``).  Measured on tests/test_quantized_mlx.py's
faithful exports: up to 1.02 steps at 4 bits (the far end clamped), 1.04 at 8 bits with float16 scales, 1.67 at 8 bits
with bfloat16 scales (A's own bfloat16 rounding and the scale's, times codes up to 255), none beyond the allowance.

Everything here works in the layout the file stores ([out, in]); ``conversion`` routes it to the reference's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from parity.definitions.mapping import TensorRoute
from parity.engine.compare.storage import Storage
from parity.engine.layer import route_tensor

# A group's scale in B's file may exceed the step A's values there call for ((max - min) / (2^bits - 1)) by this before
# it is grid_too_coarse: mlx.core.quantize moves the scale so the group's larger-magnitude end is a code exactly
# (edge / round(edge / scale)): by at most (q + 0.5) / q with q >= round((2^bits - 1) / 2), 1.25x at 2 bits, 1.07x at
# 4; a grid one bit coarser is 2x.
GRID_FACTOR = 1.5


@dataclass
class AffineStorage:
    """How B stores one MLX-quantized matrix (stored layout, one expert's slice of a stacked tensor): each value's
    code, each group's scale and bias (float32 of the stored values), the parameters, the scales' stored dtype."""

    codes: torch.Tensor
    scales: torch.Tensor
    biases: torch.Tensor
    group_size: int
    bits: int
    dtype: str

    @property
    def name(self) -> str:
        """The storage as reports show it: ``mlx affine 4-bit/64 (bfloat16 scales)``."""
        return f"mlx affine {self.bits}-bit/{self.group_size} ({self.dtype} scales)"

    def steps(self) -> torch.Tensor:
        return expand(self.scales.abs(), self.group_size)


def held(checkpoint, key: str, expert: int | None) -> AffineStorage | None:
    """How an MLX checkpoint stores ``key`` (``expert``'s slice of a stacked [E, out, in] tensor), None for a tensor
    stored unquantized or a checkpoint of another format."""
    quantized = getattr(checkpoint, "affine_quantized", None)
    found = quantized(key, expert=expert) if quantized is not None else None
    if found is None:
        return None
    return AffineStorage(found.codes, found.scales, found.biases, found.params.group_size, found.params.bits,
                         found.scale_dtype)


def stored(checkpoint, key: str, route: TensorRoute, expert: int | None) -> Storage | None:
    """How an MLX affine-quantized checkpoint stores ``key`` (``parity.sources.mlx_affine``): each value's step is its
    group's scale, read from the file; None for a tensor stored unquantized."""
    store = held(checkpoint, key, expert)
    if store is None:
        return None
    bad = ~(torch.isfinite(store.scales) & torch.isfinite(store.biases))
    problem = None
    if bool(bad.any()):
        first = [int(i) for i in bad.nonzero()[0]]
        problem = f"group {first}: {int(bad.sum())} of {bad.numel()} groups have a NaN/Inf scale or bias"
    return Storage(store.name, True, route_tensor(route, store.steps()), "file", route, nonfinite_scale=problem,
                   zeroed=not bool(store.codes.any()), affine=store)


def expand(per_group: torch.Tensor, group: int) -> torch.Tensor:
    """Each group's value at every value of its group."""
    return per_group.float().repeat_interleave(group, dim=-1)


def spacing(values: torch.Tensor, dtype: str) -> torch.Tensor:
    """One unit in the last place of ``dtype`` at each value (float32)."""
    info = torch.finfo(getattr(torch, dtype))
    exponent = torch.frexp(values.float())[1]
    magnitude = torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent - 1)
    return info.eps * torch.where(values == 0, info.tiny, magnitude.clamp_min(info.tiny))


def needed_steps(x: torch.Tensor, group: int, bits: int) -> torch.Tensor:
    """The step A's values call for in each group: their range over the 2^bits - 1 steps of the codes."""
    groups = x.float().reshape(*x.shape[:-1], -1, group)
    return (groups.amax(-1) - groups.amin(-1)) / (2 ** bits - 1)


def allowance(x: torch.Tensor, store: AffineStorage) -> torch.Tensor:
    """What a value of B may lie from A's beyond its step (stored layout): storing the scale and bias in their dtype
    (code x half the scale's spacing + half the bias's + half A's own rounding to that dtype), and at either end of
    its group's codes (0 or 2^bits - 1) a step A's values call for: mlx.core.quantize makes the group's
    larger-magnitude end a code exactly (scale edge / round(edge / scale)), which may shrink the scale and clamp the
    other end by up to that much."""
    group = store.group_size
    scale = expand(spacing(store.scales, store.dtype), group)
    bias = expand(spacing(store.biases, store.dtype), group)
    at_end = (store.codes == 0) | (store.codes == 2 ** store.bits - 1)
    clamp = torch.where(at_end, expand(needed_steps(x, group, store.bits), group), 0.0)
    return (store.codes * scale + bias + spacing(x, store.dtype)) / 2 + clamp


def quantize(x: torch.Tensor, store: AffineStorage) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A's matrix (stored layout) quantized as mlx_lm.convert does: cast to B's scale dtype, ``mlx.core.quantize``
    with B's group size and bits.  Returns the codes, scales and biases (float32)."""
    import numpy as np

    from parity.sources.mlx_affine import AffineParams, require_mlx, unpack

    mx = require_mlx("MLX affine quantization")
    w = mx.array(x.float().contiguous().numpy()).astype(getattr(mx, store.dtype))
    packed, scales, biases = mx.quantize(w, group_size=store.group_size, bits=store.bits)
    words = torch.from_numpy(np.array(packed).view(np.int32))
    codes = unpack(mx, words, AffineParams(store.group_size, store.bits))
    return (codes, *(torch.from_numpy(np.array(t.astype(mx.float32))) for t in (scales, biases)))


def values(codes: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, group: int) -> torch.Tensor:
    """scale x code + bias in each group (float32), as mlx.core.dequantize computes it from float32 scales."""
    return codes * expand(scales, group) + expand(biases, group)


def requantize(x: torch.Tensor, store: AffineStorage) -> tuple[torch.Tensor, torch.Tensor]:
    """A's matrix (stored layout) as a faithful MLX export holds it (float32), and each value's step."""
    codes, scales, biases = quantize(x, store)
    return values(codes, scales, biases, store.group_size), expand(scales.abs(), store.group_size)


def reference(x: torch.Tensor, storage: Storage) -> tuple[torch.Tensor, str, torch.Tensor]:
    """A's matrix (stored layout) as B's MLX storage would hold it (``requantize``), how it was made, and each value's
    step."""
    store = storage.affine
    values, each = requantize(x, store)
    return (values, f"re-quantized with mlx.core.quantize ({store.bits}-bit, groups of {store.group_size}, A cast to "
            f"{store.dtype} first)", each)


def coarse_groups(x: torch.Tensor, store: AffineStorage) -> dict | None:
    """Groups whose scale in B's file exceeds ``GRID_FACTOR`` x the step A's values there call for ((max - min) /
    (2^bits - 1), never less than the dtype's spacing at the group's largest value): None when none does; else how
    many and the worst, with evidence (the keys ``findings.grid_finding`` words)."""
    needed = needed_steps(x, store.group_size, store.bits)
    floor = spacing(x.float().reshape(*x.shape[:-1], -1, store.group_size).abs().amax(-1), store.dtype)
    limit = torch.maximum(GRID_FACTOR * needed, floor) * (1 + 2 * torch.finfo(getattr(torch, store.dtype)).eps)
    over = (store.scales.abs() / limit).nan_to_num(0.0)
    if not bool((over > 1).any()):
        return None
    worst = int(over.argmax())
    per_row = over.shape[-1]
    first = worst % per_row * store.group_size
    b_step, a_step = float(store.scales.abs().reshape(-1)[worst]), float(needed.reshape(-1)[worst])
    return {"blocks_too_coarse": int((over > 1).sum()), "blocks": over.numel(), "worst_block": worst,
            "row": worst // per_row, "values": [first, first + store.group_size - 1], "b_step": b_step,
            "a_step": a_step, "limit": float(limit.reshape(-1)[worst]),
            "times_coarser": b_step / a_step if a_step else float("inf")}


def mistakes(x: torch.Tensor, store: AffineStorage) -> list[tuple[str, str, torch.Tensor]]:
    """The MLX conversion mistakes that keep B's shapes, each as (mistake id, detail, A's matrix as the broken
    export reads back; stored layout): scales and biases exchanged; each bias one step (its group's scale) up or
    down, which is a zero point one code off (scale x code + bias = scale x (code - zero)); a square scale grid
    transposed."""
    codes, scales, biases = quantize(x, store)
    group = store.group_size
    found = [("mlx_scales_biases_exchanged", "X.scales and X.biases exchanged (bias x code + scale)",
              values(codes, biases, scales, group))]
    found += [("zero_point_off_by_one", f"X.biases one step {'up' if shift > 0 else 'down'} (each group's bias "
               f"{'+' if shift > 0 else '-'} its scale: a zero point one code off)",
               values(codes, scales, biases + shift * scales, group)) for shift in (1, -1)]
    if scales.shape[-1] == scales.shape[-2] and scales.shape[-1] > 1:
        found.append(("mlx_scales_transposed", f"X.scales and X.biases transposed (grid {list(scales.shape)})",
                      values(codes, scales.transpose(-1, -2), biases.transpose(-1, -2), group)))
    return found


def replays(x: torch.Tensor, store: AffineStorage, back: Callable[[torch.Tensor], torch.Tensor]
            ) -> list[tuple[str, str, torch.Tensor]]:
    """``mistakes`` with each result put into the reference's layout by ``back``."""
    return [(mistake, detail, back(found)) for mistake, detail, found in mistakes(x, store)]
