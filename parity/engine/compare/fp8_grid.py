"""FP8 block quantization (``parity.sources.fp8_blocks``) judged against its own grid, for ``parity compare``: each
value's step (the e4m3 spacing at its code times its block's ``weight_scale_inv``), A re-quantized the way the format
does (each block's scale its largest magnitude over e4m3's largest value, as compressed-tensors' ``calculate_qparams``
computes it, the codes rounded by compressed-tensors' ``quantize``), and the conversion mistakes a writer or reader of
the format makes, replayed on A's tensor: the scale inverted (codes times the scale where the format divides by it,
i.e. a ``weight_scale`` written where ``weight_scale_inv`` belongs), the scales transposed, the blocks of another size
(a writer that split each side evenly into the grid's count, as transformers' dequantizer infers them).

Everything here works in the layout the file stores ([out, in]); ``conversion`` routes it to the reference's.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from parity.definitions.mapping import TensorRoute
from parity.engine.compare.storage import Storage, dtype_name
from parity.engine.layer import route_tensor

CODES = torch.float8_e4m3fn
# A block's scale in B's file may exceed the one the format chooses for A's values there (largest magnitude / 448) by
# this before it is grid_too_coarse: scale_fmt "ue8m0" rounds it up to a power of two (up to 2x); a float scale is
# amax / 448 exactly (compressed-tensors, DeepSeek's and transformers' quantizers).  A coarser e4m3 scale keeps each
# normal value's relative precision but pushes the block's small values into e4m3's subnormals and to zero: measured on
# the tests' fixture, up_proj of layer 1 with every scale x 4096 still passed on the function (1.16 x the conversion's
# deviation), its values within their own (coarser) steps.
GRID_FACTOR = 2.0


def expand(scales: torch.Tensor, block: tuple[int, int], shape) -> torch.Tensor:
    """Each block's scale at every value of its block (partial edge blocks cut to the matrix), ``shape``'s size."""
    rows, cols = shape[-2:]
    return scales.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]


def code_spacing(codes: torch.Tensor) -> torch.Tensor:
    """The e4m3 spacing at each code (float32): the gap above its magnitude (the wider gap beside a power of two), the
    subnormal spacing at zero and below e4m3's smallest normal."""
    info = torch.finfo(CODES)
    exponent = torch.frexp(codes.float())[1]
    magnitude = torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent - 1)
    return info.eps * torch.where(codes.float() == 0, info.tiny, magnitude.clamp_min(info.tiny))


def steps(codes: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Each stored value's step: the e4m3 spacing at its code times its block's scale."""
    return code_spacing(codes) * expand(scales, block, codes.shape)


def stored(checkpoint, key: str, route: TensorRoute) -> Storage | None:
    """How an FP8 block-quantized checkpoint stores ``key`` (``parity.sources.fp8_blocks``): each value's step is the
    e4m3 spacing at its code times its block's scale, read from the file; None for a tensor stored unquantized."""
    quantized = getattr(checkpoint, "quantized", None)
    held = quantized(key) if quantized is not None else None
    if held is None:
        return None
    each = steps(held.codes, held.scales, held.block)
    bad = ~torch.isfinite(held.scales)
    problem = None
    if bool(bad.any()):
        first = [int(i) for i in bad.nonzero()[0]]
        problem = (f"block {first} ({held.scale_name} = {float(held.scales[tuple(first)])}): {int(bad.sum())} of "
                   f"{bad.numel()} blocks have a NaN/Inf scale")
    return Storage(dtype_name(held.codes.dtype), True, route_tensor(route, each), "file", route,
                   nonfinite_scale=problem, zeroed=not bool(held.codes.float().any()), block=held.block,
                   power_of_two=held.power_of_two, scale_dtype=held.scale_dtype, scales=held.scales)


def library_args(block: tuple[int, int]):
    """compressed-tensors' description of FP8 e4m3 block quantization with ``block``."""
    from parity.sources.fp8_blocks import require_library

    arguments = require_library("FP8 block quantization").QuantizationArgs
    return arguments(num_bits=8, type="float", strategy="block", block_structure=list(block), symmetric=True,
                     dynamic=False)


def block_tiles(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """A matrix as its blocks [grid rows, block rows, grid columns, block columns], the partial edge blocks padded
    with zeros (which change no block's largest magnitude)."""
    rows, cols = x.shape[-2:]
    grid = math.ceil(rows / block[0]), math.ceil(cols / block[1])
    padded = torch.nn.functional.pad(x.float(), (0, grid[1] * block[1] - cols, 0, grid[0] * block[0] - rows))
    return padded.reshape(grid[0], block[0], grid[1], block[1])


def coarse_blocks(x: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> dict | None:
    """Blocks whose scale in B's file exceeds ``GRID_FACTOR`` x the scale the format chooses for A's values there
    (their largest magnitude / 448): None when no block does; else how many, and the worst, with evidence (the keys
    ``findings.grid_finding`` words; a block's "step" here is its scale, the unit of its e4m3 grid)."""
    needed = block_tiles(x, block).abs().amax(dim=(1, 3)) / torch.finfo(CODES).max
    if scales.shape != needed.shape:
        return None
    limit = GRID_FACTOR * needed * (1 + 2.0 ** -20)  # the float32 rounding of B's scale
    over = torch.where(needed > 0, scales.float() / limit, torch.zeros_like(limit)).nan_to_num(0.0)
    if not bool((over > 1).any()):
        return None
    worst = int(over.argmax())
    row, column = divmod(worst, scales.shape[1])
    first = column * block[1]
    return {"blocks_too_coarse": int((over > 1).sum()), "blocks": over.numel(), "worst_block": worst,
            "row": row * block[0], "values": [first, min(first + block[1], x.shape[-1]) - 1],
            "b_step": float(scales.reshape(-1)[worst]), "a_step": float(needed.reshape(-1)[worst]),
            "limit": float(limit.reshape(-1)[worst]),
            "times_coarser": float(scales.reshape(-1)[worst] / needed.reshape(-1)[worst])}


def quantize(x: torch.Tensor, block: tuple[int, int], *, power_of_two: bool = False, scale_dtype: str = "float32"
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """A's matrix (stored layout) quantized the way the format does: each block's scale from its largest magnitude
    (compressed-tensors' ``calculate_qparams``; with ``power_of_two``, scale_fmt "ue8m0", the power of two at or
    above it, as transformers' Fp8Quantize rounds it), the codes by compressed-tensors' ``quantize``, both in the
    dtype B stores its scales in (``scale_dtype``: llm-compressor keeps a bfloat16 model's scales in bfloat16 and
    divides in bfloat16; its FP8_BLOCK export of the Gemma 3 270M stand-in holds exactly these codes, where float32
    arithmetic gave 3 % of them another code and its faithful layers 0.96 to 1.30 x the conversion's deviation).
    Returns the
    codes (as float32 values of e4m3) and the scales [ceil(rows / block[0]), ceil(cols / block[1])]."""
    from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = library_args(block)
    tiles = block_tiles(x.float(), block)
    scales, zeros = calculate_qparams(tiles.amin(dim=(1, 3)), tiles.amax(dim=(1, 3)), args)
    if power_of_two:
        scales = torch.exp2(torch.ceil(torch.log2(scales.clamp_min(torch.finfo(torch.float32).tiny))))
    dtype = getattr(torch, scale_dtype)  # the codes computed in the dtype B keeps its scales in, as its writer did;
    dtype = dtype if dtype.itemsize >= 2 else torch.float32  # ue8m0 (float8_e8m0fnu) powers of two: in float32
    scales = scales.to(dtype)
    codes = ct_quantize(x.to(dtype), scales, zeros, args, dtype=CODES)
    return codes.float(), scales.float()


def requantize(x: torch.Tensor, block: tuple[int, int], *, power_of_two: bool = False, scale_dtype: str = "float32"
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """A's matrix (stored layout) as a faithful FP8 export holds it, dequantized (float32), and each value's step."""
    codes, scales = quantize(x, block, power_of_two=power_of_two, scale_dtype=scale_dtype)
    return codes * expand(scales, block, codes.shape), steps(codes, scales, block)


def reference(x: torch.Tensor, storage: Storage) -> tuple[torch.Tensor, str, torch.Tensor]:
    """A's matrix (stored layout) as B's FP8 storage would hold it (``requantize``), how it was made, and each value's
    step."""
    values, each = requantize(x, storage.block, power_of_two=storage.power_of_two, scale_dtype=storage.scale_dtype)
    scale = "the power of two at or above " if storage.power_of_two else ""
    return (values, f"re-quantized to {storage.dtype} in {storage.block[0]}x{storage.block[1]} blocks with "
            f"compressed-tensors (scale: {scale}the block's largest magnitude / 448)", each)


def even_block(shape, block: tuple[int, int]) -> tuple[int, int]:
    """The block a writer uses that splits each side evenly into the stated grid's count of blocks (what
    transformers' dequantizer infers from a grid): ceil(side / grid side)."""
    rows, cols = shape[-2:]
    grid = math.ceil(rows / block[0]), math.ceil(cols / block[1])
    return math.ceil(rows / grid[0]), math.ceil(cols / grid[1])


def mistakes(x: torch.Tensor, block: tuple[int, int], *, power_of_two: bool = False, scale_dtype: str = "float32"
             ) -> list[tuple[str, str, torch.Tensor]]:
    """The FP8 conversion mistakes that keep B's grid the stated shape, each as (mistake id, detail, A's matrix as
    the broken export reads back; stored layout): the scale inverted; the scales transposed (a square grid: another
    shape is refused when the file is read); the codes quantized in blocks of another size than the stated one."""
    codes, scales = quantize(x, block, power_of_two=power_of_two, scale_dtype=scale_dtype)
    found = [("fp8_scale_inverted", "codes times 1 / weight_scale_inv (the scale stored inverted)",
              codes * expand(1.0 / scales, block, codes.shape))]
    if scales.shape[0] == scales.shape[1] and scales.shape[0] > 1:
        found.append(("fp8_scales_transposed", f"weight_scale_inv transposed (grid {list(scales.shape)})",
                      codes * expand(scales.t(), block, codes.shape)))
    other = even_block(x.shape, block)
    if other != tuple(block):
        codes_other, scales_other = quantize(x, other, power_of_two=power_of_two, scale_dtype=scale_dtype)
        found.append(("fp8_block_size_wrong", f"quantized in {other[0]}x{other[1]} blocks, read in the stated "
                      f"{block[0]}x{block[1]}", codes_other * expand(scales_other, block, codes.shape)))
    return found


def replays(x: torch.Tensor, block: tuple[int, int], back: Callable[[torch.Tensor], torch.Tensor], *,
            power_of_two: bool = False, scale_dtype: str = "float32") -> list[tuple[str, str, torch.Tensor]]:
    """``mistakes`` with each result put into the reference's layout by ``back``."""
    found = mistakes(x, block, power_of_two=power_of_two, scale_dtype=scale_dtype)
    return [(mistake, detail, back(values)) for mistake, detail, values in found]
