"""What a GGUF file's quantized blocks say, read from their bytes (``parity compare``): each value's step and where its
grid starts, the blocks' float16 scales, and whether their codes are empty.  The layouts are ggml's, as gguf's own
dequantizer reads them (``gguf.quants``); ``gguf_grid`` judges B against A with what these return."""

from __future__ import annotations

import math

import torch

SCALE_FIRST = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"}  # block layout: float16 scale d in bytes 0-1
# MXFP4 (OCP microscaling, as GGUF stores it): 32 values per block, byte 0 an E8M0 exponent e giving d = 2^(e-128),
# then 4-bit E2M1 codes of magnitudes {0, 1, 2, 3, 4, 6, 8, 12} x d.  Each value's step is the wider of the two
# gaps beside its magnitude on that grid: a faithful quantizer leaves A's value within half of it.
MXFP4_GAPS = {0.0: 1.0, 1.0: 1.0, 2.0: 1.0, 3.0: 1.0, 4.0: 2.0, 6.0: 2.0, 8.0: 4.0, 12.0: 4.0}
# K-quants (llama.cpp's k-quants, 256 values per super-block): Q4_K and Q5_K store d and dmin (float16) and eight
# 6-bit (scale, min) pairs, one per 32 values: value = d x scale x q - dmin x min, so the step is d x scale and the
# grid starts at -dmin x min.  Q2_K likewise, with sixteen 4-bit (scale, min) pairs, one per 16 values, d and dmin
# last.  Q6_K stores sixteen int8 scales, one per 16 values, and d (float16) last: value = d x scale x (q - 32), a
# grid from zero of step |d x scale|; Q3_K likewise with sixteen 6-bit scales less 32 and codes q - 4.
K_QUANTS = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}
SIGNED_K = {"Q3_K", "Q6_K"}  # a grid from zero, signed scales and codes (the others: a minimum under dmin)
# What a K-quant's own quantizer makes of a sub-block, for judging B's grid against A (gguf cannot quantize K-quants):
# (the levels A's sub-block range spans: 2^bits - 1 codes from the minimum for Q2_K/Q4_K/Q5_K, 2^(bits - 1) from zero
# to the largest magnitude for Q3_K's and Q6_K's signed codes -4..3 and -32..31; values per sub-block; the levels of a
# sub-block's scale under d: 4-bit for Q2_K, 6-bit for Q4_K/Q5_K, 6-bit signed for Q3_K, int8 for Q6_K).  The step
# such a quantizer picks is range / levels, its scale then rounded to a multiple of d = (largest scale of the
# super-block) / scale levels.
K_FORMAT = {"Q2_K": (3, 16, 15), "Q3_K": (4, 16, 31), "Q4_K": (15, 32, 63), "Q5_K": (31, 32, 63),
            "Q6_K": (32, 16, 127)}
SUPER_BLOCK = 256  # values per K-quant super-block
# The bytes of a K-quant block that hold its values' codes (the rest are its scales): every one zero is zeroed_tensor
CODE_BYTES = {"Q2_K": ((16, 80),), "Q3_K": ((0, 96),), "Q4_K": ((16, 144),), "Q5_K": ((16, 48), (48, 176)),
              "Q6_K": ((0, 128), (128, 192))}


def read_blocks(path, info, expert: int | None = None):
    """A quantized tensor's blocks as bytes, [blocks, block bytes] (``expert``: that expert's part of a tensor
    stacking every expert)."""
    import numpy as np
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    _, size = GGML_QUANT_SIZES[GGMLQuantizationType(info.qtype)]
    start, length = info.offset, info.nbytes()
    if expert is not None:
        length //= info.shape[0]
        start += expert * length
    with open(path, "rb") as handle:
        handle.seek(start)
        return np.frombuffer(handle.read(length), dtype=np.uint8).reshape(-1, size)


def block_grid(raw, name: str, shape: tuple[int, ...]):
    """Each value's step and grid offset (None: the grid starts at zero), read from its block's scales, and the
    scales themselves by name ({"d": [blocks], ...}) for ``scale_problem``."""
    import numpy as np

    if name in K_QUANTS:
        steps, offsets, scales = k_quant_grid(raw, name)
    elif name == "MXFP4":  # an E8M0 exponent: d = 2^(e - 128), the grid's unit
        block = math.prod(shape) // len(raw)
        units = np.ldexp(np.float32(1.0), raw[:, 0].astype(np.int32) - 128).astype(np.float32)
        steps, offsets, scales = np.repeat(units, block), None, {}
    else:  # SCALE_FIRST: a float16 d in bytes 0-1 (Q4_1 and Q5_1: their minimum m in bytes 2-3, the grid's start)
        block = math.prod(shape) // len(raw)
        d = float16_at(raw, 0).reshape(-1)
        scales = {"d": d, **({"m": float16_at(raw, 2).reshape(-1)} if name in ("Q4_1", "Q5_1") else {})}
        steps, offsets = np.repeat(np.abs(d), block), np.repeat(scales["m"], block) if "m" in scales else None
    as_torch = [None if t is None else torch.from_numpy(np.ascontiguousarray(t)).reshape(shape)
                for t in (steps, offsets)]
    return as_torch[0], as_torch[1], scales


def k_quant_grid(raw, name: str):
    """Each value's step and grid offset, read from its K-quant super-block (``K_QUANTS``), and the super-blocks'
    float16 scales."""
    import numpy as np

    sub = K_FORMAT[name][1]
    if name in SIGNED_K:
        d, scale = k_signed_scales(raw, name)
        steps = np.repeat(np.abs(d * scale), sub, axis=1)
        return steps.reshape(-1), None, {"d": d.reshape(-1)}
    d, dmin, scale, minimum = k_min_scales(raw, name)
    steps = np.repeat(d * scale, sub, axis=1)
    offsets = np.repeat(-dmin * minimum, sub, axis=1)
    return steps.reshape(-1), offsets.reshape(-1), {"d": d.reshape(-1), "dmin": dmin.reshape(-1)}


def float16_at(raw, i: int):
    """The float16 in bytes i, i + 1 of each block, as float32 [blocks, 1]."""
    import numpy as np

    return raw[:, i:i + 2].copy().view(np.float16).astype(np.float32)


def k_signed_scales(raw, name: str):
    """Q6_K's and Q3_K's d [blocks, 1] and signed sub-block scales [blocks, 16] (value = d x scale x code).  Q6_K: 16
    int8 scales, then d.  Q3_K: 12 bytes of sixteen 6-bit scales (less 32), then d: scale j's low 4 bits in byte j mod 8
    (the high nibble for j >= 8), its high 2 bits in byte 8 + j mod 4 at bit 2 x (j div 4)."""
    import numpy as np

    d = float16_at(raw, raw.shape[1] - 2)
    if name == "Q6_K":
        return d, raw[:, -18:-2].view(np.int8).astype(np.float32)
    packed = raw[:, -14:-2].astype(np.int32)
    j = np.arange(16)
    low = (packed[:, j % 8] >> (4 * (j // 8))) & 0xF
    high = (packed[:, 8 + j % 4] >> (2 * (j // 4))) & 3
    return d, ((high << 4) | low).astype(np.float32) - 32


def k_min_scales(raw, name: str):
    """Q2_K's, Q4_K's and Q5_K's d and dmin [blocks, 1] and sub-block scales and minima [blocks, sub-blocks] (value =
    d x scale x q - dmin x min).  Q2_K: sixteen bytes of (scale, min) nibbles, then d and dmin.  Q4_K, Q5_K: d, dmin,
    then 12 bytes of eight 6-bit (scale, min) pairs."""
    import numpy as np

    if name == "Q2_K":
        pairs = raw[:, :16].astype(np.float32)
        size = raw.shape[1]
        return float16_at(raw, size - 4), float16_at(raw, size - 2), pairs % 16, pairs // 16
    packed = raw[:, 4:16].astype(np.int32)
    low = [(packed[:, j] & 63, packed[:, j + 4] & 63) for j in range(4)]
    high = [((packed[:, j + 4] & 0xF) | ((packed[:, j - 4] >> 6) << 4),
             (packed[:, j + 4] >> 4) | ((packed[:, j] >> 6) << 4)) for j in range(4, 8)]
    scale = np.stack([s for s, _ in low + high], axis=1).astype(np.float32)  # [blocks, 8]: one per 32 values
    minimum = np.stack([m for _, m in low + high], axis=1).astype(np.float32)
    return float16_at(raw, 0), float16_at(raw, 2), scale, minimum


def scale_problem(scales: dict, block_values: int, row: int) -> str | None:
    """The first block whose float16 scale is NaN/Inf (every value of it is then NaN/Inf), in words: its index,
    where its values lie, the scale; and how many blocks are so."""
    import numpy as np

    bad = np.zeros(len(next(iter(scales.values()))), dtype=bool) if scales else None
    if bad is None:
        return None
    for values in scales.values():
        bad |= ~np.isfinite(values)
    if not bad.any():
        return None
    first = int(np.flatnonzero(bad)[0])
    which = ", ".join(f"{n} = {float(v[first])}" for n, v in scales.items() if not np.isfinite(v[first]))
    start = first * block_values
    return (f"block {first} ({which}; values {start}-{start + block_values - 1} of the tensor as the file stores "
            f"it, row {start // row}): {int(bad.sum())} of {len(bad)} blocks have a NaN/Inf scale")


def codes_zero(raw, name: str) -> bool:
    """Every quantization code of a K-quant tensor is zero (the bytes ``CODE_BYTES`` names), whatever its scales."""
    spans = CODE_BYTES.get(name)
    return spans is not None and len(raw) > 0 and not any(raw[:, a:b].any() for a, b in spans)


def mxfp4_steps(units: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Each MXFP4 value's step: its block's unit d (``units``, per value) times the wider gap beside the value's
    magnitude on the E2M1 grid (``MXFP4_GAPS``)."""
    magnitude = (values.float().abs() / units.clamp_min(1e-38)).reshape(-1)
    gaps = torch.ones_like(magnitude)
    for on_grid, gap in MXFP4_GAPS.items():
        gaps = torch.where((magnitude - on_grid).abs() < 1e-3, torch.full_like(gaps, gap), gaps)
    return units * gaps.reshape(units.shape)
