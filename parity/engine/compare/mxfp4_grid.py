"""GPT-OSS's MXFP4 experts (``parity.sources.mxfp4_experts``) judged against their own grid, for ``parity compare``:
each value's step is the gap beside its code's e2m1 level (the wider of the two, ``storage.level_steps``) times its
block's power-of-two scale, both read from the file.

No quantizer of this layout runs on CPU here (transformers' ``quantize_to_mxfp4`` needs triton's kernels), and the
quantizers that write MXFP4 choose the exponent differently (OCP's floor(log2(amax)) - 2, which clips values between
6 and 8 x the scale; ggml's, which differs from it on 14 % of the values of a normal matrix), so A is rounded onto B's
own grid (each value to the nearest e2m1 level of its block's scale read from the file): the function is judged
against that, and each block's scale is held to ``GRID_FACTOR`` x the scale A's values there call for (amax / 6, the
smallest that clips nothing): every writer's choice lies within 0.75 to 2 x of it; one exponent too high is 1.5 to 4 x.

Everything here works in the reference's layout: each value's scale, level and block are routed as the tensor is
(GPT-OSS's gate and up are a fused tensor's interleaved columns, whose blocks run along the inputs of both).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parity.definitions.mapping import TensorRoute
from parity.engine.compare.storage import Storage, level_steps
from parity.engine.layer import route_tensor

GRID_FACTOR = 2.0 * (1 + 2 ** -7)  # a block's scale over amax / 6 before it is grid_too_coarse (above)
TOP = 6.0  # e2m1's largest magnitude


@dataclass
class Mxfp4Storage:
    """How B stores one MXFP4 tensor (one expert's slice), each fact per value in the reference's layout: its code's
    e2m1 level, its block's scale (2^exponent) and its block's index in the file ([expert,] out, block)."""

    levels: torch.Tensor
    scales: torch.Tensor
    blocks: torch.Tensor
    per_row: int  # blocks per stored row (in / 32)
    dtype: str = "float32"  # what A is cast to before it is rounded (the dtype B left its other tensors in)


def stored(checkpoint, key: str, route: TensorRoute, expert: int | None, shape) -> Storage | None:
    """How a GPT-OSS MXFP4 checkpoint stores ``key`` (``expert``'s slice, read as ``shape``: transformers' [in, out],
    or [out, in] where the mapping turns its experts so), None for a tensor stored unquantized or a checkpoint of
    another format."""
    held = getattr(checkpoint, "mxfp4_held", None)
    found = held(key, expert=expert) if held is not None else None
    if found is None:
        return None
    from parity.sources.mxfp4_experts import BLOCK, fp4_values

    levels, exponents = found.levels, found.exponents  # the file's layout: [..., out, in]
    scales = torch.ldexp(torch.ones_like(levels), exponents.to(torch.int32))
    book = fp4_values().unique()
    steps = level_steps(book)[torch.searchsorted(book, levels.contiguous())] * scales
    outputs, inputs = levels.shape[-2], levels.shape[-1]
    per_row = inputs // BLOCK
    index = torch.arange(outputs)[:, None] * per_row + torch.arange(inputs)[None, :] // BLOCK
    index = index + torch.arange(levels[..., 0, 0].numel()).reshape(levels.shape[:-2] + (1, 1)) * outputs * per_row
    if tuple(shape) != tuple(levels.shape):  # read in transformers' [..., in, out]
        levels, scales, steps, index = (t.transpose(-1, -2) for t in (levels, scales, steps, index))
    bad = exponents > 127  # e8m0's 0xFF: no number
    problem = None
    if bool(bad.any()):
        first = int(index[bad][0])
        problem = (f"block {[first // per_row, first % per_row]}: {int(torch.unique(index[bad]).numel())} of "
                   f"{index.numel() // BLOCK} blocks have a NaN/Inf scale (e8m0 0xFF)")
    store = Mxfp4Storage(*(route_tensor(route, t) for t in (levels, scales, index)), per_row, found.dtype)
    return Storage("mxfp4 (GPT-OSS blocks)", True, route_tensor(route, steps), "file", route,
                   nonfinite_scale=problem, zeroed=not bool(levels.any()), mxfp4=store)


def reference(a: torch.Tensor, storage: Storage) -> tuple[torch.Tensor, str, None]:
    """A's tensor (reference layout) rounded onto B's own grid: cast to the dtype B left its other tensors in, then
    each value to the nearest e2m1 level of its block's scale, read from the file (no quantizer of the format runs
    here, above)."""
    from parity.sources.mxfp4_experts import fp4_values

    store = storage.mxfp4
    book = fp4_values().unique()
    finite = torch.isfinite(store.scales) & (store.scales > 0)
    unit = torch.where(finite, store.scales, torch.ones_like(store.scales))
    cast = a.to(getattr(torch, store.dtype)).float()
    scaled = (cast / unit).clamp(-TOP, TOP)
    nearest = book[(scaled[..., None] - book).abs().argmin(-1)]
    return (torch.where(finite, nearest * unit, cast), f"cast to {store.dtype}, rounded to the nearest e2m1 level of "
            "B's MXFP4 blocks, each block's scale read from the file", None)


def coarse_blocks(a: torch.Tensor, store: Mxfp4Storage) -> dict | None:
    """Blocks whose scale in B's file exceeds ``GRID_FACTOR`` x the one A's values there call for (their largest
    magnitude / 6): None when none does; else how many and the worst, with evidence (the keys
    ``findings.grid_finding`` words; a block's step is its top level's gap, 2 x its scale)."""
    count = int(store.blocks.max()) + 1
    ids = store.blocks.reshape(-1)
    amax = torch.zeros(count).scatter_reduce(0, ids, a.float().abs().reshape(-1), "amax", include_self=False)
    scale = torch.zeros(count).scatter_reduce(0, ids, store.scales.reshape(-1), "amax", include_self=False)
    present = torch.zeros(count, dtype=torch.bool).index_fill(0, ids, True)
    needed = amax / TOP
    over = torch.where(present & (needed > 0), scale / (GRID_FACTOR * needed), torch.zeros_like(scale))
    over = over.nan_to_num(0.0, posinf=0.0)  # a NaN/Inf scale is nonfinite_scale's
    if not bool((over > 1).any()):
        return None
    worst = int(over.argmax())
    first = worst % store.per_row * 32
    b_step, a_step = 2 * float(scale[worst]), 2 * float(needed[worst])
    return {"blocks_too_coarse": int((over > 1).sum()), "blocks": int(present.sum()), "worst_block": worst,
            "row": worst // store.per_row, "values": [first, first + 31], "b_step": b_step, "a_step": a_step,
            "limit": GRID_FACTOR * a_step, "times_coarser": b_step / a_step}
