"""What a conversion can honestly change in one tensor, and what it did: the tensor-level half of
``parity compare A B`` (``comparison.py`` holds the function-level half and the order).

Each of a layer's FFN tensors is read as its checkpoint stores it and routed to transformers' own
parameter names by that checkpoint's mapping (GGUF names, Conv1D transposes, fused halves), so A's and
B's tensors are compared name by name in one layout.  How B stores a tensor decides what B may differ by:

* the same dtype as A: nothing (bit-identical is the expected case, and reported as such), each value within
  one ulp of A's;
* another float dtype (bfloat16 -> float16, float32 -> bfloat16): A's value rounded to B's dtype, each value of
  B within one ulp of that dtype of A's cast (``ulp_excess``: value_corrupted otherwise);
* a quantized format: every value within its block's quantization step of A's value, never less than A's own
  storage rounding (``quantized_bounds``), the step read from the file; each block's step held to what a quantizer
  of the format chooses for A's values there (grid_too_coarse).  A GGUF whose metadata names an importance matrix,
  in a type whose llama.cpp quantizer uses it: each value within ``gguf_grid.IMPORTANCE_STEPS`` steps, each block's
  step within ``IMPORTANCE_GRID_FACTOR`` x A's, B's least-squares scale on A near 1 (``scale_excess``; integer
  groups too: ``group_grid.value_scales``), the function within ``IMPORTANCE_FACTOR`` x the conversion's.

``reference_conversion`` makes A's tensor as B's storage would hold it, from A alone: cast, or re-quantized the way
B's format does.  The function-level deviation that conversion alone causes is what B is judged against.

This module keeps the dispatch; each format's storage, re-quantization and grid live beside it: ``gguf_grid`` (GGUF's
types, its blocks read by ``gguf_blocks``), ``fp8_grid``, ``codebook_grid`` (bitsandbytes), ``mlx_grid`` (MLX),
``group_grid`` (GPTQ, AWQ, pack-quantized), ``fp4_grid`` (FP4 groups); ``storage`` holds ``Storage`` and the two
layouts they all work in.
"""

from __future__ import annotations

import math

import torch

from parity.definitions.mapping import TensorRoute
from parity.engine.compare import codebook_grid, fp4_grid, fp8_grid, gguf_grid, group_grid, mlx_grid
from parity.engine.compare.gguf_grid import LEVELS_FACTOR as LEVELS_FACTOR  # comparison.py reads it here
from parity.engine.compare.storage import (
    Storage,
    dtype_name,
    least_squares_factor,
    least_squares_scales,
    spacing,
    stored_layout,
    unstored,
)

STEP_SLACK = 1.01  # a value may sit a step from A's (Q4_0's clamp at +8) plus the float16 rounding of d itself
# B's least-squares factor on A's conversion (what a faithful export holds: A rounded to nearest on B's own grid, or
# re-quantized by the format's library), for the formats a faithful writer rounds to nearest on the grid the file
# stores (Storage.nearest: FP4 groups, MLX's modes, bitsandbytes' 4-bit code books, GGUF without an importance
# matrix), whose steps are wide enough to hide a tensor multiplied after quantizing: MLX nvfp4 with its global scale
# x 1.1 passed (1.52 x the conversion's deviation, no value beyond a step), and so did every scale x 1.05 over the same
# codes in MLX affine, NF4, Q4_0 and Q4_K, x 1.1 and x 0.9 in NF4 and 4-bit integer groups.  A faithful round to
# nearest holds it at 1 exactly, and a clip search too (AWQ's, GPTQ's mse observer: A clamps on the shrunk grid as B
# did): within CONVERTED_SCALE, and CONVERTED_GROUP_SCALE for integer groups, whose GPTQ compensation moves codes both
# ways.  Measured on the tests' faithful exports: mlx (affine, mxfp4, mxfp8, nvfp4) and bitsandbytes 1.0000,
# compressed-tensors' and GPT-OSS's FP4 0.996 to 1.000; GPTQ-like (act order, outlier Hessians, symmetric and not)
# 0.988 to 1.018, AWQ with its scales folded and undone 0.986 to 1.015, pack- and int-quantized round to nearest
# 1.000; a reviewer's faithful MLX (affine 2 to 8 bits, mxfp4, mxfp8, nvfp4), NF4 / FP4 and Q4_0 exports of
# Student-t, log-normal and outlier-row weights 1.0000 each.  B's factor on A itself is no measure there: those
# exports' sat at 0.845 to 1.048 (mxfp4, MLX affine 2-bit), and 0.95 to 1.05 on it failed them.  Scales x 1.05 over
# the same codes sit at 1.046 to 1.05, x 1.1 at 1.07 to 1.1 (integer groups, clipped or not).
CONVERTED_SCALE = (0.98, 1.02)
# Integer groups from group_grid.CONVERTED_GROUP_BITS (3 bits are not held to it)
CONVERTED_GROUP_SCALE = (0.93, 1.07)


def storage_of(checkpoint, key: str, stored: torch.Tensor, route: TensorRoute, expert: int | None = None) -> Storage:
    """How ``checkpoint`` stores tensor ``key`` (``stored``: as read; for MoE, one ``expert``'s slice of a tensor
    that may stack every expert, as GGUF's ``*_exps`` do); GGUF files say it in their index."""
    header = getattr(checkpoint, "header", None)
    info = header.tensors.get(key) if header is not None else None
    if info is None:
        as_stored = getattr(checkpoint, "stored_dtype", lambda _: None)(key)  # before a read's upcast to one dtype
        return (fp8_grid.stored(checkpoint, key, route) or codebook_grid.stored(checkpoint, key, route)
                or mlx_grid.stored(checkpoint, key, route, expert) or group_grid.stored(checkpoint, key, route)
                or fp4_grid.stored(checkpoint, key, route, expert, stored.shape)
                or Storage(as_stored or dtype_name(stored.dtype), route=route))
    from parity.sources.gguf import importance_matrix

    storage = gguf_grid.stored(header.path, info, stored, route, expert)
    if storage.dtype in gguf_grid.IMPORTANCE_WEIGHTED:  # a type whose llama.cpp quantizer uses the matrix
        storage.importance = importance_matrix(header.metadata)
    return storage


def convert_like(a: torch.Tensor, storage: Storage) -> tuple[torch.Tensor, str]:
    """A's tensor (reference layout) as B's storage would hold it, in float32, and how it was made."""
    return reference_conversion(a, storage)[:2]


def reference_conversion(a: torch.Tensor, storage: Storage) -> tuple[torch.Tensor, str, torch.Tensor | None]:
    """A's tensor as B's storage would hold it (float32), how it was made, and for a quantized B each value's step
    as the format's own quantizer chose it for A (stored layout; None where it cannot be had).  Where the format's
    quantizer runs here (gguf, compressed-tensors, mlx, bitsandbytes) A is quantized from A alone and B's grid is
    judged against it; where it does not, or where the format's quantizer searches what A alone does not fix (GPTQ's
    and AWQ's scales, IQ's codebooks), A is rounded onto B's own grid or levels read from the file, which a broken
    grid moves too: those are judged by the function, and by the findings that read B's grid itself."""
    if not storage.quantized:
        target = getattr(torch, storage.dtype, None)
        if not isinstance(target, torch.dtype) or target == a.dtype:
            return a.float(), "as stored", None
        return a.to(target).float(), f"rounded to {storage.dtype}", None
    if storage.fp4 is not None:  # FP4 groups: A rounded onto B's own grid (reference layout)
        return fp4_grid.reference(a, storage)
    stored = stored_layout(storage.route, a.float())
    if stored is not None and storage.group is not None:  # integer groups: round to nearest on B's own grid
        rounded, how = group_grid.reference(stored, storage.group)
        return unstored(storage.route, rounded), how, None
    for held, grid in ((storage.block, fp8_grid), (storage.codebook, codebook_grid), (storage.mlx, mlx_grid)):
        if stored is not None and held is not None:  # re-quantized by the format's own library, in B's stored layout
            values, how, steps = grid.reference(stored, storage)
            return unstored(storage.route, values), how, steps
    return gguf_grid.reference(a, storage)  # GGUF's types; any grid whose blocks span a fused tensor's halves


def quantized_bounds(a: torch.Tensor, b: torch.Tensor, storage: Storage, a_dtype: str,
                     a_steps: torch.Tensor | None) -> tuple[torch.Tensor, dict | None]:
    """Each of B's values' allowed distance from A's (reference layout), and where B's blocks use a coarser step than
    the format's own quantizer chooses for A's values, the evidence (``coarse_blocks``: grid_too_coarse).

    A value may lie its block's step from A's (``STEP_SLACK``), never less than A's own storage rounding (a zero
    step, where a block's values all equal its minimum, is a fact about the block); each format's grid module adds
    what its grid's ends and scales' rounding allow and judges its blocks' steps (``gguf_grid.bounds``: the
    K-quants' clamped ends)."""
    if storage.levels is not None:  # B's own levels (importance-weighted or not): the steps are evidence only
        return torch.full_like(storage.steps.float(), math.inf), None
    if storage.group is not None:  # integer groups (GPTQ moves values by more than a step): the steps are evidence,
        x, held = stored_layout(storage.route, a.float()), stored_layout(storage.route, b.float())  # unless biased,
        # or on a grid that is no grid of A's (a g_idx naming the wrong groups: the function, judged against min-max
        # in B's groups, may pass it; GPTQModel 7.7.0's act-order export with down_proj's g_idx rolled by one group,
        # x 2.67 under 3 x, grid 1.35 x min-max's, where every faithful export measured sits at 0.98 to 1.03 x)
        grid = storage.group  # or with most of its codes moved (group_grid.MOVED_LIMIT)
        biased = x is not None and (abs(group_grid.bias(x, held, grid)) > group_grid.BIAS_LIMIT
                                    or group_grid.roughness(x, grid) > group_grid.SOUND
                                    or grid.bits < group_grid.CONVERTED_GROUP_BITS  # from 4 bits B's factor on A's
                                    and group_grid.moved(held, group_grid.round_to(x, grid), grid)  # conversion
                                    > group_grid.MOVED_LIMIT)  # and the function carry it
        # a row's codes short of its range, or on one level in k of it
        coarse = (group_grid.coarse_rows(x, held, grid) or group_grid.skipped_levels(x, held, grid)
                  if x is not None else None)
        return torch.full_like(storage.steps.float(), 0.0 if biased else math.inf), coarse
    allowed = torch.maximum(STEP_SLACK * storage.steps.float(), spacing(a, a_dtype))
    if storage.fp4 is not None:  # FP4 groups: each group's scale against A's amax / 6
        return fp4_grid.bounds(allowed, a, storage.fp4)
    x = stored_layout(storage.route, a.float())
    if x is None:
        return allowed, None
    if storage.mlx is not None:  # MLX: plus dtype rounding and clamped ends; each group's scale against A's range
        allowed = allowed + unstored(storage.route, mlx_grid.allowance(x, storage.mlx))
        return allowed, mlx_grid.coarse_groups(x, storage.mlx)
    if storage.block is not None and storage.scales is not None:  # FP8: each block's scale against A's amax / 448
        return allowed, fp8_grid.coarse_blocks(x, storage.scales, storage.block)
    if storage.codebook is not None:  # bitsandbytes 4-bit: each block's absmax against A's largest magnitude
        nested, coarse = codebook_grid.bounds(x, storage.codebook)  # plus double quant's absmax rounding
        return (allowed if nested is None else allowed + unstored(storage.route, nested)), coarse
    return gguf_grid.bounds(allowed, x, b, storage, a_dtype, a_steps)  # K-quants' ends; each block's d against A's


def scale_excess(a: torch.Tensor, b: torch.Tensor, storage: Storage, converted: torch.Tensor) -> dict | None:
    """For a B whose quantizer moves values by more than a step (an importance matrix, ``Storage.importance``;
    integer groups, ``Storage.group``): B's least-squares scale on A, whole tensor, worst row and worst block
    (``storage.least_squares_scales``, stored layout, each format's bounds) and, from 4 bits, B's factor on A's
    ``converted`` tensor (``CONVERTED_GROUP_SCALE``); for one a faithful writer rounds to nearest on its stored grid
    (``Storage.nearest``), whose steps hide a small factor, B's factor on A's ``converted`` tensor alone
    (``CONVERTED_SCALE``; on A, as evidence); else None."""
    if storage.nearest and a.dim() == 2:  # the tensor's factors are the same in either layout
        found = least_squares_scales(a.float(), b.float(), a.shape[1], bounds=group_grid.ANY,
                                     block_bounds=group_grid.ANY)  # on A: evidence only
        return on_conversion(found, converted, b, CONVERTED_SCALE)
    x, held = stored_layout(storage.route, a.float()), stored_layout(storage.route, b.float())
    if x is None or x.dim() != 2:
        return None
    if storage.importance is not None:
        return gguf_grid.importance_scales(x, held, gguf_grid.scale_group(storage), levels=storage.levels is not None,
                                           dtype=storage.dtype)
    if storage.group is None:
        return None
    found = group_grid.value_scales(x, held, storage.group)
    if storage.group.bits < group_grid.CONVERTED_GROUP_BITS:
        return found
    return on_conversion(found, converted, b, CONVERTED_GROUP_SCALE)


def on_conversion(found: dict, converted: torch.Tensor, b: torch.Tensor, bounds: tuple[float, float]) -> dict:
    """``found`` (a ``least_squares_scales`` record) with B's least-squares factor on A's conversion (the tensor as
    a faithful export holds it) and ``bounds``, beyond when it lies outside them."""
    found["converted"] = least_squares_factor(converted, b)
    found["converted_bounds"] = list(bounds)
    found["beyond"] = found["beyond"] or not bounds[0] <= found["converted"] <= bounds[1]
    return found


def as_converted(allowed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, converted: torch.Tensor) -> torch.Tensor:
    """``allowed``, widened to B's own distance wherever B's value is A's conversion exactly, for a conversion made
    from A alone (never from B's grid, which a broken grid moves too): the format's own quantizer put it there,
    whatever its step reads (a group scale below the scale dtype's smallest subnormal is stored 0, and so is each of
    its values: MLX nvfp4 of rows near 2e-5 read "inf steps" on a faithful export)."""
    return torch.where(b == converted, torch.maximum(allowed, (b - a).abs()), allowed)


def step_excess(a: torch.Tensor, b: torch.Tensor, steps: torch.Tensor, allowed: torch.Tensor | None = None) -> dict:
    """How far B's values are from A's in units of their block's step: the count beyond their allowed distance
    (``allowed``; default ``STEP_SLACK`` x step), the worst in steps, where it is (the value most beyond its
    allowance when one is; a zero-step value within its allowance counts 0 steps) and its allowance in steps (a
    biased group's values may move less than a step: "beyond" is read against this, not against one step)."""
    diff = (b.float() - a.float()).abs()
    allowed = STEP_SLACK * steps.float() if allowed is None else allowed
    beyond = diff > allowed
    units = torch.where(steps > 0, diff / steps.float().clamp_min(1e-30), torch.where(beyond, math.inf, 0.0))
    pick = diff / allowed.clamp_min(1e-300) if bool(beyond.any()) else units
    worst = int(pick.nan_to_num(math.inf).flatten().argmax())
    index = [int(i) for i in torch.unravel_index(torch.tensor(worst), units.shape)]
    step, room = float(steps.float().flatten()[worst]), float(allowed.flatten()[worst])
    return {"values_beyond_step": int(beyond.sum()), "max_steps": float(units.flatten()[worst]), "at": index,
            "allowed_steps": room / step if step > 0 else (0.0 if room == 0 else math.inf)}


def ulp_excess(cast: torch.Tensor, b: torch.Tensor, dtype: str) -> dict:
    """How far each of B's values is from A's value cast to B's dtype (``cast``), in units in the last place of
    that dtype at the value: a cast or a re-save makes every value exactly its cast (within one such unit for
    another rounding mode; a subnormal may be flushed to zero).  The count beyond one, the worst, where it is, and
    both values there."""
    units = ((b.float() - cast.float()).abs() / spacing(cast, dtype)).nan_to_num(math.inf)
    kind = getattr(torch, dtype, None)
    if isinstance(kind, torch.dtype) and kind.is_floating_point:  # a subnormal flushed to zero: another rounding
        units = torch.where((b == 0) & (cast.abs() < torch.finfo(kind).tiny), 0.0, units)
    worst = int(units.flatten().argmax())
    index = [int(i) for i in torch.unravel_index(torch.tensor(worst), units.shape)]
    return {"values_beyond_ulp": int((units > 1).sum()), "max_ulps": float(units.flatten()[worst]), "at": index,
            "b": float(b.flatten()[worst]), "a_cast": float(cast.flatten()[worst])}


def relative_distance(b: torch.Tensor, a: torch.Tensor, *, scale: float | None = None) -> float:
    """max |B - A| / max |A| (inf where A is all zero and B is not); ``scale``: max |A|, when already known."""
    if scale is None:
        scale = float(a.float().abs().max()) if a.numel() else 0.0
    diff = float((b.float() - a.float()).abs().max()) if b.numel() else 0.0
    return diff / scale if scale else (math.inf if diff else 0.0)


def reinterpreted(a: torch.Tensor, b: torch.Tensor, b_dtype: str) -> str | None:
    """'bfloat16 bits read as float16' when B's 16-bit patterns are A's in the other 16-bit dtype, else None."""
    other = {"float16": torch.bfloat16, "bfloat16": torch.float16}.get(b_dtype)
    if other is None or a.shape != b.shape or not a.numel():
        return None
    mine = getattr(torch, b_dtype)
    if not bool(torch.isfinite(a).all()):
        return None
    patterns = b.to(mine).view(torch.int16)
    same = float((patterns == a.to(other).view(torch.int16)).float().mean())
    return f"{dtype_name(other)} bits read as {b_dtype} ({same:.1%} of the values)" if same >= 0.99 else None


def overflow(a: torch.Tensor, b: torch.Tensor, b_dtype: str) -> str | None:
    """Where B holds Inf/NaN and A a finite value: how many, the first, and B's dtype's largest finite value."""
    bad = ~torch.isfinite(b) & torch.isfinite(a) if a.shape == b.shape else ~torch.isfinite(b)
    if not bool(bad.any()):
        return None
    first = [int(i) for i in torch.unravel_index(bad.flatten().nonzero()[0, 0], bad.shape)]
    dtype = getattr(torch, b_dtype, None)
    floating = isinstance(dtype, torch.dtype) and dtype.is_floating_point  # an integer storage ends at no finfo
    limit = f"; {b_dtype} ends at {torch.finfo(dtype).max:.6g}" if floating else ""
    value = f" where A holds {float(a[tuple(first)]):.6g}" if a.shape == b.shape else ""
    return f"{int(bad.sum())} of {b.numel()} values are Inf/NaN, first at {first}{value}{limit}"


def zero_tail(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """The flat index from which B is all zero while before it B equals A (a short write), or None."""
    flat_a, flat_b = a.float().reshape(-1), b.float().reshape(-1)
    nonzero = flat_b.nonzero()
    end = int(nonzero[-1, 0]) + 1 if nonzero.numel() else 0
    if end == 0 or end >= flat_b.numel() or not bool(flat_a[end:].any()):
        return None
    head = relative_distance(flat_b[:end], flat_a[:end])
    return end if head <= 1e-2 else None
