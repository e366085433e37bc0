"""FP8 block-quantized safetensors (DeepSeek V3's and Qwen3's FP8 releases): an HF folder whose config.json says
``quantization_config = {quant_method: "fp8", fmt: "e4m3", weight_block_size: [128, 128], ...}`` and whose quantized
matrices are stored as ``X.weight`` (float8_e4m3fn) beside ``X.weight_scale_inv`` (float32, one per block:
[ceil(out / 128), ceil(in / 128)]); the true weight is each code times its block's ``weight_scale_inv``.  Tensors the
release leaves unquantized (``modules_to_not_convert``) have no scale and are read as stored.

``read`` returns the dequantized float32 weight, dequantized by compressed-tensors (``dequantize`` with a block
strategy of the config's ``weight_block_size``: the extra ``quant``), imported only when a checkpoint needs it.  Why
not transformers' own FP8 dequantizer (``Fp8Dequantize``, what ``FineGrainedFP8Config(dequantize=True)`` runs on
CPU): it infers the block from the scale grid (rows / grid rows) instead of reading ``weight_block_size``, so a matrix
whose sides are not multiples of the block is read with other blocks: on tests/test_quantized_fp8.py's tiny LLaMA
(gate_proj [200, 160], blocks 128x128, grid [2, 2], read as 100x80 blocks) its values lie 2.4 to 4.9 steps from the
unquantized weight's (up to 0.071, on each of the six FFN matrices), where compressed-tensors' lie within half a step
(0.0077 at most), as rounding to the nearest code does.  Where the two disagree, the one that follows the stated
block size is trusted.

The scale grid must be the one the stated block calls for: a grid of another shape is a conversion mistake
(``QuantizedLayoutError``: the scales transposed, or written for another block size), which a compare reports on
the layer that holds it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from parity.definitions.distribution import install_command
from parity.definitions.files import shown
from parity.errors import CheckpointError, QuantizedLayoutError
from parity.sources.checkpoint import Checkpoint

QUANT_METHOD = "fp8"
SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv
EXTRA = "quant"  # pyproject.toml's extra that installs compressed-tensors
CODE_DTYPE = "float8_e4m3fn"


@dataclass(frozen=True)
class FP8Scheme:
    """What config.json's quantization_config states: the block (rows, columns) each scale covers."""

    block: tuple[int, int]
    not_converted: tuple[str, ...] = ()
    power_of_two: bool = False  # scale_fmt "ue8m0": each scale a power of two (DeepSeek V3.1's UE8M0 scales)

    def describe(self) -> str:
        return (f"FP8 e4m3, {self.block[0]}x{self.block[1]} blocks"
                + (", power-of-two (ue8m0) scales" if self.power_of_two else ""))


@dataclass
class BlockQuantized:
    """One quantized matrix as its file stores it: the e4m3 codes, each block's scale (``weight_scale_inv``), and
    the block the config states.  Stored layout ([out, in])."""

    codes: object  # torch.Tensor, float8_e4m3fn
    scales: object  # torch.Tensor, float32 [ceil(out / block[0]), ceil(in / block[1])]
    block: tuple[int, int]
    scale_name: str
    power_of_two: bool = False


def scheme_of(raw_config: dict, where: str) -> FP8Scheme | None:
    """The FP8 block scheme config.json states, None for a checkpoint that is not FP8 block-quantized; a
    quantization_config parity cannot read the block of is a CheckpointError naming the field."""
    config = raw_config.get("quantization_config")
    if not isinstance(config, dict) or config.get("quant_method") != QUANT_METHOD:
        return None
    fmt = config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise CheckpointError(f"{where}: config.json's quantization_config.fmt is {fmt!r}; parity reads FP8 block "
                              "quantization in e4m3 (float8_e4m3fn) only")
    block = config.get("weight_block_size")
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise CheckpointError(f"{where}: config.json's quantization_config.weight_block_size is {block!r}; expected "
                              "two positive integers such as [128, 128] (the rows and columns each weight_scale_inv "
                              "covers)")
    scale_fmt = config.get("scale_fmt") or "float"
    if scale_fmt not in ("float", "ue8m0"):
        raise CheckpointError(f"{where}: config.json's quantization_config.scale_fmt is {scale_fmt!r}; parity reads "
                              "'float' (float32 scales) and 'ue8m0' (power-of-two scales)")
    skipped = config.get("modules_to_not_convert") or []
    return FP8Scheme((block[0], block[1]), tuple(str(s) for s in skipped if isinstance(s, str)),
                     scale_fmt == "ue8m0")


def require_library(where: str):
    """compressed-tensors' dequantize, or a CheckpointError (exit 2) naming what to install."""
    try:
        from compressed_tensors.quantization import QuantizationArgs
        from compressed_tensors.quantization.lifecycle.forward import dequantize
    except ImportError:
        raise CheckpointError(
            f"{where}: its weights are FP8 block-quantized (config.json: quantization_config.quant_method 'fp8'), "
            "which parity dequantizes with compressed-tensors, and that is not installed: "
            f"{install_command(EXTRA, fallback='compressed-tensors')} (ffn-parity's extra '{EXTRA}')") from None
    return QuantizationArgs, dequantize


def expected_grid(shape, block: tuple[int, int]) -> tuple[int, int]:
    """The scale grid the stated block calls for: one scale per block, partial edge blocks included."""
    return math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1])


def implied_blocks(shape, grid) -> str:
    """The power-of-two blocks a grid of this shape fits (ceil(side / block) == grid side), in words."""
    fits = []
    for side, cells in zip(shape[-2:], grid, strict=True):
        fits.append([2 ** k for k in range(0, 16) if cells and math.ceil(side / 2 ** k) == cells])
    if all(fits):
        return f"{fits[0][0]}x{fits[1][0]}" + (" or larger" if len(fits[0]) > 1 or len(fits[1]) > 1 else "")
    return "no power-of-two block"


def check_grid(location: str, name: str, codes, scales, block: tuple[int, int]) -> None:
    """The scale grid is the one the stated block calls for, else a QuantizedLayoutError saying what it is."""
    grid = expected_grid(codes.shape, block)
    found = tuple(scales.shape[-2:]) if scales.dim() >= 2 else tuple(scales.shape)
    if found == grid:
        return
    said = (f"{location}: {name}{SCALE_SUFFIX} has shape {list(scales.shape)} for {name} {list(codes.shape)}; "
            f"config.json's weight_block_size {list(block)} calls for one scale per block, {list(grid)}")
    if found == tuple(reversed(grid)):
        raise QuantizedLayoutError(f"{said}: it is that grid transposed", "fp8_scales_transposed")
    raise QuantizedLayoutError(f"{said}: it is the grid of {implied_blocks(codes.shape, found)} blocks, not the "
                               "stated ones", "fp8_block_size_wrong")


class FP8Checkpoint(Checkpoint):
    """An HF folder of FP8 block-quantized weights: ``read`` returns each quantized matrix dequantized (float32)
    by compressed-tensors; the scale tensors are kept apart from ``weight_map`` (they are part of their weight's
    storage, not tensors of the model)."""

    scheme: FP8Scheme
    scale_map: dict[str, str]
    as_stored: dict[str, str]  # tensor name -> its dtype in the file, for the tensors the last read returned

    def quantized(self, name: str) -> BlockQuantized | None:
        """How tensor ``name`` is stored, when it is block-quantized: its codes, scales and the stated block."""
        scale_name = name + SCALE_SUFFIX
        if scale_name not in self.scale_map or not self.has(name):
            return None
        codes = self.reader(self.weight_map[name], [name])[name]
        scales = self.reader(self.scale_map[scale_name], [scale_name])[scale_name]
        return BlockQuantized(codes, scales.float(), self.scheme.block, scale_name, self.scheme.power_of_two)

    def stored_dtype(self, name: str) -> str | None:
        """The dtype tensor ``name`` had in its file when last read (torch's name: ``bfloat16``), None if not read:
        a layer mixing dequantized float32 with a tensor left in bfloat16 is upcast to one dtype when read, and a
        compare must judge the bfloat16 one as the cast it is."""
        return self.as_stored.get(name)

    def read(self, names: list[str]):
        out = super().read(names)
        self.as_stored = {name: str(out[name].dtype).removeprefix("torch.") for name in names}
        for name in names:
            scale_name = name + SCALE_SUFFIX
            if scale_name in self.scale_map and out[name].dtype.itemsize == 1:
                scales = self.reader(self.scale_map[scale_name], [scale_name])[scale_name]
                out[name] = self.dequantize(name, out[name], scales)
        return out

    def dequantize(self, name: str, codes, scales):
        """compressed-tensors' block dequantization with the stated block (float32); the grid checked first."""
        import torch

        check_grid(self.location, name, codes, scales, self.scheme.block)
        arguments, dequantize = require_library(self.location)
        args = arguments(num_bits=8, type="float", strategy="block", block_structure=list(self.scheme.block),
                         symmetric=True, dynamic=False)
        return dequantize(codes, scales.float(), None, args=args, dtype=torch.float32)


def wrap(checkpoint: Checkpoint, folder: Path | str) -> Checkpoint:
    """``checkpoint`` as an FP8Checkpoint when its config states FP8 block quantization, else unchanged."""
    scheme = scheme_of(checkpoint.raw_config, shown(folder))
    if scheme is None:
        return checkpoint
    require_library(shown(folder))  # before anything is computed: exit 2 naming the extra
    scales = {n: f for n, f in checkpoint.weight_map.items() if n.endswith(SCALE_SUFFIX)}
    weights = {n: f for n, f in checkpoint.weight_map.items() if n not in scales}
    fields = {f.name: getattr(checkpoint, f.name) for f in dataclasses.fields(Checkpoint)}
    wrapped = FP8Checkpoint(**{**fields, "weight_map": weights, "notes": list(checkpoint.notes)})
    wrapped.scheme, wrapped.scale_map, wrapped.as_stored = scheme, scales, {}
    quantized = sum(1 for n in scales if n[:-len(SCALE_SUFFIX)] in weights)
    wrapped.notes.append(f"{scheme.describe()} (config.json quantization_config): {quantized} quantized matrices, "
                         "dequantized with compressed-tensors in the stated blocks (partial edge blocks included)"
                         + (f"; left unquantized: {', '.join(scheme.not_converted)}" if scheme.not_converted else "")
                         + "; target and reference both get the same dequantized float32 weights")
    return wrapped
