"""FP4 groups judged against their own grid, for ``parity compare``: GPT-OSS's MXFP4 experts
(``parity.sources.mxfp4_experts``) and compressed-tensors' nvfp4- and mxfp4-pack-quantized weights
(``parity.sources.fp4_packed``).  Each value is an e2m1 code times its group's scale (GPT-OSS and MXFP4: an e8m0
power of two per 32 values; NVFP4: an e4m3 scale per 16 values divided by the tensor's global scale); its step is the
gap beside its code's level (the wider of the two, ``storage.level_steps``) times that scale, both read from the file.

A is rounded onto B's own grid (cast to the dtype B left its other tensors in, then each value to the nearest e2m1
level of its group's scale read from the file) rather than re-quantized: no quantizer of GPT-OSS's layout runs on CPU
(transformers' ``quantize_to_mxfp4`` needs triton's kernels), and the writers of each format choose the scale
differently (OCP's floor(log2(amax)) - 2, as mlx writes it, clips values between 6 and 8 x the scale; ggml's differs
from it on 14 % of a normal matrix's values; llm-compressor's NVFP4 observer divides amax / 6 by its global scale and
rounds to e4m3).  So the function is judged against the rounding onto B's grid, and each group's scale is held to
``GRID_FACTOR`` x the scale A's values there call for (amax / 6, the smallest that clips nothing): every writer's
choice lies within 0.75 to 2 x of it; a power-of-two scale one too high is 1.5 to 4 x.

Everything here works in the reference's layout: each value's scale, level and group are routed as the tensor is
(GPT-OSS's gate and up are a fused tensor's interleaved columns, whose groups run along the inputs of both).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from parity.definitions.mapping import TensorRoute
from parity.engine.compare.storage import Storage, least_squares_factor, level_steps, rms_distance
from parity.engine.layer import route_tensor
from parity.sources.fp4 import e2m1_values

GRID_FACTOR = 2.0 * (1 + 2 ** -7)  # a power-of-two scale over amax / 6 before it is grid_too_coarse (above)
# an e4m3 scale (NVFP4): llm-compressor's is amax / 6 rounded to e4m3 (within 1.07 x of it, and of the global scale's
# rounding), so a group 1.2 x coarser is no rounding of it
FINE_GRID_FACTOR = 1.2
TOP = 6.0  # e2m1's largest magnitude
# B's own grid is A's conversion unless it rounds A this many times worse (root mean square) than B's grid divided by
# B's least-squares factor on A: an NVFP4 global scale stored 6 or 1e30 x off (7.7 x, 10.4 x worse) rounded A onto a
# grid as far from A as B is (the layer unverifiable, exit 2) where it is B's mistake.  The tests' faithful exports'
# own grids round A at most 1.09 x as far as the rescaled one; a power of two off (1.4 to 3.7 x) keeps B's grid,
# where its replay names it (fp4_scale_power_off).
SOUND = 4.0


@dataclass
class Fp4Storage:
    """How B stores one FP4 tensor (one expert's slice), each fact per value in the reference's layout: its code's
    e2m1 level, its group's scale, its group's index in the file ([expert,] out, group) and its own."""

    levels: torch.Tensor
    scales: torch.Tensor
    groups: torch.Tensor
    positions: torch.Tensor  # each value's flat index in the file's [..., out, in]: its byte is position // 2
    per_row: int  # groups per stored row (in / group)
    group: int
    dtype: str = "float32"  # what A is cast to before it is rounded (the dtype B left its other tensors in)
    e4m3_unit: float | None = None  # e4m3 scales (NVFP4): what one unit of the stored scale is worth (1 / global)

    @property
    def factor(self) -> float:
        """How far a group's scale may exceed amax / 6: ``GRID_FACTOR`` for power-of-two scales, ``FINE_GRID_FACTOR``
        for e4m3's."""
        return GRID_FACTOR if self.e4m3_unit is None else FINE_GRID_FACTOR


def stored(checkpoint, key: str, route: TensorRoute, expert: int | None, shape) -> Storage | None:
    """How an FP4 checkpoint stores ``key`` (``expert``'s slice, read as ``shape``: the file's [out, in], or
    transformers' [in, out] where the checkpoint's experts compute x @ W), None for a tensor stored unquantized or a
    checkpoint of another format."""
    held = getattr(checkpoint, "fp4_held", None)
    found = held(key, expert=expert) if held is not None else None
    if found is None:
        return None
    levels, group = found.levels, found.group
    scales = found.scales.float().repeat_interleave(group, dim=-1)
    book = e2m1_values().unique()
    steps = level_steps(book)[torch.searchsorted(book, levels.contiguous())] * scales.abs()
    outputs, inputs = levels.shape[-2], levels.shape[-1]
    per_row = inputs // group
    index = torch.arange(outputs)[:, None] * per_row + torch.arange(inputs)[None, :] // group
    index = index + torch.arange(levels[..., 0, 0].numel()).reshape(levels.shape[:-2] + (1, 1)) * outputs * per_row
    positions = torch.arange(levels.numel()).reshape(levels.shape)
    if tuple(shape) != tuple(levels.shape):  # read in transformers' [..., in, out]
        levels, scales, steps, index, positions = (t.transpose(-1, -2) for t in (levels, scales, steps, index,
                                                                                   positions))
    bad = ~torch.isfinite(scales)
    problem = None
    if bool(bad.any()):
        first = int(index[bad][0])
        problem = (f"group {[first // per_row, first % per_row]}: {int(torch.unique(index[bad]).numel())} of "
                   f"{index.numel() // group} groups have a NaN/Inf scale")
    store = Fp4Storage(*(route_tensor(route, t) for t in (levels, scales, index, positions)), per_row, group,
                       found.dtype, None if found.power_of_two else found.e4m3_unit)
    return Storage(found.name, True, route_tensor(route, steps), "file", route, nonfinite_scale=problem,
                   zeroed=not bool(levels.any()), fp4=store)


def rounded(a: torch.Tensor, store: Fp4Storage, scales: torch.Tensor | None = None) -> torch.Tensor:
    """A's tensor (reference layout) cast to the dtype B left its other tensors in, then each value rounded to the
    nearest e2m1 level of its group's scale (``scales``: another grid's, per value; default B's)."""
    scales = store.scales if scales is None else scales
    finite = torch.isfinite(scales) & (scales > 0)
    unit = torch.where(finite, scales, torch.ones_like(scales))
    cast = a.to(getattr(torch, store.dtype)).float()
    scaled = (cast / unit).clamp(-TOP, TOP)
    return torch.where(finite, nearest_level(scaled) * unit, cast)


def nearest_level(scaled: torch.Tensor) -> torch.Tensor:
    """Each value's nearest e2m1 level, a tie to the even code of either sign (0.75 to 1, 2.5 to 2, 3.5 and 5 to 4,
    as compressed-tensors' ``_quantize`` rounds them; the first of two nearest, argmin's, sent 5 to 4 but -5 to -6)."""
    magnitudes = e2m1_values()[:8]  # codes 0-7: 0, 0.5, 1, 1.5, 2, 3, 4, 6
    distance = (scaled.abs()[..., None] - magnitudes).abs()
    nearest = distance == distance.amin(-1, keepdim=True)
    even = nearest & (torch.arange(8) % 2 == 0)
    code = torch.where(even.any(-1), even.int().argmax(-1), nearest.int().argmax(-1))
    return torch.where(scaled < 0, -magnitudes[code], magnitudes[code])


def reference(a: torch.Tensor, storage: Storage) -> tuple[torch.Tensor, str, None]:
    """A's tensor (reference layout) rounded onto B's own grid (``rounded``; no re-quantization, above), and how;
    onto B's grid divided by B's least-squares factor on A where B's own rounds A ``SOUND`` x worse (root mean square)
    than that: a grid a constant off A's (a global scale stored off), saying so."""
    store = storage.fp4
    own = rounded(a, store)
    said = (f"cast to {store.dtype}, rounded to the nearest e2m1 level of B's groups of {store.group}, each group's "
            "scale read from the file")
    factor = least_squares_factor(a, store.levels * store.scales)
    if not math.isfinite(factor) or factor <= 0:
        return own, said, None
    rescaled = rounded(a, store, store.scales / factor)
    errors = [rms_distance(values, a) for values in (own, rescaled)]
    if errors[0] > SOUND * errors[1]:
        return rescaled, (f"{said}, divided by B's least-squares factor on A, {factor:.4g}: B's own grid rounds A's "
                          f"values {errors[0] / max(errors[1], 1e-30):.3g} x worse (root mean square), so it is no "
                          "grid of A's"), None
    return own, said, None


def mistakes(a: torch.Tensor, store: Fp4Storage) -> list[tuple[str, str, torch.Tensor]]:
    """The FP4 conversion mistakes that keep B's shapes, each as (mistake id, detail, A's tensor as the broken export
    reads back; reference layout): each byte's two codes exchanged (the odd value in the low nibble); every scale a
    power of two off (an e8m0 exponent bias of 126 or 128 where the format's is 127, an NVFP4 global scale doubled or
    halved: the codes of one grid read with a scale twice or half theirs)."""
    found = []
    flat = store.positions.reshape(-1)
    where = torch.full((int(flat.max()) + 2,), -1, dtype=torch.long).index_put_((flat,), torch.arange(flat.numel()))
    partner = where[flat ^ 1]
    if bool((partner >= 0).all()):  # both values of every byte are in this tensor (always, but a chunk may split)
        held = rounded(a, store).reshape(-1)
        found.append(("packed_order_wrong", "each byte's two e2m1 codes exchanged (the even value in the high "
                      "nibble)", held[partner].reshape(store.levels.shape)))
    for power in (1, -1):
        factor = 2.0 ** power
        found.append(("fp4_scale_power_off", f"every scale read {'twice' if power > 0 else 'half'} the one its "
                      "codes were chosen for (an exponent bias or a global scale a power of two off)",
                      rounded(a, store, store.scales / factor) * factor))
    return found


def bounds(allowed: torch.Tensor, a: torch.Tensor, store: Fp4Storage) -> tuple[torch.Tensor, dict | None]:
    """Each value's allowed distance from A's (``allowed``: its step), plus, for e4m3 scales, what the scale's own
    rounding clips: a group's scale at or above the e4m3 value just under A's need (amax / 6, in the global scale's
    units) is a writer's rounding of it, and A's values beyond its top level (all of them, for a scale that rounds to
    0) lie as far from it as they exceed it.  Also the groups whose scale is coarser than a writer chooses
    (``coarse_groups``)."""
    needed, scale, present = group_needs(a, store)
    if store.e4m3_unit is None:
        return allowed, coarse_groups(needed, scale, present, store.factor * needed, store)
    below, nearest, above = e4m3_neighbours(needed, store.e4m3_unit)
    rounding = store.scales.abs() >= below[store.groups] * (1 - 2 ** -20)
    top = (store.levels.abs() == TOP) | (store.scales == 0)
    cast = a.to(getattr(torch, store.dtype)).float()
    clip = torch.where(rounding & top, (cast.abs() - TOP * store.scales.abs()).clamp_min(0.0), 0.0)
    # a need that rounds to 0 keeps none of A's bits on any grid: compressed-tensors stores e4m3's eps there instead
    # (0.125 units, 427 x the need of rows x 1e-6 in a matrix of N(0, 0.05)), each value 0 within its step
    limit = torch.where(nearest > 0, torch.maximum(store.factor * needed, above), math.inf)
    return allowed + clip.nan_to_num(0.0), coarse_groups(needed, scale, present, limit, store)


def group_needs(a: torch.Tensor, store: Fp4Storage) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per group (by its index in the file): the scale A's values there call for (their largest magnitude / 6, the
    smallest that clips nothing), B's scale, and whether the tensor holds the group."""
    count = int(store.groups.max()) + 1
    ids = store.groups.reshape(-1)
    amax = torch.zeros(count).scatter_reduce(0, ids, a.float().abs().reshape(-1), "amax", include_self=False)
    scale = torch.zeros(count).scatter_reduce(0, ids, store.scales.abs().reshape(-1), "amax", include_self=False)
    present = torch.zeros(count, dtype=torch.bool).index_fill(0, ids, True)
    return amax / TOP, scale, present


def e4m3_neighbours(needed: torch.Tensor, unit: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The e4m3 scales just under, nearest to and just over each need (equal where it is one), as B's scales read
    (``unit``: what one e4m3 unit is worth, 1 / the global scale). Under e4m3's smallest normal (2^-6) its values are
    2^-9 apart, so a writer's rounding of a small group's need may be 0 or up to twice it (compressed-tensors' NVFP4
    of rows x 1e-5 in a matrix of N(0, 0.05): scales 1.75 x the need on a faithful export, values clipped up to 1.42
    steps)."""
    value = (needed / unit).nan_to_num(0.0).clamp(0.0, float(torch.finfo(torch.float8_e4m3fn).max))
    nearest = value.to(torch.float8_e4m3fn)
    code = nearest.view(torch.uint8).int()
    held = nearest.float()
    up = torch.where(held < value, code + 1, code).clamp_max(0x7E)  # 0x7F is e4m3fn's NaN
    down = torch.where(held > value, code - 1, code).clamp_min(0)

    def scale(codes: torch.Tensor) -> torch.Tensor:
        return codes.to(torch.uint8).view(torch.float8_e4m3fn).float() * unit

    return scale(down), held * unit, scale(up)


def coarse_groups(needed: torch.Tensor, scale: torch.Tensor, present: torch.Tensor, limit: torch.Tensor,
                  store: Fp4Storage) -> dict | None:
    """Groups whose scale in B's file (``scale``) exceeds ``limit`` (``store.factor`` x the one A's values there call
    for, ``needed``; for e4m3, never less than the e4m3 value just over it): None when none does; else how many and
    the worst, with evidence (the keys ``findings.grid_finding`` words; a group's step is its top level's gap, 2 x
    its scale)."""
    over = torch.where(present & (needed > 0), scale / limit, torch.zeros_like(scale))
    over = over.nan_to_num(0.0, posinf=0.0)  # a NaN/Inf scale is nonfinite_scale's
    if not bool((over > 1).any()):
        return None
    worst = int(over.argmax())
    first = worst % store.per_row * store.group
    b_step, a_step = 2 * float(scale[worst]), 2 * float(needed[worst])
    return {"blocks_too_coarse": int((over > 1).sum()), "blocks": int(present.sum()), "worst_block": worst,
            "row": worst // store.per_row, "values": [first, first + store.group - 1], "b_step": b_step,
            "a_step": a_step, "limit": 2 * float(limit[worst]), "times_coarser": b_step / a_step}
