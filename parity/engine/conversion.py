"""What a conversion can honestly change in one tensor, and what it did: the tensor-level half of
``parity compare A B`` (``checkpoint_compare.py`` holds the function-level half and the order).

Each of a layer's FFN tensors is read as its checkpoint stores it and routed to transformers' own
parameter names by that checkpoint's mapping (GGUF names, Conv1D transposes, fused halves), so A's and
B's tensors are compared name by name in one layout.  How B stores a tensor decides what B may differ by:

* the same dtype as A: nothing (bit-identical is the expected case, and reported as such);
* another float dtype (bfloat16 -> float16, float32 -> bfloat16): A's value rounded to B's dtype;
* a GGUF quantized type: every value within its block's quantization step of A's value.  The step is read
  from the file where the block layout puts it in the first two bytes (the float16 scale ``d`` of Q4_0,
  Q4_1, Q5_0, Q5_1, Q8_0); for the other types (K-quants, ...) it is estimated from the block's own values
  (the smallest gap between its distinct dequantized values).

``convert_like`` makes A's tensor as B's storage would hold it (cast, or re-quantized with
``gguf.quants.quantize`` in B's stored layout; where gguf cannot quantize the type, A's values rounded onto
B's own block lattice): the function-level deviation that conversion alone causes is what B is judged against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from parity.definitions.mapping import TensorRoute
from parity.engine.fill import route_tensor

FLOAT_TYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
SCALE_FIRST = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"}  # block layout: float16 scale d in bytes 0-1
STEP_SLACK = 1.01  # a value may sit a step from A's (Q4_0's clamp at +8) plus the float16 rounding of d itself
LATTICE_GROUP = 16  # values per group when a step is estimated from the dequantized values (K-quant sub-blocks)
# MXFP4 (OCP microscaling, as GGUF stores it): 32 values per block, byte 0 an E8M0 exponent e giving d = 2^(e-128),
# then 4-bit E2M1 codes of magnitudes {0, 1, 2, 3, 4, 6, 8, 12} x d.  Each value's step is the wider of the two
# gaps beside its magnitude on that grid: a faithful quantizer leaves A's value within half of it.
MXFP4_GAPS = {0.0: 1.0, 1.0: 1.0, 2.0: 1.0, 3.0: 1.0, 4.0: 2.0, 6.0: 2.0, 8.0: 4.0, 12.0: 4.0}
# K-quants (llama.cpp's k-quants, 256 values per super-block): Q4_K and Q5_K store d and dmin (float16) and eight
# 6-bit (scale, min) pairs, one per 32 values: value = d x scale x q - dmin x min, so the step is d x scale and the
# grid starts at -dmin x min.  Q6_K stores sixteen int8 scales, one per 16 values, and d (float16) last:
# value = d x scale x (q - 32), a grid from zero of step |d x scale|.
K_QUANTS = {"Q4_K", "Q5_K", "Q6_K"}


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


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def storage_of(checkpoint, key: str, stored: torch.Tensor, route: TensorRoute, expert: int | None = None) -> Storage:
    """How ``checkpoint`` stores tensor ``key`` (``stored``: as read; for MoE, one ``expert``'s slice of a tensor
    that may stack every expert, as GGUF's ``*_exps`` do); GGUF files say it in their index."""
    header = getattr(checkpoint, "header", None)
    info = header.tensors.get(key) if header is not None else None
    if info is None:
        return Storage(dtype_name(stored.dtype), route=route)
    from parity.sources.gguf_header import qtype_name

    name = qtype_name(info.qtype)
    if name in FLOAT_TYPES:
        return Storage(dtype_name(FLOAT_TYPES[name]), route=route)
    if name in K_QUANTS:
        steps, offsets = k_quant_grid(header.path, info)
        if expert is not None and steps.dim() == stored.dim() + 1:
            steps, offsets = steps[expert], offsets[expert]
        return Storage(name, True, route_tensor(route, steps), "file", route, info.qtype, route_tensor(route, offsets))
    if name in SCALE_FIRST or name == "MXFP4":
        steps, source = file_steps(header.path, info), "file"
        if expert is not None and steps.dim() == stored.dim() + 1:  # stacked over experts: this expert's steps
            steps = steps[expert]
        if name == "MXFP4":
            steps = mxfp4_steps(steps, stored)
    else:
        steps, source = lattice_steps(stored), "estimated"
    return Storage(name, True, route_tensor(route, steps), source, route, info.qtype)


def file_steps(path, info) -> torch.Tensor:
    """Each value's quantization step, read from its block's float16 scale (bytes 0-1 of every block)."""
    import numpy as np
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    qtype = GGMLQuantizationType(info.qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    with open(path, "rb") as handle:
        handle.seek(info.offset)
        raw = np.frombuffer(handle.read(info.nbytes()), dtype=np.uint8).reshape(-1, size)
    if qtype == GGMLQuantizationType.MXFP4:  # an E8M0 exponent: d = 2^(e - 128), the grid's unit
        scales = np.ldexp(np.float32(1.0), raw[:, 0].astype(np.int32) - 128).astype(np.float32)
    else:
        scales = np.abs(raw[:, :2].copy().view(np.float16).astype(np.float32)).reshape(-1)
    steps = torch.from_numpy(np.repeat(scales, block))
    return steps.reshape(info.shape)


def k_quant_grid(path, info) -> tuple[torch.Tensor, torch.Tensor]:
    """Each value's step and grid offset, read from its K-quant super-block (``K_QUANTS``)."""
    import numpy as np
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    qtype = GGMLQuantizationType(info.qtype)
    _, size = GGML_QUANT_SIZES[qtype]
    with open(path, "rb") as handle:
        handle.seek(info.offset)
        raw = np.frombuffer(handle.read(info.nbytes()), dtype=np.uint8).reshape(-1, size)
    if qtype == GGMLQuantizationType.Q6_K:
        d = raw[:, -2:].copy().view(np.float16).astype(np.float32)  # [blocks, 1]
        scales = raw[:, -18:-2].view(np.int8).astype(np.float32)  # [blocks, 16]: one per 16 values
        steps = np.repeat(np.abs(d * scales), 16, axis=1)
        offsets = np.zeros_like(steps)
    else:  # Q4_K, Q5_K: d, dmin, then 12 bytes of eight 6-bit (scale, min) pairs
        d, dmin = (raw[:, i:i + 2].copy().view(np.float16).astype(np.float32) for i in (0, 2))
        packed = raw[:, 4:16].astype(np.int32)
        low = [(packed[:, j] & 63, packed[:, j + 4] & 63) for j in range(4)]
        high = [((packed[:, j + 4] & 0xF) | ((packed[:, j - 4] >> 6) << 4),
                 (packed[:, j + 4] >> 4) | ((packed[:, j] >> 6) << 4)) for j in range(4, 8)]
        scale = np.stack([s for s, _ in low + high], axis=1).astype(np.float32)  # [blocks, 8]: one per 32 values
        minimum = np.stack([m for _, m in low + high], axis=1).astype(np.float32)
        steps = np.repeat(d * scale, 32, axis=1)
        offsets = np.repeat(-dmin * minimum, 32, axis=1)
    shape = tuple(info.shape)
    return (torch.from_numpy(np.ascontiguousarray(steps)).reshape(shape),
            torch.from_numpy(np.ascontiguousarray(offsets)).reshape(shape))


def mxfp4_steps(units: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Each MXFP4 value's step: its block's unit d (``units``, per value) times the wider gap beside the value's
    magnitude on the E2M1 grid (``MXFP4_GAPS``)."""
    magnitude = (values.float().abs() / units.clamp_min(1e-38)).reshape(-1)
    gaps = torch.ones_like(magnitude)
    for on_grid, gap in MXFP4_GAPS.items():
        gaps = torch.where((magnitude - on_grid).abs() < 1e-3, torch.full_like(gaps, gap), gaps)
    return units * gaps.reshape(units.shape)


def lattice_steps(values: torch.Tensor) -> torch.Tensor:
    """Each value's step estimated from its group of LATTICE_GROUP neighbours: the smallest gap between the
    group's distinct values (a quantized block's values lie on its lattice); a group with one distinct value
    takes the tensor's median step."""
    flat = values.float().reshape(-1, LATTICE_GROUP) if values.numel() % LATTICE_GROUP == 0 else None
    if flat is None:
        return torch.zeros_like(values, dtype=torch.float32)
    ordered = flat.sort(dim=1).values
    gaps = ordered.diff(dim=1)
    gaps = torch.where(gaps > 0, gaps, torch.full_like(gaps, math.inf)).amin(dim=1)
    finite = gaps[torch.isfinite(gaps)]
    fallback = float(finite.median()) if finite.numel() else 0.0
    gaps = torch.where(torch.isfinite(gaps), gaps, torch.full_like(gaps, fallback))
    return gaps.repeat_interleave(LATTICE_GROUP).reshape(values.shape)


def stored_layout(route: TensorRoute | None, tensor: torch.Tensor) -> torch.Tensor | None:
    """A reference-layout tensor put back into the layout its checkpoint stores it in (undoing a transpose);
    None for a chunk of a fused tensor (its blocks span both halves)."""
    if route is None or route.chunk is not None:
        return None
    return tensor.t() if route.transform == "transpose" else tensor


def convert_like(a: torch.Tensor, storage: Storage) -> tuple[torch.Tensor, str]:
    """A's tensor (reference layout) as B's storage would hold it, in float32, and how it was made."""
    if not storage.quantized:
        target = getattr(torch, storage.dtype, None)
        if not isinstance(target, torch.dtype) or target == a.dtype:
            return a.float(), "as stored"
        return a.to(target).float(), f"rounded to {storage.dtype}"
    quantized = requantize(a, storage)
    if quantized is not None:
        return quantized, f"re-quantized to {storage.dtype} with gguf.quants.quantize"
    return (on_lattice(a, storage.steps, storage.offsets),
            f"rounded onto B's {storage.dtype} block grid, read from the file (gguf cannot quantize it)")


def requantize(a: torch.Tensor, storage: Storage) -> torch.Tensor | None:
    """A quantized the way B's file is (gguf.quants, in B's stored layout), dequantized; None where it cannot."""
    import numpy as np
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import QuantError, dequantize, quantize

    stored = stored_layout(storage.route, a.float())
    if stored is None or storage.qtype is None:
        return None
    qtype = GGMLQuantizationType(storage.qtype)
    try:
        values = dequantize(quantize(np.ascontiguousarray(stored.numpy(), dtype=np.float32), qtype), qtype)
    except (QuantError, NotImplementedError):  # the K-quants, among others: gguf has no quantizer for them
        return None
    back = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(stored.shape)
    return back.t() if storage.route.transform == "transpose" else back


def on_lattice(a: torch.Tensor, steps: torch.Tensor | None, offsets: torch.Tensor | None = None) -> torch.Tensor:
    """A's values rounded to the nearest point of B's per-value grid (``offsets`` + k x ``steps``): the error a
    quantizer on that grid makes at least (used where gguf cannot quantize the type)."""
    a = a.float()
    if steps is None:
        return a
    start = offsets if offsets is not None else torch.zeros_like(steps)
    safe = torch.where(steps > 0, steps, torch.ones_like(steps))
    return torch.where(steps > 0, torch.round((a - start) / safe) * safe + start, a)


def step_excess(a: torch.Tensor, b: torch.Tensor, steps: torch.Tensor) -> dict:
    """How far B's values are from A's in units of their block's step: the count beyond STEP_SLACK x step,
    the worst ratio, and where it is."""
    diff = (b.float() - a.float()).abs()
    units = diff / steps.clamp_min(1e-30)
    units = torch.where(steps > 0, units, torch.where(diff > 0, math.inf, 0.0))
    worst = int(units.nan_to_num(math.inf).flatten().argmax())
    index = [int(i) for i in torch.unravel_index(torch.tensor(worst), units.shape)]
    return {"values_beyond_step": int((units > STEP_SLACK).sum()), "max_steps": float(units.flatten()[worst]),
            "at": index}


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
