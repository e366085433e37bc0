"""What a conversion can honestly change in one tensor, and what it did: the tensor-level half of
``parity compare A B`` (``comparison.py`` holds the function-level half and the order).

Each of a layer's FFN tensors is read as its checkpoint stores it and routed to transformers' own
parameter names by that checkpoint's mapping (GGUF names, Conv1D transposes, fused halves), so A's and
B's tensors are compared name by name in one layout.  How B stores a tensor decides what B may differ by:

* the same dtype as A: nothing (bit-identical is the expected case, and reported as such), each value within
  one ulp of A's;
* another float dtype (bfloat16 -> float16, float32 -> bfloat16): A's value rounded to B's dtype, each value of
  B within one ulp of that dtype of A's cast (``ulp_excess``: value_corrupted otherwise);
* a GGUF quantized type: every value within its block's quantization step of A's value, never less than A's own
  storage rounding (``quantized_bounds``).  The step is read from the file: the float16 scale ``d`` in the first
  two bytes of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 blocks, MXFP4's E8M0 exponent, the K-quants' super-block scales; for
  the other types it is estimated from the levels the block holds (evidence only: the function judges them).
  Each block's step is also held to what a quantizer of the format chooses for A's values there
  (``coarse_blocks``: grid_too_coarse).

``reference_conversion`` makes A's tensor as B's storage would hold it, from A alone: cast, re-quantized with
``gguf.quants.quantize`` in B's stored layout, or for the K-quants (which gguf cannot write) quantized by
round-to-nearest on the grid A's own blocks call for (``k_requantize``).  Types with neither (IQ1 to IQ4, NVFP4)
have A rounded to the nearest value B's block holds (``on_levels``), and B judged by the function only.  The
function-level deviation that conversion alone causes is what B is judged against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from parity.definitions.mapping import TensorRoute
from parity.engine.compare import affine_grid, codebook_grid, fp8_grid, group_grid
from parity.engine.compare.gguf_blocks import (
    K_FORMAT,
    K_QUANTS,
    SCALE_FIRST,
    SIGNED_K,
    SUPER_BLOCK,
    block_grid,
    codes_zero,
    mxfp4_steps,
    read_blocks,
    scale_problem,
)
from parity.engine.layer import route_tensor

FLOAT_TYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# A grid parity cannot read (IQ1 to IQ4, NVFP4: no quantizer here, their grids codebooks): A is rounded to the nearest
# value B holds among each LEVEL_GROUP values (the types scale their values in groups of 32 or 16: llama.cpp's
# ggml-common.h), and B is judged by the function within LEVELS_FACTOR x what that rounding does.  Measured on a tiny
# LLaMA (d 256, d_ff 512, Gaussian weights) quantized by ggml's own quantizers (ggml-python 0.0.45's
# ggml_quantize_chunk, importance all ones): B's deviation over that rounding's was 1.00 to 1.01 for IQ4_NL and
# IQ4_XS (they round each value to its nearest level: the rounding is B), 1.24 to 2.06 for IQ1_S, IQ1_M, IQ2_XXS,
# IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S (they choose 8 values at once from a codebook), so 3 x; groups of 256 (the whole
# super-block) left those ratios at up to 5.3, groups of 8 at 1.0 to 1.4 with B's own values too near.  Their values
# move farther than the levels around A's value (60 to 90 thousand of 131 thousand per matrix for IQ1 to IQ3, and
# for IQ4_XS's search of its scales): each value's distance in steps is evidence, not a rule.
LEVEL_GROUP = 32
LEVELS_FACTOR = 3.0
STEP_SLACK = 1.01  # a value may sit a step from A's (Q4_0's clamp at +8) plus the float16 rounding of d itself
# A quantizer may search the scale (llama.cpp tries steps between range/(levels + 1) and range/(levels - 1), then
# refits them by least squares): a value at the end of its block's grid may lie this many times the scale's
# rounding farther from A's.
SEARCH = 2.0
# What B's step may exceed the step the format's quantizer chooses for A's values by before the block is judged too
# coarse (grid_too_coarse).  K-quants: llama.cpp's scale search tries steps up to range/(levels - 1) and refits them
# (15/14 = 1.07 x for Q4_K); measured on re-writes of its quantizers, 1.105 (reference) and 1.122 (importance
# matrix) at most.  Q4_0..Q8_0: gguf's quantizer fixes d (amax / levels); llama.cpp's importance-matrix search for
# Q4_0/Q5_0/Q4_1/Q5_1 moves it by up to (levels / (levels - 0.9)) = 1.127 x (Q4_0), Q8_0 not at all.  A grid 2x too
# coarse (one bit of the code passed off) exceeds both.
K_GRID_FACTOR = 1.5
LEGACY_GRID_FACTOR = 1.25
FLOAT16_ROUNDING = 1 + 2.0 ** -10  # a block's d is stored as float16: B's step may exceed the exact one by this


@dataclass
class Storage:
    """How a checkpoint stores one tensor: its dtype name (``float16`` or a GGUF type such as ``Q8_0``), and for
    a quantized type the per-value step (routed to the reference's layout, like the tensor)."""

    dtype: str
    quantized: bool = False
    steps: torch.Tensor | None = None
    step_source: str | None = None  # "file" (the block's scale) | "estimated" (the block's value lattice)
    route: TensorRoute | None = None
    qtype: int | None = None  # GGMLQuantizationType value, for re-quantizing A
    offsets: torch.Tensor | None = None  # where a K-quant's grid starts (-dmin x min), per value; None: at zero
    nonfinite_scale: str | None = None  # the first block whose scale is NaN/Inf, in words (read from the file)
    zeroed: bool = False  # every quantization code of the tensor (this expert's blocks) is zero
    block: tuple[int, int] | None = None  # FP8 block quantization: the block each weight_scale_inv covers
    power_of_two: bool = False  # FP8 block quantization with power-of-two (ue8m0) scales
    scales: torch.Tensor | None = None  # FP8 block quantization: each block's scale, read from the file
    levels: torch.Tensor | None = None  # a grid parity cannot read (IQ, NVFP4): B's own values, stored layout
    codebook: object | None = None  # bitsandbytes 4-bit: parity.sources.bnb_4bit.Packed4bit, read from the file
    affine: affine_grid.AffineStorage | None = None  # MLX affine quantization: codes, scales, biases (stored layout)
    group: group_grid.Grid | None = None  # integer group quantization (GPTQ, AWQ, pack-quantized): B's own grid


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def storage_of(checkpoint, key: str, stored: torch.Tensor, route: TensorRoute, expert: int | None = None) -> Storage:
    """How ``checkpoint`` stores tensor ``key`` (``stored``: as read; for MoE, one ``expert``'s slice of a tensor
    that may stack every expert, as GGUF's ``*_exps`` do); GGUF files say it in their index."""
    header = getattr(checkpoint, "header", None)
    info = header.tensors.get(key) if header is not None else None
    if info is None:
        as_stored = getattr(checkpoint, "stored_dtype", lambda _: None)(key)  # before a read's upcast to one dtype
        grouped = group_grid.stored(checkpoint, key, route)  # integer groups: each value's grid read from the file
        return (block_storage(checkpoint, key, route) or codebook_storage(checkpoint, key, route)
                or affine_storage(checkpoint, key, route, expert) or (Storage(**grouped) if grouped else None)
                or Storage(as_stored or dtype_name(stored.dtype), route=route))
    from parity.sources.gguf_header import qtype_name

    name = qtype_name(info.qtype)
    if name in FLOAT_TYPES:
        return Storage(dtype_name(FLOAT_TYPES[name]), route=route)
    if name not in K_QUANTS and name not in SCALE_FIRST and name != "MXFP4":
        group = min(qtype_block(info.qtype), LEVEL_GROUP)
        return Storage(name, True, route_tensor(route, level_steps(stored, group)), "estimated", route, info.qtype,
                       levels=stored.float() if stored.numel() % group == 0 else None)
    stacked = expert is not None and len(info.shape) == stored.dim() + 1  # this expert's blocks only
    raw = read_blocks(header.path, info, expert if stacked else None)
    steps, offsets, scales = block_grid(raw, name, tuple(stored.shape))
    if name == "MXFP4":
        steps = mxfp4_steps(steps, stored)
    return Storage(name, True, route_tensor(route, steps), "file", route, info.qtype,
                   None if offsets is None else route_tensor(route, offsets),
                   nonfinite_scale=scale_problem(scales, stored.numel() // len(raw), stored.shape[-1]),
                   zeroed=codes_zero(raw, name))


def block_storage(checkpoint, key: str, route: TensorRoute) -> Storage | None:
    """How an FP8 block-quantized checkpoint stores ``key`` (``parity.sources.fp8_blocks``): each value's step is the
    e4m3 spacing at its code times its block's scale, read from the file; None for a tensor stored unquantized."""
    quantized = getattr(checkpoint, "quantized", None)
    held = quantized(key) if quantized is not None else None
    if held is None:
        return None
    steps = fp8_grid.steps(held.codes, held.scales, held.block)
    bad = ~torch.isfinite(held.scales)
    problem = None
    if bool(bad.any()):
        first = [int(i) for i in bad.nonzero()[0]]
        problem = (f"block {first} ({held.scale_name} = {float(held.scales[tuple(first)])}): {int(bad.sum())} of "
                   f"{bad.numel()} blocks have a NaN/Inf scale")
    return Storage(dtype_name(held.codes.dtype), True, route_tensor(route, steps), "file", route,
                   nonfinite_scale=problem, zeroed=not bool(held.codes.float().any()), block=held.block,
                   power_of_two=held.power_of_two, scales=held.scales)


def codebook_storage(checkpoint, key: str, route: TensorRoute) -> Storage | None:
    """How a bitsandbytes 4-bit checkpoint stores ``key`` (``parity.sources.bnb_4bit``): each value's step is its
    code's step in the code book times its block's absmax, read from the file; None for a tensor stored unquantized."""
    packed = getattr(checkpoint, "packed", None)
    held = packed(key) if packed is not None else None
    if held is None:
        return None
    steps = codebook_grid.steps(held.codes, held.absmax, held.levels, held.blocksize, held.shape)
    bad = ~torch.isfinite(held.absmax)
    problem = (f"block {int(bad.nonzero()[0, 0])} ({key}.absmax): {int(bad.sum())} of {bad.numel()} blocks have a "
               "NaN/Inf absmax") if bool(bad.any()) else None
    return Storage(held.quant_type, True, route_tensor(route, steps), "file", route, nonfinite_scale=problem,
                   zeroed=not bool(held.levels[held.codes].any()), codebook=held)


def affine_storage(checkpoint, key: str, route: TensorRoute, expert: int | None) -> Storage | None:
    """How an MLX affine-quantized checkpoint stores ``key`` (``parity.sources.mlx_affine``): each value's step is its
    group's scale, read from the file; None for a tensor stored unquantized."""
    held = affine_grid.held(checkpoint, key, expert)
    if held is None:
        return None
    bad = ~(torch.isfinite(held.scales) & torch.isfinite(held.biases))
    problem = None
    if bool(bad.any()):
        first = [int(i) for i in bad.nonzero()[0]]
        problem = f"group {first}: {int(bad.sum())} of {bad.numel()} groups have a NaN/Inf scale or bias"
    return Storage(held.name, True, route_tensor(route, held.steps()), "file", route, nonfinite_scale=problem,
                   zeroed=not bool(held.codes.any()), affine=held)


def level_steps(values: torch.Tensor, group: int) -> torch.Tensor:
    """Each value's step on a grid parity cannot read, from the values its block holds (``group`` values, stored
    layout): the larger gap from the value to the next distinct value its block holds below and above it, so that a
    value of A rounded to either of the block's levels around it lies within one step; a block of one distinct value
    takes the tensor's median step."""
    if values.numel() % group:
        return torch.zeros_like(values, dtype=torch.float32)
    flat = values.float().reshape(-1, group)
    ordered = flat.sort(dim=1).values
    above = torch.searchsorted(ordered, flat.contiguous(), right=True)  # the first level above each value
    below = torch.searchsorted(ordered, flat.contiguous()) - 1  # the last level below it
    up = torch.where(above < group, ordered.gather(1, above.clamp(max=group - 1)) - flat, 0.0)
    down = torch.where(below >= 0, flat - ordered.gather(1, below.clamp(min=0)), 0.0)
    gaps = torch.maximum(up, down)
    finite = gaps[gaps > 0]
    fallback = float(finite.median()) if finite.numel() else 0.0
    return torch.where(gaps > 0, gaps, torch.full_like(gaps, fallback)).reshape(values.shape)


def on_levels(a: torch.Tensor, levels: torch.Tensor, group: int) -> torch.Tensor:
    """A's values (stored layout) each rounded to the nearest value B's block holds (``levels``: B's values, same
    layout, blocks of ``group``): A as B's grid can hold it where no quantizer of the type is known here.  B's own value
    is one of those levels, so each value of A moves no farther than B's does: for a format that rounds each value to
    its nearest level (IQ4_NL, NVFP4) this is B exactly, for one that picks values jointly (IQ1 to IQ3's
    lattices of 8 values) a lower bound of B's rounding."""
    flat, ordered = a.float().reshape(-1, group), levels.float().reshape(-1, group).sort(dim=1).values
    index = torch.searchsorted(ordered, flat.contiguous()).clamp(1, group - 1)
    low, high = ordered.gather(1, index - 1), ordered.gather(1, index)
    rounded = torch.where((flat - low).abs() <= (high - flat).abs(), low, high)
    # a value farther outside its block's levels than the gap between the block's last two: not a value B's block
    # could hold (B holds another tensor there, which is what the compare is to find), so A's own value is kept
    below = flat < ordered[:, :1] - (ordered[:, 1:2] - ordered[:, :1])
    above = flat > ordered[:, -1:] + (ordered[:, -1:] - ordered[:, -2:-1])
    return torch.where(below | above, flat, rounded).reshape(a.shape)


def stored_layout(route: TensorRoute | None, tensor: torch.Tensor) -> torch.Tensor | None:
    """A reference-layout tensor put back into the layout its checkpoint stores it in (undoing a transpose);
    None for a chunk of a fused tensor (its blocks span both halves)."""
    if route is None or route.chunk is not None:
        return None
    return tensor.t() if route.transform == "transpose" else tensor


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
    stored = stored_layout(storage.route, a.float())
    if stored is not None and storage.group is not None:  # integer groups: round to nearest on B's own grid
        rounded, how = group_grid.reference(stored, storage.group)
        return unstored(storage.route, rounded), how, None
    if stored is not None and storage.block is not None:
        values, steps = fp8_grid.requantize(stored, storage.block, power_of_two=storage.power_of_two)
        scale = "the power of two at or above " if storage.power_of_two else ""
        return (unstored(storage.route, values), f"re-quantized to {storage.dtype} in {storage.block[0]}x"
                f"{storage.block[1]} blocks with compressed-tensors (scale: {scale}the block's largest magnitude / "
                "448)", steps)
    if stored is not None and storage.codebook is not None:
        values, steps = codebook_grid.requantize(stored, storage.codebook)
        book = storage.codebook
        how = ("int8_vectorwise_quant (one scale per row)" if book.quant_type == "int8" else
               f"quantize_4bit in blocks of {book.blocksize}" + (" (double quant)" if book.nested else ""))
        return unstored(storage.route, values), f"re-quantized to {storage.dtype} with bitsandbytes' {how}", steps
    if stored is not None and storage.affine is not None:
        values, steps = affine_grid.requantize(stored, storage.affine)
        held = storage.affine
        return (unstored(storage.route, values), f"re-quantized with mlx.core.quantize ({held.bits}-bit, groups of "
                f"{held.group_size}, A cast to {held.dtype} first)", steps)
    if stored is not None and storage.dtype in K_QUANTS and stored.shape[-1] % SUPER_BLOCK == 0:
        values, steps = k_requantize(stored, storage.dtype)
        return (unstored(storage.route, values), f"re-quantized to {storage.dtype} by rounding to the nearest level "
                "of the grid A's own blocks call for (gguf cannot quantize it)", steps)
    quantized = requantize(a, storage)
    if quantized is not None:
        return quantized[0], f"re-quantized to {storage.dtype} with gguf.quants.quantize", quantized[1]
    if stored is not None and storage.levels is not None:
        return (unstored(storage.route, on_levels(stored, storage.levels, min(block_values(storage), LEVEL_GROUP))),
                f"rounded to the nearest value B's {storage.dtype} block holds (no quantizer for it here)", None)
    return (on_lattice(a, storage.steps, storage.offsets),
            f"rounded onto B's {storage.dtype} block grid, read from the file (no quantizer for it here)", None)


def unstored(route: TensorRoute | None, tensor: torch.Tensor) -> torch.Tensor:
    """A tensor in its checkpoint's stored layout put into the reference's layout (``stored_layout`` undone)."""
    tensor = tensor.float()
    return tensor.t() if route is not None and route.transform == "transpose" else tensor


def requantize(a: torch.Tensor, storage: Storage) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """A quantized the way B's file is (gguf.quants, in B's stored layout), dequantized, and the step gguf's
    quantizer chose for each value's block (stored layout; None for MXFP4, whose step is not one per block); None
    where gguf cannot quantize the type."""
    import numpy as np
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import QuantError, dequantize, quantize

    stored = stored_layout(storage.route, a.float())
    if stored is None or storage.qtype is None:
        return None
    qtype = GGMLQuantizationType(storage.qtype)
    try:
        blocks = quantize(np.ascontiguousarray(stored.numpy(), dtype=np.float32), qtype)
        values = dequantize(blocks, qtype)
    except (QuantError, NotImplementedError):  # the K-quants, among others: gguf has no quantizer for them
        return None
    back = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(stored.shape)
    steps = None
    if storage.dtype in SCALE_FIRST:  # the d gguf's quantizer chose for each of A's blocks
        from gguf.constants import GGML_QUANT_SIZES

        raw = np.ascontiguousarray(blocks).reshape(-1, GGML_QUANT_SIZES[qtype][1])
        steps = block_grid(raw, storage.dtype, tuple(stored.shape))[0]
    return unstored(storage.route, back), steps


def k_statistics(x: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a K-quant quantizer makes of A's values ``x`` (stored layout, float32), per sub-block: the step they
    call for (their range over ``K_FORMAT``'s levels) and the minimum below zero; per super-block the unit d of
    the sub-block scales and dmin of the minima.  Shapes: [super-blocks, sub-blocks] and [super-blocks, 1]."""
    span, sub, levels = K_FORMAT[name]
    blocks = x.reshape(-1, SUPER_BLOCK // sub, sub)
    if name in SIGNED_K:
        ideal, mins = blocks.abs().amax(-1) / span, torch.zeros(blocks.shape[:2], dtype=x.dtype)
    else:
        low = blocks.amin(-1).clamp(max=0)
        ideal, mins = (blocks.amax(-1) - low) / span, -low
    return ideal, mins, ideal.amax(-1, keepdim=True) / levels, mins.amax(-1, keepdim=True) / levels


def k_requantize(x: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A's values ``x`` (stored layout, float32) quantized to K-quant ``name`` by round-to-nearest: each sub-block's
    step its range over the levels, rounded to a multiple of the float16 d (Q2_K/Q4_K/Q5_K: the minimum likewise under
    dmin), each value to the nearest level (clamped to the codes).  Returns the values and each value's step."""
    span, sub, levels = K_FORMAT[name]
    blocks = x.reshape(-1, SUPER_BLOCK // sub, sub)
    ideal, mins, quantum, mquantum = k_statistics(x, name)
    d = quantum.to(torch.float16).to(x.dtype)
    safe_d = torch.where(d > 0, d, torch.ones_like(d))
    if name in SIGNED_K:  # signed scale: the largest magnitude maps to code -span (Q6_K: -32, Q3_K: -4)
        pick = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True)).squeeze(-1)
        step = torch.where(d > 0, torch.round(-pick / span / safe_d).clamp(-levels - 1, levels), 0.0) * d
        safe = torch.where(step != 0, step, torch.ones_like(step)).unsqueeze(-1)
        values = torch.where(step.unsqueeze(-1) != 0, torch.round(blocks / safe).clamp(-span, span - 1) * safe, 0.0)
    else:
        dmin = mquantum.to(torch.float16).to(x.dtype)
        safe_m = torch.where(dmin > 0, dmin, torch.ones_like(dmin))
        step = torch.where(d > 0, torch.round(ideal / safe_d).clamp(0, levels), 0.0) * d
        offset = (-torch.where(dmin > 0, torch.round(mins / safe_m).clamp(0, levels), 0.0) * dmin).unsqueeze(-1)
        safe = torch.where(step != 0, step, torch.ones_like(step)).unsqueeze(-1)
        codes = torch.where(step.unsqueeze(-1) != 0, torch.round((blocks - offset) / safe).clamp(0, span), 0.0)
        values = offset + codes * safe * (step.unsqueeze(-1) != 0)
    steps = step.abs().unsqueeze(-1).expand(-1, -1, sub)
    return values.reshape(x.shape), steps.reshape(x.shape)


def on_lattice(a: torch.Tensor, steps: torch.Tensor | None, offsets: torch.Tensor | None = None) -> torch.Tensor:
    """A's values rounded to the nearest point of B's per-value grid (``offsets`` + k x ``steps``): used only where
    no quantizer of the type is known here (types whose step is estimated), never for a type judged by its grid."""
    a = a.float()
    if steps is None:
        return a
    start = offsets if offsets is not None else torch.zeros_like(steps)
    safe = torch.where(steps > 0, steps, torch.ones_like(steps))
    return torch.where(steps > 0, torch.round((a - start) / safe) * safe + start, a)


def spacing(values: torch.Tensor, dtype: str) -> torch.Tensor:
    """One unit in the last place of ``dtype`` (a torch dtype's name; float32 for anything else, such as a GGUF
    quantized type dequantized) at each value, in float32: the rounding that storing the value in it may cause."""
    kind = getattr(torch, dtype, None)
    info = torch.finfo(kind if isinstance(kind, torch.dtype) and kind.is_floating_point else torch.float32)
    limit = min(info.max, torch.finfo(torch.float32).max)
    exponent = torch.frexp(values.float().nan_to_num(0.0, limit, -limit))[1]
    magnitude = torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent - 1)
    return info.eps * torch.where(values == 0, info.tiny, magnitude.clamp_min(info.tiny))


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


def quantized_bounds(a: torch.Tensor, b: torch.Tensor, storage: Storage, a_dtype: str,
                     a_steps: torch.Tensor | None) -> tuple[torch.Tensor, dict | None]:
    """Each of B's values' allowed distance from A's (reference layout), and where B's blocks use a coarser step than
    the format's own quantizer chooses for A's values, the evidence (``coarse_blocks``: grid_too_coarse).

    A value may lie its block's step from A's (``STEP_SLACK``), never less than A's own storage rounding (a zero
    step, where a block's values all equal its minimum, is a fact about the block).  In a K-quant a value at either
    end of its block's grid (its code clamped, or in a zero-step block) may lie farther by as much as the rounding of
    the block's scale to a multiple of d (and of its minimum to a multiple of dmin) moves it: (levels x d + dmin) / 2,
    with d and dmin those A's values call for, plus the float16 rounding of d and dmin themselves (times ``SEARCH``)."""
    if storage.levels is not None:  # a grid read off B's own values (LEVEL_GROUP): the steps are evidence only
        return torch.full_like(storage.steps.float(), math.inf), None
    if storage.group is not None:  # integer groups (GPTQ moves values by more than a step): the steps are evidence,
        x, held = stored_layout(storage.route, a.float()), stored_layout(storage.route, b.float())  # unless biased
        biased = x is not None and abs(group_grid.bias(x, held, storage.group)) > group_grid.BIAS_LIMIT
        return torch.full_like(storage.steps.float(), 0.0 if biased else math.inf), None
    allowed = torch.maximum(STEP_SLACK * storage.steps.float(), spacing(a, a_dtype))
    x = stored_layout(storage.route, a.float())
    if x is None:
        return allowed, None
    b_steps = stored_layout(storage.route, storage.steps.float())
    if storage.dtype in K_QUANTS and x.shape[-1] % SUPER_BLOCK == 0:
        span, sub, levels = K_FORMAT[storage.dtype]
        ideal, _, quantum, mquantum = k_statistics(x, storage.dtype)
        # d and dmin are float16: a step moves by up to levels x half d's float16 spacing (a subnormal d: by much)
        d_rounding, m_rounding = (levels * spacing(unit, "float16") / 2 for unit in (quantum, mquantum))
        offsets = None if storage.offsets is None else stored_layout(storage.route, storage.offsets.float())
        ends = k_ends(stored_layout(storage.route, b.float()), b_steps, offsets, storage.dtype,
                      SEARCH * ((span * quantum + mquantum) / 2 + span * d_rounding + m_rounding))
        allowed = allowed + unstored(storage.route, ends).float()  # 0 away from the grid's ends
        limit = K_GRID_FACTOR * (ideal + quantum / 2) + d_rounding
        return allowed, coarse_blocks(b_steps, ideal, limit, sub, x, a_dtype)
    if storage.affine is not None:  # MLX: plus dtype rounding and clamped ends; each group's scale against A's range
        allowed = allowed + unstored(storage.route, affine_grid.allowance(x, storage.affine))
        return allowed, affine_grid.coarse_groups(x, storage.affine)
    if storage.block is not None and storage.scales is not None:  # FP8: each block's scale against A's amax / 448
        return allowed, fp8_grid.coarse_blocks(x, storage.scales, storage.block)
    if storage.codebook is not None:  # bitsandbytes 4-bit: each block's absmax against A's largest magnitude
        return allowed, codebook_grid.coarse_blocks(x, storage.codebook)
    if a_steps is None:
        return allowed, None
    group = block_values(storage)
    needed = a_steps.float().reshape(-1, group)[:, 0]
    return allowed, coarse_blocks(b_steps, needed, LEGACY_GRID_FACTOR * needed + spacing(needed, "float16"), group, x,
                                  a_dtype)


def block_values(storage: Storage) -> int:
    return qtype_block(storage.qtype)


def qtype_block(qtype: int) -> int:
    """Values per block of a GGUF quantized type (gguf's own table)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType(qtype)][0]


def k_ends(b: torch.Tensor, steps: torch.Tensor, offsets: torch.Tensor | None, name: str,
           extra: torch.Tensor) -> torch.Tensor:
    """Where B's value sits at an end of its block's grid (its code clamped: Q2_K/Q4_K/Q5_K codes 0 and 2^bits - 1,
    Q3_K's and Q6_K's -2^(bits-1) and 2^(bits-1) - 1) or its block's step is zero: ``extra`` (per super-block) plus
    (``SEARCH`` - 1) steps, since a quantizer searching steps up to a level either side of range/levels clamps values
    that far; else 0.  Stored layout."""
    span = K_FORMAT[name][0]
    start = offsets if offsets is not None else torch.zeros_like(b)
    codes = torch.round((b - start) / torch.where(steps > 0, steps, torch.ones_like(steps)))
    at_end = (codes.abs() >= span - 1) if name in SIGNED_K else (codes <= 0) | (codes >= span)
    per_value = extra.expand(-1, SUPER_BLOCK).reshape(b.shape) + (SEARCH - 1) * steps
    return torch.where(at_end | (steps == 0), per_value, torch.zeros_like(per_value))


def coarse_blocks(b_steps: torch.Tensor, needed: torch.Tensor, limit: torch.Tensor, group: int, x: torch.Tensor,
                  a_dtype: str) -> dict | None:
    """Blocks (of ``group`` values, stored layout) whose step in B's file exceeds ``limit``: the most a quantizer of
    the format chooses for A's values there (``needed``: the step they call for; never less than A's own storage
    rounding at the block's largest value).  None when no block does; else how many, and the worst, with evidence."""
    chosen = b_steps.reshape(-1, group)[:, 0]
    top = x.reshape(-1, group).abs().amax(-1)
    bound = torch.maximum(limit.reshape(-1) * FLOAT16_ROUNDING, spacing(top, a_dtype))
    over = (chosen / bound).nan_to_num(0.0)
    if not bool((over > 1).any()):
        return None
    worst = int(over.argmax())
    start = worst * group % x.shape[-1]
    needed = float(needed.reshape(-1)[worst])
    return {"blocks_too_coarse": int((over > 1).sum()), "blocks": len(chosen), "worst_block": worst,
            "row": worst * group // x.shape[-1], "values": [start, start + group - 1],
            "b_step": float(chosen[worst]), "a_step": needed, "limit": float(bound[worst]),
            "times_coarser": float(chosen[worst]) / needed if needed else math.inf}


def step_excess(a: torch.Tensor, b: torch.Tensor, steps: torch.Tensor, allowed: torch.Tensor | None = None) -> dict:
    """How far B's values are from A's in units of their block's step: the count beyond their allowed distance
    (``allowed``; default ``STEP_SLACK`` x step), the worst in steps, and where it is (the value most beyond its
    allowance when one is; a zero-step value within its allowance counts 0 steps)."""
    diff = (b.float() - a.float()).abs()
    allowed = STEP_SLACK * steps.float() if allowed is None else allowed
    beyond = diff > allowed
    units = torch.where(steps > 0, diff / steps.float().clamp_min(1e-30), torch.where(beyond, math.inf, 0.0))
    pick = diff / allowed.clamp_min(1e-300) if bool(beyond.any()) else units
    worst = int(pick.nan_to_num(math.inf).flatten().argmax())
    index = [int(i) for i in torch.unravel_index(torch.tensor(worst), units.shape)]
    return {"values_beyond_step": int(beyond.sum()), "max_steps": float(units.flatten()[worst]), "at": index}


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
    limit = f"; {b_dtype} ends at {torch.finfo(dtype).max:.6g}" if isinstance(dtype, torch.dtype) else ""
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
