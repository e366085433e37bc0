"""compressed-tensors' integer layouts read by compressed-tensors itself: ``pack-quantized`` (what llm-compressor's
GPTQ and AWQ write: codes packed densely into int32, unpacked by ``unpack_from_int32`` and dequantized by
``PackedQuantizationCompressor.decompress``) and ``int-quantized`` (its W8A8 schemes: one int8 code per value,
dequantized by ``NaiveQuantizationCompressor.decompress``), each returned as its grid and its weight.

compressed-tensors 0.20 no longer applies a ``weight_g_idx`` (its act-order "group" mode was removed); a file that
holds one is dequantized from its grid, each column's scale taken from the group it names, as the releases that wrote
it did."""

from __future__ import annotations

from parity.errors import CheckpointError
from parity.sources.int_schemes import (
    PACKED,
    PARTS,
    STORED,
    GroupQuantized,
    IntScheme,
    bits_error,
    check_groups,
    layout_error,
    require_library,
)


def check_stray_zeros(where: str, name: str, scheme: IntScheme, parts: dict) -> None:
    """A symmetric compressed-tensors scheme stores no zero points; its ``decompress`` subtracts one it finds in the
    file as stored (packed words and all), where vLLM's symmetric kernels have no place for it: read two ways, or a
    crash in the library (packed words of another shape than the scales).  Nonzero or of another shape than
    ``weight_scale``: a QuantizedLayoutError naming it.  Zero ones of the scales' shape change no reader's values."""
    zero_point = parts.get("weight_zero_point")
    if not scheme.sym or scheme.method not in (PACKED, STORED) or zero_point is None:
        return
    scale = parts.get("weight_scale")
    if scale is not None and zero_point.shape == scale.shape and not bool(zero_point.any()):
        return
    raise layout_error(where, name, f"it stores a weight_zero_point {list(zero_point.shape)} (nonzero, or not of "
                       f"weight_scale's shape) beside the stated {scheme.describe()}, which has none: "
                       "compressed-tensors' decompress subtracts it as stored, vLLM's symmetric kernels ignore it; "
                       "state the scheme asymmetric (symmetric: false) or drop the tensor", "zero_point_off_by_one")


def read_packed(where: str, name: str, scheme: IntScheme, parts: dict) -> tuple[GroupQuantized, object]:
    """compressed-tensors' pack-quantized layout, unpacked by compressed-tensors (``unpack_from_int32``) for the grid
    and dequantized by its ``PackedQuantizationCompressor.decompress`` (``weight_packed`` [out, in x bits / 32]
    packed densely along the inputs, ``weight_scale`` [out, groups], ``weight_zero_point`` packed along the outputs,
    ``weight_shape``); a ``weight_g_idx`` (which compressed-tensors 0.20 no longer applies) picks each column's group
    here.  Returns the grid and the dequantized weight (float32)."""
    import torch

    library = require_library(where)
    packed, scales = parts["weight_packed"], parts["weight_scale"]
    outputs, inputs = (int(v) for v in parts["weight_shape"].tolist())
    if packed.shape[0] != outputs or outputs <= 0 or inputs <= 0:
        raise CheckpointError(f"{where}: {name}'s weight_packed holds {packed.shape[0]} rows where its weight_shape "
                              f"states [{outputs}, {inputs}]; pack-quantized stores one row of words per output")
    if packed.shape[-1] != -(-inputs * scheme.bits // 32):
        raise bits_error(where, name, scheme, packed.shape[-1], inputs, "inputs per row (weight_shape)")
    check_groups(where, name, scheme, inputs, outputs, scales)
    codes = library.unpack(packed, scheme.bits, torch.Size([outputs, inputs])).to(torch.int64)
    zeros = torch.zeros(scales.shape, dtype=torch.float32)
    if "weight_zero_point" in parts and not scheme.library.weights.symmetric:
        zero_point = parts["weight_zero_point"]
        words = [-(-scales.shape[0] * scheme.bits // 32), scales.shape[1]]  # packed along the outputs
        if list(zero_point.shape) != words:
            raise layout_error(where, name, f"its weight_zero_point is {list(zero_point.shape)} beside weight_scale "
                               f"{list(scales.shape)}; {scheme.bits}-bit zero points packed along the outputs fill "
                               f"{words}", "group_size_wrong")
        zeros = library.unpack(zero_point, scheme.bits, torch.Size(scales.shape), packed_dim=0).float()
    g_idx = parts.get("weight_g_idx")
    sequential = torch.arange(inputs) // (scheme.group_size or inputs)
    grid = GroupQuantized(codes, scales.float(), zeros, sequential if g_idx is None else g_idx.to(torch.int64),
                          -(1 << (scheme.bits - 1)), (1 << (scheme.bits - 1)) - 1, PACKED, scheme.bits)
    if g_idx is not None:
        return grid, grid.values()
    state = {key: value for key, value in parts.items() if key != "weight_g_idx"}
    weight = library.compressor.decompress(state, scheme.library)["weight"]
    return grid, weight.float()


def narrowest_bits(low: int, high: int) -> int:
    """The fewest bits whose signed codes span ``low`` to ``high``."""
    bits = 1
    while low < -(1 << (bits - 1)) or high > (1 << (bits - 1)) - 1:
        bits += 1
    return bits


def read_stored(where: str, name: str, scheme: IntScheme, parts: dict) -> tuple[GroupQuantized, object]:
    """compressed-tensors' int-quantized layout: ``weight`` the codes as stored (int8 [out, in]), ``weight_scale``
    [out, groups] ([out, 1] per channel, one value per tensor), ``weight_zero_point`` beside it when asymmetric;
    dequantized by its ``NaiveQuantizationCompressor.decompress``.  Returns the grid and the weight (float32)."""
    import torch

    library = require_library(where)
    codes, scales = parts["weight"], parts["weight_scale"]
    if codes.dim() != 2 or codes.dtype.is_floating_point or codes.dtype.itemsize != 1:
        raise layout_error(where, name, f"it is {str(codes.dtype).removeprefix('torch.')} {list(codes.shape)} beside "
                           f"its weight_scale; the stated {scheme.describe()} stores one int8 code per value of a "
                           "matrix", "group_bits_mismatched")
    outputs, inputs = codes.shape
    whole = scales.numel() == 1 and scheme.library.weights.strategy == "tensor"
    if whole:
        scales = scales.reshape(1, 1).expand(outputs, 1)
    check_groups(where, name, scheme, inputs, outputs, scales)
    low, high = -(1 << (scheme.bits - 1)), (1 << (scheme.bits - 1)) - 1
    if int(codes.min()) < low or int(codes.max()) > high:
        raise layout_error(where, name, f"its codes span {int(codes.min())} to {int(codes.max())}; "
                           f"{scheme.bits}-bit codes lie in {low} to {high}", "group_bits_mismatched")
    narrow = narrowest_bits(int(codes.min()), int(codes.max()))
    # min-max scales put every group's extreme value on the stated width's end code: a faithful export reaches it
    if narrow < scheme.bits and bool(codes.any()):
        raise layout_error(where, name, f"its codes span {int(codes.min())} to {int(codes.max())}, those of "
                           f"{narrow}-bit codes, where the stated {scheme.bits}-bit scales put each group's largest "
                           f"value at {-low} or {high}", "group_bits_mismatched")
    zeros = torch.zeros(scales.shape, dtype=torch.float32)
    if "weight_zero_point" in parts and not scheme.sym:
        zero_point = parts["weight_zero_point"]
        if zero_point.shape != parts["weight_scale"].shape:
            raise layout_error(where, name, f"its weight_zero_point is {list(zero_point.shape)} beside weight_scale "
                               f"{list(parts['weight_scale'].shape)}; the stated {scheme.describe()} stores one zero "
                               "point per scale", "group_size_wrong")
        zeros = zero_point.reshape(-1, 1).expand(scales.shape).float() if whole else zero_point.float()
    sequential = torch.arange(inputs) // (scheme.group_size or inputs)
    grid = GroupQuantized(codes.to(torch.int64), scales.float().contiguous(), zeros, sequential, low, high, STORED,
                          scheme.bits, whole)
    state = {key: parts[key] for key in PARTS[STORED] if key in parts}
    weight = library.naive.decompress(state, scheme.library)["weight"]
    return grid, weight.float()
