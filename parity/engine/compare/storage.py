"""How a checkpoint stores one tensor (``Storage``), and the two layouts a compare moves between: the layout the file
stores a tensor in (where each format's blocks and groups lie) and the reference's (transformers' parameter, where A
and B are compared).  Every format's grid module fills a ``Storage`` and works in the stored layout; ``conversion``
dispatches to them.  Kept apart from ``conversion`` so that a format's module can use these without importing the
dispatch that imports it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from parity.definitions.mapping import TensorRoute

if TYPE_CHECKING:
    from parity.engine.compare.fp4_grid import Fp4Storage
    from parity.engine.compare.group_grid import Grid
    from parity.engine.compare.mlx_grid import MLXStorage


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
    scale_dtype: str = "float32"  # FP8: the dtype its scales are stored in (llm-compressor: the model's, bfloat16)
    scales: torch.Tensor | None = None  # FP8 block quantization: each block's scale, read from the file
    levels: torch.Tensor | None = None  # a grid parity cannot read (IQ, NVFP4): B's own values, stored layout
    codebook: object | None = None  # bitsandbytes 4-bit: parity.sources.bnb_4bit.Packed4bit, read from the file
    mlx: MLXStorage | None = None  # MLX quantization (affine or microscaled): codes, scales, biases (stored layout)
    fp4: Fp4Storage | None = None  # FP4 groups (GPT-OSS MXFP4, compressed-tensors NVFP4/MXFP4): level, scale, group
    group: Grid | None = None  # integer group quantization (GPTQ, AWQ, pack-quantized): B's own grid
    importance: str | None = None  # GGUF: the importance matrix B's metadata names, in a type it weights (gguf_grid)

    @property
    def microscaled(self) -> bool:
        """Whether the tensor is stored in a microscaled format (FP4 groups; MLX's mxfp4, nvfp4, mxfp8)."""
        return self.fp4 is not None or (self.mlx is not None and not self.mlx.affine)

    @property
    def wide_steps(self) -> bool:
        """Whether the tensor is rounded to nearest on groups whose steps are wide enough to hide a small factor over
        the whole tensor (``conversion.CONVERTED_SCALE``): a microscaled format, MLX's affine groups, bitsandbytes'
        4-bit code books."""
        return self.microscaled or self.mlx is not None or self.codebook is not None

    @property
    def nearest(self) -> bool:
        """Whether a faithful writer rounds the tensor to the nearest code on the grid the file stores (each block's
        codes the nearest on its own stored scales): ``wide_steps``, and GGUF's types with their scales read from
        the file (llama.cpp's quantizers, K-quants' scale searches included, round each code on the final scales),
        unless an importance matrix weights them.  B's factor on A's conversion is then 1."""
        return self.wide_steps or (self.qtype is not None and self.quantized and self.importance is None
                                   and self.levels is None)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def stored_layout(route: TensorRoute | None, tensor: torch.Tensor) -> torch.Tensor | None:
    """A reference-layout tensor put back into the layout its checkpoint stores it in (undoing a transpose);
    None for a chunk of a fused tensor (its blocks span both halves)."""
    if route is None or route.chunk is not None:
        return None
    return tensor.t() if route.transform == "transpose" else tensor


def unstored(route: TensorRoute | None, tensor: torch.Tensor) -> torch.Tensor:
    """A tensor in its checkpoint's stored layout put into the reference's layout (``stored_layout`` undone)."""
    tensor = tensor.float()
    return tensor.t() if route is not None and route.transform == "transpose" else tensor


def spacing(values: torch.Tensor, dtype: str) -> torch.Tensor:
    """One unit in the last place of ``dtype`` (a torch dtype's name; float32 for anything else, such as a GGUF
    quantized type dequantized) at each value, in float32: the rounding that storing the value in it may cause."""
    kind = getattr(torch, dtype, None)
    info = torch.finfo(kind if isinstance(kind, torch.dtype) and kind.is_floating_point else torch.float32)
    limit = min(info.max, torch.finfo(torch.float32).max)
    exponent = torch.frexp(values.float().nan_to_num(0.0, limit, -limit))[1]
    magnitude = torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent - 1)
    return info.eps * torch.where(values == 0, info.tiny, magnitude.clamp_min(info.tiny))


def level_steps(levels: torch.Tensor) -> torch.Tensor:
    """Each code's step: the wider of the two gaps beside its level in the sorted code book (at an end, its one gap):
    bitsandbytes' NF4/FP4 code books, an MLX microscaled mode's levels."""
    order = levels.argsort()
    gaps = levels[order].diff()
    wide = torch.maximum(torch.cat([gaps[:1], gaps]), torch.cat([gaps, gaps[-1:]]))
    steps = torch.empty_like(levels)
    steps[order] = wide
    return steps


def least_squares_factor(a: torch.Tensor, b: torch.Tensor) -> float:
    """B's least-squares factor on A over the whole tensor, sum(A B) / sum(A A) in float64; 1 where A is all
    zeros."""
    x, y = a.double(), b.double()
    energy = float((x * x).sum())
    return float((x * y).sum()) / energy if energy > 0 else 1.0


def rms_distance(values: torch.Tensor, x: torch.Tensor) -> float:
    """Root mean square of ``values`` - ``x`` (float32): how far a rounding of ``x`` lies from it."""
    return float((values.float() - x.float()).pow(2).mean().sqrt())


def least_squares_scales(x: torch.Tensor, b: torch.Tensor, group: int, *, bounds: tuple[float, float],
                         block_bounds: tuple[float, float]) -> dict:
    """B's least-squares factor on A, sum(A B) / sum(A A), of the whole tensor, of each row and of each block of
    ``group`` values (stored layout [rows, values]), the ones farthest from 1 with where they are, and whether any
    lies outside ``bounds`` (tensor, row) or ``block_bounds`` (block).  A quantizer that moves values by more than a
    step (an importance matrix, GPTQ's compensation) still fits each block's scale to A's values there: a block, a
    row or the tensor multiplied or negated after quantizing does not."""
    xf, bf = x.double(), b.double()

    def factors(a2: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
        energy = (a2 * a2).sum(-1)
        return torch.where(energy > 0, (a2 * b2).sum(-1) / energy.clamp_min(1e-300), 1.0)

    def worst(found: torch.Tensor) -> tuple[int, float]:
        at = int(found.log().nan_to_num(-math.inf).abs().argmax()) if bool((found > 0).all()) else int(found.argmin())
        return at, float(found[at])

    tensor = float(factors(xf.reshape(1, -1), bf.reshape(1, -1))[0])
    row_at, row = worst(factors(xf.reshape(xf.shape[0], -1), bf.reshape(bf.shape[0], -1)))
    block_at, block = worst(factors(xf.reshape(-1, group), bf.reshape(-1, group)))
    (low, high), (block_low, block_high) = bounds, block_bounds
    beyond = not (low <= tensor <= high and low <= row <= high and block_low <= block <= block_high)
    return {"tensor": tensor, "worst_row": row_at, "row": row, "worst_block": block_at, "block": block,
            "block_values": group, "bounds": [low, high], "block_bounds": [block_low, block_high], "beyond": beyond}
