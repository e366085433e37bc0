"""What an FP4 tensor stored in groups is, whoever wrote it (GPT-OSS's MXFP4 experts, ``mxfp4_experts``;
compressed-tensors' NVFP4 and MXFP4, ``fp4_packed``): each value an e2m1 code times its group's scale.  The readers
fill ``Fp4Held``; ``engine.compare.fp4_grid`` judges it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

@dataclass
class Fp4Held:
    """One FP4 tensor as its file stores it ([E, out, in], or one expert's or matrix's [out, in]): each value's e2m1
    level (float32), each group's scale as the reader multiplies it (float32, [..., out, in / group]), the group size,
    the dtype B left its other tensors in, what reports call the storage, and whether the scales are powers of two
    (e8m0) or finer (NVFP4's e4m3, which ``fp4_grid`` holds to a tighter bound)."""

    levels: torch.Tensor
    scales: torch.Tensor
    group: int
    dtype: str
    name: str
    power_of_two: bool = True
    e4m3_unit: float = 1.0  # e4m3 scales: what one unit of the stored scale is worth (NVFP4: 1 / its global scale)


def e2m1_values():
    """The 16 e2m1 values a nibble decodes to (transformers' FP4_VALUES, the table its MXFP4 dequantizer uses;
    compressed-tensors' unpacker gives the same values), float32."""
    import torch
    from transformers.integrations.mxfp4 import FP4_VALUES

    return torch.tensor(FP4_VALUES, dtype=torch.float32)


def norm_dtype(checkpoint) -> str:
    """The dtype a quantizer left ``checkpoint``'s unquantized tensors in, read off a norm's weight in its local
    header (bfloat16 or float16), else float32: what A is cast to before it is rounded onto B's FP4 groups."""
    described = checkpoint.describe([n for n in checkpoint.weight_map if n.endswith("norm.weight")][:1]) or {}
    kinds = {"BF16": "bfloat16", "F16": "float16"}
    return next((kinds[kind] for _, kind in described.values() if kind in kinds), "float32")
