"""Integer group quantization (``parity.sources.int_groups``: GPTQ, AWQ, compressed-tensors pack-quantized) judged
against its own grid, for ``parity compare``.

B's grid is read from its file: each value's step is its group's scale, its zero its group's zero point, its codes
the integers the bits allow.  The conversion deviation is what round-to-nearest on that grid (A's values, B's own
scales and zeros) does to A's output.  GPTQ does not round to nearest: it compensates each column's rounding error in
the columns not yet quantized, so its values lie more than one step from A's (measured on the tests' GPTQ-like fixture:
up to ``MEASURED_GPTQ_STEPS`` steps) while the layer's function stays close.  A genuine export is therefore judged by
the function: B's layer output against A's, within ``FACTOR`` x the round-to-nearest deviation; the per-value
distances in steps are reported as evidence only, never a verdict of their own.

The conversion mistakes a writer or reader of these formats makes are replayed on A's tensor, each as A quantized on
B's grid and then read back the way the mistake reads it: the zero point off by one (GPTQ's v1 format stores it minus
one), AWQ's packed order read linearly (codes and zero points of each eight outputs in the wrong places), and an
act-order ``g_idx`` ignored (each input column read with the group of its position, not the group it was quantized
in).  Bits mismatched, another group size and transposed scales change the packed shapes and are refused where the
file is read (``int_groups``: QuantizedLayoutError).

Everything here works in the layout the file stores ([out, in]); ``conversion`` routes it to the reference's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from parity.engine.compare.storage import Storage, least_squares_scales, rms_distance
from parity.engine.layer import route_tensor
from parity.sources.int_storage import AWQ_ORDER  # AWQ's packing: field i of each int32 holds column AWQ_ORDER[i]

# B's function may deviate from A's by this many times what round-to-nearest on B's own grid does.  Measured on
# tests/test_quantized_int.py's fixtures (tiny LLaMA, int4, groups of 32, parity's seeded inputs): the GPTQ-like export
# (each column's rounding error compensated in the later columns through a Hessian of correlated inputs, act order)
# at 1.01 to 1.15 x round-to-nearest, AWQ with its scales undone at 0.99 to 1.04 x; an act-order g_idx ignored on one
# tensor at 3.9 x, AWQ's packed order read linearly at 4.7 x.  A real GPTQ's Hessian (outlier channels) lets it trade
# more error along the inputs its calibration rarely saw, which parity's inputs do not spare: hence 3 x, not 2 x.  A
# zero point off by one on one tensor sits at 3.0 x (round to nearest) but 1.58 x under GPTQ's own error: that is
# caught by its bias (BIAS_LIMIT), not by the function.
FACTOR = 3.0
MEASURED_GPTQ_STEPS = 2.1  # the farthest value of the GPTQ-like fixture from A's, in its group's steps (2.08)
# A faithful export's values lie on either side of A's (round to nearest, or GPTQ's compensation, which spreads each
# rounding error over later columns with both signs): the mean signed distance of a whole tensor from round-to-nearest
# on its grid stays near zero (the GPTQ-like fixture's 14 matrices: |mean| 0.007 steps at most), where a zero point one
# code off moves every value a step the same way.  Beyond this mean a tensor is biased, whatever its function shows.
BIAS_LIMIT = 0.5
# B's own grid is the reference unless it rounds A this many times worse (root mean square) than min-max in B's groups
# does: then it is no grid of A's (another group's scales, a g_idx lost) and the min-max one bounds the honest error.
# Measured on the fixtures: GPTQ's, AWQ's (in the file's values, its scales folded) and pack-quantized's own grids
# 0.99 to 1.01 x; act-order codes read without their g_idx 3.4 to 4.6 x.  A clipping quantizer (AWQ's auto_clip,
# GPTQ's mse search) makes its own grid rounder than min-max, not rougher.  On llm-compressor 0.14's own exports of a
# trained tiny LLaMA (GPTQ W4A16 groups of 128 and 32, act order "weight" and none; AWQ asymmetric, its scales undone)
# every FFN matrix's own grid is 0.986 to 1.012 x; with gate and up exchanged in the AWQ export each of them sits on
# the other's grid at 1.48 to 1.53 x, which rounds A loosely enough to let the exchange pass under FACTOR: hence 1.25.
SOUND = 1.25
# A GPTQ export trades its error onto the input channels its calibration rarely excites (a real model's activations
# have outlier channels), which parity's isotropic inputs weigh fully.  Measured per layer against round-to-nearest
# on B's grid: the GPTQ-like quantizer of tests/test_quantized_int.py on a Hessian with four input channels x30 over
# channel scales 0.1 to 3 and four strong directions (a reviewer's script; act order off, groups of 32 and 128,
# symmetric and not) at 2.1 to 5.8 x (act order on: 0.8 to 1.8 x), on eight directions and channel scales 0.2 to 2
# (tests/test_quantized_gptq_outliers.py) at 1.3 to 3.0 x; llm-compressor 0.14's own GPTQ exports of a trained tiny
# LLaMA and Qwen2 whose post-attention norms carry four channels x20 to x100, or whose residual carries three massive
# dimensions (groups of 128 and 32, act order none and "weight", symmetric and not) at 0.78 to 2.08 x on parity's
# inputs, 0.1 to 0.5 x per matrix on A's own activations of its calibration text (the LLaMA with the norm channels);
# gptqmodel 7.7.0's own GPTQ exports of the same two with the norm channels (int4, groups of 128 and 32, desc_act off
# with and without its group-aware reordering, and on; symmetric and not) at 0.36 to 2.30 x, whose layers' caps
# (WIDEST cut) were 6.9 to 8 x: the reviewer's 4.1 to 5.8 x against the cut cap is not what the tool writes.
# Such an export is recognised by its values, not its function: every quantized matrix of the
# layer on a grid of A's (within SOUND), unbiased (within BIAS_LIMIT), at most COMPENSATED[1] of its codes off A's
# round-to-nearest codes (GPTQ moves a code only where the compensation carried over from earlier columns crosses a
# rounding boundary: 5.3 to 30 % of the codes of every matrix measured above; gptqmodel 7.7.0's: 4 to 22 % at 2, 3, 4
# and 8 bits) and one matrix at least COMPENSATED[0]
# (round to nearest moves none; AWQ, which rounds to nearest, is never taken for it: its folded scales undone leave
# 3 to 4 % of its codes off).  Its function is then held to GPTQ_FACTOR x round-to-nearest's deviation.  What the
# mistakes do to the values of the matrix they hit, on the test's and the reviewer's exports: a zero point off by
# one moves 89 to 92 % of its codes a step one way (bias -0.97 steps), an act-order g_idx ignored puts it on a grid
# 1.33 x rougher than min-max with 40 % of its codes moved, a scale doubled 1.94 x rougher (76 % moved), gate and up
# exchanged or a layer shifted 1.33 to 1.39 x (91 % moved), AWQ's packed order read linearly 1.26 to 1.49 x (66 to
# 69 % moved): each such layer keeps FACTOR.
COMPENSATED = (0.05, 0.35)
# ... and from CONVERTED_GROUP_BITS, where B's factor on A's conversion holds each matrix's scale, up to this share:
# llm-compressor 0.14's GPTQ moves 44 to 48 % of gate's and up's codes beside input channels x 30
# (MOVED_LIMIT's note), the mistakes measured that stay on a grid of A's move 91 % (gate and up exchanged, a layer
# shifted; AWQ's packed order read linearly, 66 to 69 %, is 1.26 x rougher than min-max: beyond SOUND).
COMPENSATED_WIDE = 0.6
# Integer groups from 4 bits: a reviewer's GPTQ (lazy batches, calibration channels x300) held 120 faithful 4-bit
# exports' least-squares factor on A's conversion at 0.953 to 1.032 and 3-bit ones at 0.90 to 1.062, so 3 bits are
# not held to it (conversion.CONVERTED_GROUP_SCALE)
CONVERTED_GROUP_BITS = 4
# A matrix with more than this share of its codes off A's round-to-nearest codes on B's own grid is held to its values
# whatever its layer's function shows: at 2 and 3 bits round to nearest moves the output so far that 3 x its deviation
# passed gptqmodel 7.7.0's exports with gate and up exchanged (int3: 79 % of their codes moved, x 2.04), up's scales
# halved (int3: 69 %, x 2.87) or gate's act-order g_idx permuted (int2: 46 %, x 1.96).  Every faithful export measured
# moves 30 % at most (llm-compressor's GPTQ with outlier norms; gptqmodel's 22 %, the tests' GPTQ-like 35 % cap);
# the mistakes measured move 42 % (a g_idx rolled by one group) to 92 %.  Below 4 bits only: llm-compressor 0.14's
# own GPTQ (W4A16 and W8A16, groups of 128, on a Qwen2 whose post-attention norms hold 4 channels x 30) moves 44 to
# 48 % of gate's and up's codes, on A's grid (roughness 1.00) and unbiased (|bias| <= 0.002 steps), with the layer at
# 2.1 to 4.6 x round to nearest; from 4 bits a scale mistake is B's factor on A's conversion, gate and up exchanged
# the function (CONVERTED_GROUP_BITS).
MOVED_LIMIT = 0.4
GPTQ_FACTOR = 8.0  # the reviewer's Hessian's 5.8 x with room: the mistakes are carried by the values, not by this
# ... and never to more than this share of the reference output's largest magnitude (a tolerance as large as the output
# would pass a module that outputs zeros: the layer would be unverifiable, where FACTOR alone may have judged it)
WIDEST = 0.5
# A layer past WIDEST is judged by its values alone (``layer_factor``), so its every matrix must sit on B's grid as
# closely as a faithful export's own grid rounds A: GPTQ's own grids are 0.986 to 1.012 x min-max's (SOUND's note;
# the tests' GPTQ-like exports on a broad calibration, ``broad_hessian``: 1.00 to 1.01), where act-order codes in two
# groups of 128 read without their g_idx sit 1.09 x (its layer 3.92 x round to nearest's deviation, past the cut).
OWN_GRID = 1.05


ROUND_BEFORE_ZERO = ("gptq", "awq")  # the methods whose quantizer rounds before it adds the zero point (Grid.codes)


@dataclass
class Grid:
    """B's grid per value (stored layout [out, in]): its step (the group's scale), its zero (code units), the codes'
    range; the grid by group (``scales``/``zeros`` [out, groups], ``g_idx``), for the replays."""

    steps: torch.Tensor
    zeros: torch.Tensor
    low: int
    high: int
    scales: torch.Tensor
    group_zeros: torch.Tensor
    g_idx: torch.Tensor
    method: str
    bits: int
    factor: torch.Tensor | float = 1.0  # per value: what ``folds`` multiplied B's file values by (AWQ's scales undone)
    fold: str | None = None  # what ``folds`` undid, in words
    whole: bool = False  # one group for the whole matrix (strategy "tensor"): min-max spans every row

    def codes(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` rounded to the nearest code of each value's group (clamped to the codes' range), as its writer
        rounds a half step: GPTQ and AWQ round x / scale, then add the zero point (GPTQModel's and AutoAWQ's
        ``round(w / scales) + zeros``), compressed-tensors adds it first (its ``_quantize``: ``x / scale +
        zero_point``, then rounds); torch rounds half to even, so an odd zero point splits the two."""
        safe = torch.where(self.steps != 0, self.steps, torch.ones_like(self.steps))
        scaled = x.float() / safe
        rounded = (torch.round(scaled) + self.zeros if self.method in ROUND_BEFORE_ZERO
                   else torch.round(scaled + self.zeros))
        return torch.clamp(rounded, self.low, self.high)

    def values(self, codes: torch.Tensor, *, steps: torch.Tensor | None = None, zeros: torch.Tensor | None = None):
        """Codes dequantized on this grid (or on ``steps`` / ``zeros`` given per value)."""
        steps = self.steps if steps is None else steps
        return (codes - (self.zeros if zeros is None else zeros)) * steps


def by_awq(grid) -> bool:
    """Whether ``grid`` was written by AWQ: its method says so, or its scales were folded into the norm and up/down
    (``folds``, undone).  AWQ clips each group's range and rounds to nearest on its grid; GPTQ compensates."""
    return grid.method == "awq" or grid.fold is not None


def grid_of(held, bits: int) -> Grid:
    """The per-value grid of one matrix as ``int_storage.GroupQuantized`` holds it."""
    steps = held.scales[:, held.g_idx]
    zeros = held.zeros[:, held.g_idx]
    return Grid(steps, zeros, held.low, held.high, held.scales, held.zeros, held.g_idx, held.method, bits,
                whole=held.whole)


# B's least-squares factor on A (storage.least_squares_scales) for integer-group matrices: whole tensor and each row
# within SCALE, each group within GROUP_SCALE.  Measured on gptqmodel 7.7.0's own GPTQ exports of a trained tiny
# LLaMA and Qwen2 (14 exports: 2, 3, 4 and 8 bits, groups of 32 and 128, act order on and off, outlier norm
# channels x20-x100): tensors 0.992-1.000, rows 0.898-1.103 (2 bits; 4 bits 0.936-1.082), groups 0.68-1.295 (2
# bits; 4 bits 0.865-1.177).  GPTQ moves values by more than a step, but each group's scale is still fitted to the
# group's values; a group, a row or the matrix multiplied, negated or zeroed after quantizing is not (one group x2
# and one row x1.5 of a GPTQ export passed under the layer's tolerance before this rule).
SCALE = (0.8, 1.2)
GROUP_SCALE = (0.5, 1.6)
# At 2 bits a row's and a group's factor say nothing: gptqmodel 7.7.0's int2 act-order export (groups of 32) of the
# Gemma 3 270M stand-in (d 640, d_ff 2048) has a row at 0.7987 and groups at -2.2, -1.17 and 0.47 (four levels: GPTQ's
# compensation outweighs a group's own values), and failed quantization_exceeds_step on two faithful layers.  There
# only the whole matrix is held to SCALE.
ANY = (-math.inf, math.inf)
# AWQ clips each group's range before rounding (its clip search shrinks a group's largest magnitude by up to half:
# gptqmodel 7.7.0's looper/awq_processor.py ``_compute_best_clip(max_shrink=0.5)``, as AutoAWQ's auto_clip), so a
# group whose largest values were clipped scales below A's, never above: gptqmodel's AWQ GEMM export of the Qwen2.5
# 0.5B stand-in (d 896, d_ff 4864, groups of 128) has a down_proj group at 0.467 (its fold undone by least squares),
# every other worst group of its three layers 0.69-0.85.  Its groups are held to AWQ_GROUP_SCALE; tensor and rows to
# SCALE as GPTQ's.
AWQ_GROUP_SCALE = (0.35, GROUP_SCALE[1])


# A row of B (every group of it; the whole matrix for strategy "tensor") whose codes reach less than this share of
# their group's longer side, |code - zero| / max(high - zero, zero - low), holds a grid coarser than its own values
# need: every quantizer of these formats picks a group's scale from the values it then rounds (min-max; AWQ's clip and
# GPTQ's mse search shrink it, never widen it), so the code of the group's largest magnitude lands at that side's end,
# within a rounding: 7 of 8 at 4 bits, 3 of 4 at 3.  Measured on the tests' faithful exports (test_quantized_int.py,
# test_quantized_gptqmodel.py): every row of the GPTQ-like one (act order and sequential, symmetric and not), AWQ with
# its scales folded, pack-quantized W4A16 (groups of 32 and per channel, symmetric and not), int-quantized W8A8 and a
# 3-bit GPTQModel export reaches 0.875 at least (one group alone, under GPTQ's compensation within it, 0.78); a row's
# scales doubled over codes halved reaches 0.5 to 0.57, x1.5 0.67, which the function passed (one row of 128 moves
# the layer's output little) and no least-squares factor sees (its values barely move).  At 2 bits a faithful
# symmetric group may reach 1 of its 2, no farther than a halved one: not judged there (REACH_BITS).
REACH = 0.7
REACH_BITS = 3
# ... and only where its scale is more than this many times what A's values in that group call for by min-max: GPTQ
# fits a group's scale to its values as compensated by the earlier columns, then may move the group's largest value
# inward by several codes (the tests' GPTQ-like quantizer on a rank-32 calibration with four channels x30: a row of
# up_proj reaching 6 of 9 codes, its scale A's min-max one, 1.00 x, was called grid_too_coarse).  B's scale over A's
# min-max need in each row's farthest-reaching group, on every faithful export measured (the tests' GPTQ-like one on
# rank-8 and rank-32 calibrations and on uneven channel scales, llm-compressor 0.14's W4A16 and W8A16 on a Qwen2 with
# norm channels x30): 1.19 at most; a row's scales x1.5 over its codes: 1.5, doubled 2.
COARSER = 1.3


def coarse_rows(x: torch.Tensor, held: torch.Tensor, grid: Grid) -> dict | None:
    """Rows of B (stored layout; ``held``: B's values, ``x``: A's) whose codes reach less than ``REACH`` of their
    group's longer side in every group of the row (the matrix, for one scale per tensor), with a step more than
    ``COARSER`` x what A's values there call for by min-max: a step larger than the row's values need.  The worst
    row, with the group it reaches farthest in and A's step there, or None; rows holding only their zero points are
    left to the scales (``value_scales``)."""
    if grid.bits < REACH_BITS:
        return None
    steps = grid.steps.abs()  # ``folds`` multiplied the steps with the values: codes are B's values over them
    codes = torch.where(steps > 0, held.float().abs() / _safe(steps), torch.zeros_like(steps)).round()
    side = torch.maximum(grid.high - grid.group_zeros, grid.group_zeros - grid.low).clamp_min(1)
    index = grid.g_idx.expand(codes.shape[0], -1)
    reached = torch.zeros_like(side).scatter_reduce(1, index, codes, "amax", include_self=True) / side
    need = min_max_steps(x.float() / torch.as_tensor(grid.factor).expand_as(x), grid, side)  # in the file's values
    if grid.whole:  # one scale for the matrix: its farthest code anywhere
        reached = reached.amax().expand_as(reached)
    reach, group = reached.max(1)
    chosen = grid.scales.abs().gather(1, group[:, None])[:, 0]
    wanted = need.gather(1, group[:, None])[:, 0]
    coarser = torch.where(wanted > 0, chosen / _safe(wanted), torch.full_like(chosen, math.inf))
    short = (reach > 0) & (reach < REACH) & (coarser > COARSER)
    if not bool(short.any()):
        return None
    worst = int(torch.where(short, reach, math.inf).argmin())
    group_at = int(group[worst])
    return {"rows_too_coarse": int(short.sum()), "rows": len(reach), "row": worst, "group": group_at,
            "columns": int((grid.g_idx == group_at).sum()), "b_step": float(chosen[worst]),
            "a_step": float(wanted[worst]), "reach": float(reach[worst] * side[worst, group_at]),
            "top": float(side[worst, group_at]), "times_coarser": float(coarser[worst])}


def min_max_steps(values: torch.Tensor, grid: Grid, side: torch.Tensor) -> torch.Tensor:
    """The step min-max picks for ``values`` [out, in] in each of ``grid``'s groups [out, groups]: the largest
    magnitude over the longer side (symmetric), else the range with 0 in it over the codes' span."""
    if grid.whole:  # one group: the matrix
        top = float(values.abs().max()) / side.max() if symmetric(grid) else \
            (values.clamp(min=0).max() - values.clamp(max=0).min()) / (grid.high - grid.low)
        return torch.as_tensor(top, dtype=side.dtype).expand_as(side)
    index = grid.g_idx.expand(values.shape[0], -1)
    empty = torch.zeros_like(side)
    if symmetric(grid):
        return empty.scatter_reduce(1, index, values.abs(), "amax", include_self=True) / side
    top = empty.scatter_reduce(1, index, values.clamp(min=0), "amax", include_self=True)
    bottom = empty.scatter_reduce(1, index, values.clamp(max=0), "amin", include_self=True)
    return (top - bottom) / (grid.high - grid.low)


# A row of B whose codes leave one level in k of their grid empty (k of 2 or 3, at most the codes' levels / 4) where
# A's values rounded to nearest on the same grid (its own scales and zero points) fill it: the row holds at most
# SKIP_LEFT of the codes A's rounding puts on that residue of (code - zero) mod k, and that is at least SKIP_MIN codes
# (one level in 4 is one in 2 already).  Round to nearest fills every level its values cross, and GPTQ's compensation
# moves a code a level or two either way (5 to 35 % of them, COMPENSATED), so each residue keeps about A's count;
# codes rounded onto every other level, the scales kept (a grid twice as coarse passed off as the stated one), leave
# a residue empty with every value within a step of A's and the function within twice round to nearest's error: one
# such row of 128 passed, a whole matrix failed only as quantization_exceeds_step.  Measured on the tests' exports
# (tests/test_quantized_int.py, test_quantized_gptqmodel.py, test_quantized_gptq_outliers.py: pack-quantized W4A16
# and W8A16, int-quantized W8A8 and W4A8, the GPTQ-like one with act order and outlier Hessians, symmetric and not,
# AWQ folded, 3-bit GPTQModel layout; faithful, and with every other mistake they test): the emptiest residue of any
# row keeps 0.54 of A's count at k = 2, 0.48 at k = 3; a row on every other level 0.07 at most (its top code clamped
# back onto an odd one), every row 0.016; every third level (k = 3) 0.000.
SKIP_MAX = 3
SKIP_LEFT = 0.2
SKIP_MIN = 16


def skipped_levels(x: torch.Tensor, held: torch.Tensor, grid: Grid) -> dict | None:
    """Rows of B (stored layout; ``held``: B's values, ``x``: A's) whose codes leave one level in k of their grid
    empty where A's values rounded to nearest on it fill it (``SKIP_LEFT``, ``SKIP_MIN``): the worst row, with k, the
    residue and both counts, for the smallest k any row skips; None where none does."""
    b = torch.round(held.float() / _safe(grid.steps))  # B's code - zero (``folds`` scaled values and steps alike)
    a = grid.codes(x) - grid.zeros  # A's round to nearest on B's grid, code - zero
    for k in range(2, min(SKIP_MAX, (grid.high - grid.low + 1) // 4) + 1):
        counts = [torch.stack([(torch.remainder(v, k) == r).sum(1) for r in range(k)], 1) for v in (a, b)]
        left = counts[1].float() / counts[0].clamp_min(1).float()
        empty = (counts[0] >= SKIP_MIN) & (left <= SKIP_LEFT)
        if not bool(empty.any()):
            continue
        rows = empty.any(1)
        worst = int(torch.where(empty, left, math.inf).amin(1).argmin())
        residue = int(torch.where(empty[worst], left[worst], math.inf).argmin())
        return {"levels_skipped": int(rows.sum()), "rows": len(rows), "row": worst, "one_in": k, "residue": residue,
                "b_count": int(counts[1][worst, residue]), "a_count": int(counts[0][worst, residue]),
                "codes": int(held.shape[1])}
    return None


def value_scales(x: torch.Tensor, held: torch.Tensor, grid: Grid) -> dict:
    """B's least-squares factor on A (stored layout [out, in]) per matrix, row and group (the columns of each group
    gathered by g_idx, act order's included), against ``SCALE`` and ``GROUP_SCALE`` (``AWQ_GROUP_SCALE`` for an AWQ
    export, whose clip search shrinks groups)."""
    order = torch.argsort(grid.g_idx, stable=True)
    counts = torch.bincount(grid.g_idx)
    size = int(counts.max()) if bool((counts == counts.max()).all()) else x.shape[1]  # unequal: each row one group
    if grid.bits <= 2:
        found = least_squares_scales(x[:, order], held[:, order], size, bounds=ANY, block_bounds=ANY)
        found["beyond"] = not SCALE[0] <= found["tensor"] <= SCALE[1]
        found["bounds"] = list(SCALE)
        return found
    return least_squares_scales(x[:, order], held[:, order], size, bounds=SCALE,
                                block_bounds=AWQ_GROUP_SCALE if by_awq(grid) else GROUP_SCALE)


def stored(checkpoint, key: str, route) -> Storage | None:
    """How an integer group-quantized checkpoint stores tensor ``key`` (each value's grid read from the file), None
    for a tensor stored unquantized (or another checkpoint)."""
    grouped = getattr(checkpoint, "grouped", None)
    held = grouped(key) if grouped is not None else None
    if held is None:
        return None
    bits = held.bits
    grid = grid_of(held, bits)
    bad = ~torch.isfinite(held.scales)
    problem = None
    if bool(bad.any()):
        first = [int(i) for i in bad.nonzero()[0]]
        problem = (f"group {first} (scale {float(held.scales[tuple(first)])}): {int(bad.sum())} of {bad.numel()} "
                   "groups have a NaN/Inf scale")
    zeroed = bool((held.codes.float() == grid.zeros).all())
    return Storage(f"int{bits}", quantized=True, steps=route_tensor(route, grid.steps.abs()), step_source="file",
                   route=route, nonfinite_scale=problem, group=grid, zeroed=zeroed)


def symmetric(grid: Grid) -> bool:
    """Whether B's grid keeps one zero point for every group (a symmetric scheme)."""
    return bool((grid.group_zeros == grid.group_zeros.reshape(-1)[0]).all())


def round_to(x: torch.Tensor, grid: Grid) -> torch.Tensor:
    """A's matrix (stored layout) rounded to the nearest point of B's grid: what a faithful round-to-nearest
    export with B's scales and zeros holds."""
    return grid.values(grid.codes(x))


def bias(x: torch.Tensor, b: torch.Tensor, grid: Grid, *, reference: torch.Tensor | None = None) -> float:
    """The mean signed distance, in steps, of B's values (stored layout) from ``reference`` (default: A rounded to
    the nearest point of B's grid), over the values whose step is not zero."""
    reference = round_to(x, grid) if reference is None else reference
    live = grid.steps != 0
    if not bool(live.any()):
        return 0.0
    return float(((b.float() - reference) / _safe(grid.steps))[live].mean())


def minmax(x: torch.Tensor, grid: Grid) -> torch.Tensor:
    """A's matrix (stored layout) quantized by min-max in B's groups (its g_idx, bits and code range): each group's
    step its range over the codes (symmetric where B's zero points are one constant: its largest magnitude over half
    the codes), the zero point the code of 0.  What a plain round-to-nearest quantizer makes of A in that layout,
    in the file's values (``factor``, AWQ's scales, undone first and applied again after)."""
    x = x.float() / grid.factor
    index = grid.g_idx.expand(x.shape[0], -1)
    shape = (x.shape[0], grid.scales.shape[1])
    high = torch.zeros(shape).scatter_reduce(1, index, x, "amax", include_self=True)
    low = torch.zeros(shape).scatter_reduce(1, index, x, "amin", include_self=True)
    if grid.whole:  # one scale for the matrix: its range is every row's
        high, low = high.amax(0, keepdim=True).expand(shape), low.amin(0, keepdim=True).expand(shape)
    span = grid.high - grid.low
    zeros = grid.group_zeros
    if symmetric(grid):  # the zero point B's grid keeps
        scales = torch.maximum(high, -low) / (span / 2)
    else:
        scales = (high - low) / span
        zeros = torch.clamp(grid.low - torch.round(low / _safe(scales)), grid.low, grid.high)
    steps, per_value = _safe(scales)[:, grid.g_idx], zeros[:, grid.g_idx]
    codes = torch.clamp(torch.round(x / steps + per_value), grid.low, grid.high)
    return (codes - per_value) * steps * grid.factor


def roughness(x: torch.Tensor, grid: Grid) -> float:
    """How many times worse (root mean square) B's own grid rounds A's matrix (stored layout) than min-max in B's
    groups does: about 1 for a grid of A's, beyond ``SOUND`` for one that is not."""
    errors = [rms_distance(values, x) for values in (round_to(x, grid), minmax(x, grid))]
    return errors[0] / errors[1] if errors[1] else 1.0


def moved(b: torch.Tensor, reference: torch.Tensor, grid: Grid) -> float:
    """The share of B's values (stored layout) more than half a step from ``reference``'s: codes that differ."""
    live = grid.steps != 0
    off = ((b.float() - reference).abs() > 0.5 * _safe(grid.steps).abs()) & live
    return float(off.float().sum() / max(1, int(live.sum())))


def reference(x: torch.Tensor, grid: Grid) -> tuple[torch.Tensor, str]:
    """What a faithful export holds of A's matrix (stored layout), and how it was made: round to nearest on B's own
    grid, unless that grid rounds A more than ``SOUND`` x worse (root mean square) than min-max in B's groups does
    (a grid that is not A's: scales of other groups, a g_idx lost), then the min-max one, saying so."""
    own = round_to(x, grid)
    plain = minmax(x, grid)
    errors = [rms_distance(values, x) for values in (own, plain)]
    if errors[0] > SOUND * errors[1]:
        return plain, (f"quantized by min-max in B's groups (int{grid.bits}): B's own grid rounds A's values "
                       f"{errors[0] / errors[1]:.1f} x worse (root mean square) than that, so it is no grid of A's")
    return own, describe(grid)


def describe(grid: Grid) -> str:
    return (f"rounded to the nearest int{grid.bits} code of B's own grid (each group's scale and zero point read "
            f"from the file{', act-order g_idx' if grid_order(grid) else ''})"
            + (f"; folded activation scales (AWQ's, SmoothQuant's) undone: {grid.fold}" if grid.fold else ""))


def grid_order(grid: Grid) -> bool:
    """Whether B's g_idx is act-order (not each column's position // group size)."""
    size = max(1, -(-grid.g_idx.numel() // grid.scales.shape[1]))
    return not bool(torch.equal(grid.g_idx, torch.arange(grid.g_idx.numel()) // size))


def zero_shift(x: torch.Tensor, grid: Grid, shift: int) -> torch.Tensor:
    """A quantized with zero points ``shift`` codes below the ones B's reader uses (a v1 file written without the
    minus one, or the reverse), read back with B's."""
    return grid.values(torch.clamp(torch.round(x.float() / _safe(grid.steps) + grid.zeros - shift), grid.low,
                                   grid.high))


def _safe(steps: torch.Tensor) -> torch.Tensor:
    return torch.where(steps != 0, steps, torch.ones_like(steps))


def linear_order(x: torch.Tensor, grid: Grid, *, zeros_too: bool) -> torch.Tensor | None:
    """A quantized as AWQ means it, its codes (and with ``zeros_too`` its zero points) packed in the linear order
    and read back in AWQ's: output row 8c + AWQ_ORDER[i] receives row 8c + i.  None where the rows are not
    whole words of eight."""
    rows = x.shape[0]
    if grid.method != "awq" or grid.bits != 4 or rows % 8:
        return None
    source = torch.arange(rows).reshape(-1, 8)
    target = torch.empty_like(source)
    target[:, list(AWQ_ORDER)] = source  # read row 8c + order[i] <- written row 8c + i
    target = target.reshape(-1)
    meant = grid.zeros
    if zeros_too:  # the zero each written row was quantized with: read row r holds written row target[r]'s
        meant = torch.empty_like(grid.zeros)
        meant[target] = grid.zeros
    codes = torch.clamp(torch.round(x.float() / _safe(grid.steps) + meant), grid.low, grid.high)
    return grid.values(codes[target])


def g_idx_ignored(x: torch.Tensor, grid: Grid) -> torch.Tensor | None:
    """A quantized in the groups that fit its columns best (act-order: each column's group is where its values
    land nearest a group's grid), read back with B's g_idx: what a writer that quantized with act-order and stored a
    sequential g_idx (or none) holds.  None when the best-fitting groups are B's own.  Worked in the file's values
    (``factor`` undone: the groups' scales are the file's)."""
    x = x.float() / grid.factor
    errors = []
    for g in range(grid.scales.shape[1]):
        step, zero = grid.scales[:, g:g + 1], grid.group_zeros[:, g:g + 1]
        codes = torch.clamp(torch.round(x / _safe(step) + zero), grid.low, grid.high)
        errors.append(((codes - zero) * step - x).pow(2).sum(0))
    best = torch.stack(errors).argmin(0)
    if bool(torch.equal(best, grid.g_idx)):
        return None
    steps, zeros = grid.scales[:, best], grid.group_zeros[:, best]
    codes = torch.clamp(torch.round(x / _safe(steps) + zeros), grid.low, grid.high)
    return grid.values(codes, steps=grid.steps / grid.factor) * grid.factor


def mistakes(x: torch.Tensor, grid: Grid) -> list[tuple[str, str, torch.Tensor]]:
    """The integer group conversion mistakes that keep B's packed shapes, each as (mistake id, detail, A's matrix
    as the broken export reads back; stored layout)."""
    found = [("zero_point_off_by_one", f"zero points {'+1' if shift > 0 else '-1'} from the ones A was quantized "
              "with (GPTQ's v1 format stores them minus one)", zero_shift(x, grid, shift)) for shift in (1, -1)]
    for zeros_too in (True, False):
        values = linear_order(x, grid, zeros_too=zeros_too)
        if values is not None:
            found.append(("packed_order_wrong", "qweight" + (" and qzeros" if zeros_too else "") + " packed in the "
                          "linear order 0..7, read in AWQ's 0 2 4 6 1 3 5 7", values))
    moved = g_idx_ignored(x, grid)
    if moved is not None:
        found.append(("g_idx_ignored", "quantized in act-order groups, read with g_idx's groups by position", moved))
    return found


def compensation(x: torch.Tensor, b: torch.Tensor, grid: Grid) -> dict:
    """How B's values (stored layout) sit against A's rounded to nearest on B's grid: the fraction of codes that
    differ (``moved``), the mean signed distance in steps (``bias``), and how much rougher than min-max in B's groups
    B's grid rounds A (``rough``, root mean square)."""
    own = round_to(x, grid)
    return {"moved": moved(b, own, grid), "bias": bias(x, b, grid, reference=own), "rough": roughness(x, grid)}


def any_biased(tensors: dict[str, tuple[torch.Tensor, torch.Tensor, Grid]]) -> bool:
    """Whether a matrix of the layer (as for ``layer_factor``) sits off A's round to nearest one way, beyond
    ``BIAS_LIMIT``: no compensation of GPTQ's, whose moves go either way."""
    return any(abs(bias(x, b, grid)) > BIAS_LIMIT for x, b, grid in tensors.values())


class LayerFactor(NamedTuple):
    """What ``layer_factor`` holds a layer's function to: the factor on round-to-nearest's deviation, the rule in
    words, and ``by_values``: why the function cannot judge the layer (its tolerance then reaches the output's
    magnitude, and comparison.by_values holds every matrix to its values), or None."""

    factor: float
    rule: str
    by_values: str | None = None


def layer_factor(tensors: dict[str, tuple[torch.Tensor, torch.Tensor, Grid]], *, room: float,
                 ratio: float = 0.0) -> LayerFactor:
    """The factor on round-to-nearest's deviation a layer's function is held to, and the rule in words: GPTQ_FACTOR
    where every integer group-quantized matrix (name: A's and B's values in stored layout, B's grid) is compensated
    as GPTQ compensates (on a grid of A's, unbiased, a share of its codes moved within COMPENSATED, one at least
    beyond its low end), else FACTOR.  ``room``: the reference output's largest magnitude over round-to-nearest's
    deviation (GPTQ_FACTOR is cut to WIDEST x that, never below FACTOR); ``ratio``: B's deviation over
    round-to-nearest's.  A compensated layer past the cut but within GPTQ_FACTOR is judged by its values: its
    function lies as far from A's as GPTQ's compensation moves it, and no tolerance that far can tell a mistake."""
    seen = {name: compensation(x, b, grid) for name, (x, b, grid) in tensors.items()}
    shown = ", ".join(f"{name} {s['moved']:.0%} (grid {s['rough']:.2f} x min-max's, bias {s['bias']:+.2f} steps)"
                      for name, s in seen.items())
    low = COMPENSATED[0]
    caps = {name: COMPENSATED_WIDE if grid.bits >= CONVERTED_GROUP_BITS else COMPENSATED[1]
            for name, (_, _, grid) in tensors.items()}
    high = max(caps.values(), default=COMPENSATED[1])
    honest = all(s["rough"] <= SOUND and abs(s["bias"]) <= BIAS_LIMIT and s["moved"] <= caps[name]
                 for name, s in seen.items())
    rounded = any(by_awq(grid) for _, _, grid in tensors.values())  # AWQ: round to nearest
    if not (seen and honest and not rounded and any(s["moved"] >= low for s in seen.values())):
        return LayerFactor(FACTOR, f"integer groups: {FACTOR:g} x" + (f" (codes off round-to-nearest: {shown})"
                                                                        if seen else ""))
    factor = max(FACTOR, min(GPTQ_FACTOR, WIDEST * room))
    held = (f"every matrix is unbiased on a grid of A's with at most {high:.0%} of its codes off A's round-to-nearest "
            f"codes ({shown})")
    if factor < ratio <= GPTQ_FACTOR and all(s["rough"] <= OWN_GRID for s in seen.values()):
        return LayerFactor(max(GPTQ_FACTOR, room), f"GPTQ's compensation, past {factor:.3g} x", by_values=(
            f"GPTQ's compensation moves B's output {ratio:.2f} x as far from A's as round to nearest does, past the "
            f"{factor:.3g} x that keeps the tolerance within {WIDEST:.0%} of the output's largest magnitude (within "
            f"GPTQ's {GPTQ_FACTOR:g} x), so no tolerance admitting it could tell a mistake; {held}"))
    return LayerFactor(factor, f"GPTQ's compensation: {factor:.3g} x, since {held}")
