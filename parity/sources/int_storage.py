"""How integer group-quantized safetensors store one quantized module, and each layout read back into its grid
(``GroupQuantized``: codes, scales, zero points, each input's group): compressed-tensors' ``pack-quantized`` (what
llm-compressor's GPTQ and AWQ write) and ``int-quantized`` (its W8A8 schemes: one int8 code per value), GPTQ
(AutoGPTQ / GPTQModel) and AWQ (AutoAWQ's GEMM layout); the layout checks they share (each part present and of its
format's shape, the scale grid of the stated group size).  What config.json states, and the checkpoint that reads
through these, is ``int_groups``.

Who unpacks what, and why:

* ``pack-quantized`` is unpacked and dequantized by compressed-tensors itself (``PackedQuantizationCompressor.
  decompress``: the extra ``quant``); ``int-quantized`` (and ``naive-quantized`` of integer weights) by its
  ``NaiveQuantizationCompressor.decompress``, its codes ``X.weight`` as stored.  compressed-tensors 0.20 no longer
  applies a ``weight_g_idx`` (its act-order "group" mode was removed); a file that holds one is dequantized here with
  each column's scale taken from the group it names, as the releases that wrote it did.
* GPTQ and AWQ are unpacked by the small code below.  The ecosystem's libraries do not install here without
  replacing the project's torch: gptqmodel 7.7.0 requires torch 2.14.1, which pip installs in place of the
  project's 2.13 (in a scratch venv: the CUDA 13 build), and autoawq 0.2.9 (the last release; the project is
  archived) failed in pip's resolver after 32 s in a scratch venv sharing the system's packages.  transformers 5's
  GPTQ and AWQ integrations load through gptqmodel.  The layouts are pinned to those libraries' own code, cited at
  each function, and gptqmodel 7.7.0's own GPTQ (2, 3, 4 and 8 bits) and AWQ GEMM exports, quantized on CPU in that
  venv, read here as it reads them (docs/compare.md, "Checked on the tools' own files").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING

from parity.definitions.distribution import install_command
from parity.errors import CheckpointError, QuantizedLayoutError

if TYPE_CHECKING:  # the scheme a reader is given (int_groups reads it from config.json)
    from parity.sources.int_groups import IntScheme

PACKED = "pack-quantized"
# compressed-tensors' unpacked integer codes: llm-compressor's W8A8 schemes write "int-quantized"; "naive-quantized" is
# its fallback compressor's name for the same layout (compressed_tensors.config.CompressionFormat)
STORED, NAIVE = "int-quantized", "naive-quantized"
EXTRA = "quant"  # pyproject.toml's extra that installs compressed-tensors
# AutoAWQ's GEMM packing (awq/modules/linear/gemm.py, WQLinear_GEMM.from_linear): nibble i of each int32 holds output
# column 8 x col + AWQ_ORDER[i]
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# the tensors each method stores for one quantized module X (beside which X.weight does not exist), and how each is
# stored, as each format's own writer stores it (GPTQModel's PackableQuantLinear.pack, AutoAWQ's
# WQLinear_GEMM.from_linear, compressed-tensors' PackedQuantizationCompressor and NaiveQuantizationCompressor): the
# dimensions it may have, and its dtype ("int32": packed words; "int": any integer dtype; "float")
STORAGE = {"gptq": {"qweight": ((2,), "int32"), "qzeros": ((2,), "int32"), "scales": ((2,), "float"),
                    "g_idx": ((1,), "int")},
           "awq": {"qweight": ((2,), "int32"), "qzeros": ((2,), "int32"), "scales": ((2,), "float")},
           PACKED: {"weight_packed": ((2,), "int32"), "weight_scale": ((2,), "float"),
                    "weight_zero_point": ((2,), "int32"), "weight_shape": ((1,), "int"), "weight_g_idx": ((1,), "int")},
           STORED: {"weight": ((2,), "int"), "weight_scale": ((0, 1, 2), "float"),
                    "weight_zero_point": ((0, 1, 2), "int")}}
PARTS = {method: tuple(parts) for method, parts in STORAGE.items()}
CODES_PART = {"gptq": "qweight", "awq": "qweight", PACKED: "weight_packed", STORED: "weight"}
# what W8A8's static activation quantization stores beside a weight: a runtime input scale, no part of the weights
ACTIVATION_PARTS = ("input_scale", "input_zero_point")


@dataclass
class GroupQuantized:
    """One quantized matrix as its file stores it, unpacked, in ``nn.Linear``'s [out, in]: integer codes, each
    group's scale and zero point ([out, groups], in code units), the group of each input column (``g_idx``), and the
    codes' range."""

    codes: object  # torch.Tensor int64 [out, in]
    scales: object  # float32 [out, groups]
    zeros: object  # float32 [out, groups]
    g_idx: object  # int64 [in]
    low: int
    high: int
    method: str
    bits: int
    whole: bool = False  # one scale (and zero point) for the whole matrix: compressed-tensors' strategy "tensor"

    def values(self):
        """The dequantized weight (float32): scale x (code - zero) of each value's group."""
        return (self.codes.float() - self.zeros[:, self.g_idx]) * self.scales[:, self.g_idx]


def require_library(where: str):
    """compressed-tensors (its QuantizationConfig, the pack-quantized compressor and its unpacker), or a
    CheckpointError (exit 2) naming what to install."""
    try:
        from compressed_tensors.compressors.naive_quantized.base import NaiveQuantizationCompressor
        from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
        from compressed_tensors.quantization import QuantizationConfig
    except ImportError:
        raise CheckpointError(
            f"{where}: its weights are integer-quantized in compressed-tensors' pack-quantized or int-quantized "
            "format, which parity reads with compressed-tensors, and that is not installed: "
            f"{install_command(EXTRA, fallback='compressed-tensors')} (ffn-parity's extra '{EXTRA}')") from None
    return SimpleNamespace(QuantizationConfig=QuantizationConfig, compressor=PackedQuantizationCompressor,
                           naive=NaiveQuantizationCompressor, unpack=unpack_from_int32)


def per_block(bits: int) -> tuple[int, int]:
    """(int32 words, codes) of the smallest run of whole words that holds whole codes: one word of 32 / bits codes
    for 2, 4 and 8 bits; three words of 32 codes for 3 bits."""
    words = bits // math.gcd(bits, 32)
    return words, 32 * words // bits


def packed_count(words: int, bits: int) -> int | None:
    """How many codes ``words`` int32 words hold at ``bits`` each; None where they are not whole runs of words
    (``per_block``): another width than the stated one."""
    run, codes = per_block(bits)
    return None if words % run else words // run * codes


def holds(words: int, count: int, bits: int) -> bool:
    """Whether ``words`` int32 words are what ``count`` codes of ``bits`` take: whole runs (``per_block``), or
    ceil(count x bits / 32) words with the last partly filled, as GPTQModel 7.7.0 allocates a dimension that is not
    a multiple of 32 / bits (``_register_gptq_buffers``, ``pack_original``: stories260K's d_ff 172 in 22 words at 4
    bits; its ``dequantize_weight`` drops the tail codes past the scales' outputs and g_idx's inputs)."""
    run, per_run = per_block(bits)
    return words in (-(-count * bits // 32), -(-count // per_run) * run)


def unpack_stream(words, bits: int, count: int | None = None):
    """Codes packed as one little-endian bit stream along the first axis of ``words`` ([words, ...] int32 or int64),
    each run of ``per_block(bits)`` words holding its codes low bits first; a code may straddle two words (GPTQ's
    3 bits: codes 10 and 21 of each 32).  ``count``: the codes meant, where the last run is cut short (``holds``).
    Returns [codes, ...]."""
    import torch

    run, per_run = per_block(bits)
    words = words.to(torch.int64) & 0xFFFFFFFF
    if words.shape[0] % run:  # a last run cut short: its missing words hold nothing
        words = torch.cat([words, words.new_zeros(run - words.shape[0] % run, *words.shape[1:])])
    blocks = words.reshape(-1, run, *words.shape[1:])
    codes = []
    for k in range(per_run):
        word, offset = divmod(k * bits, 32)
        value = blocks[:, word] >> offset
        if offset + bits > 32:  # the code's high bits open the next word
            value = value | (blocks[:, word + 1] << (32 - offset))
        codes.append(value & ((1 << bits) - 1))
    return torch.stack(codes, 1).reshape(-1, *words.shape[1:])[:count]


def unpack_rows(packed, bits: int, count: int | None = None):
    """int32 words packed along their first axis, low bits first (GPTQModel's ``PackableQuantLinear.pack``:
    ``qweight[row] |= code << (bits x j)`` for the j-th input of the row's 32 / bits; at 3 bits, 32 inputs in three
    words as one bit stream, GPTQModel 7.7.0's ``dequantize_weight``): [rows x 32 / bits, columns] of codes in
    [0, 2^bits)."""
    return unpack_stream(packed, bits, count)


def unpack_columns(packed, bits: int, *, order=None, count: int | None = None):
    """int32 words packed along their last axis, low bits first (at 3 bits as one bit stream, as ``unpack_rows``):
    [rows, columns x 32 / bits].  ``order``: the column each field holds within its word (AWQ_ORDER), None for the
    linear order GPTQ's qzeros use."""
    fields = unpack_stream(packed.t(), bits).t()
    if order is not None:  # field i of each word holds column order[i]: put each back in its column
        per_word = len(order)
        fields = fields.reshape(packed.shape[0], -1, per_word)
        placed = fields.clone()
        placed[..., list(order)] = fields
        fields = placed.reshape(packed.shape[0], -1)
    return fields[:, :count]


def layout_error(where: str, name: str, said: str, mistake: str) -> QuantizedLayoutError:
    return QuantizedLayoutError(f"{where}: {name}: {said}", mistake)


def required_parts(scheme: IntScheme) -> tuple[str, ...]:
    """The parts a quantized module of ``scheme`` cannot be read without (an asymmetric scheme's zero points too)."""
    zeros = () if scheme.sym else ("weight_zero_point",)
    return {"gptq": ("qweight", "qzeros", "scales"), "awq": ("qweight", "qzeros", "scales"),
            PACKED: ("weight_packed", "weight_scale", "weight_shape", *zeros),
            STORED: ("weight", "weight_scale", *zeros)}[scheme.method]


def check_parts(where: str, prefix: str, scheme: IntScheme, parts: dict) -> None:
    """Each stored part of quantized module ``prefix`` present (those ``required_parts`` names) and of the dimensions
    and dtype its format stores (``STORAGE``), else a CheckpointError naming it: the format's reader would fail on it
    in its own words, or read something else."""
    missing = [p for p in required_parts(scheme) if p not in parts]
    if missing:
        raise CheckpointError(f"{where}: {prefix} is stored quantized ({scheme.describe()}) without "
                              f"{', '.join(prefix + '.' + m for m in missing)}; its format stores "
                              f"{', '.join(required_parts(scheme))} for each quantized module")
    for part, value in parts.items():
        dims, kind = STORAGE[scheme.method][part]  # ``parts`` holds only the method's own (PARTS)
        dtype = str(value.dtype).removeprefix("torch.")
        fits = {"int32": dtype == "int32", "float": value.dtype.is_floating_point and value.dtype.itemsize > 1,
                "int": not value.dtype.is_floating_point and dtype != "bool"}[kind]
        if value.dim() not in dims or not fits or (part == "weight_shape" and value.numel() != 2):
            shape = "[out, in]" if part == "weight_shape" else f"{' or '.join(f'{d}-D' for d in dims)}"
            raise CheckpointError(f"{where}: {prefix}.{part} is {dtype} {list(value.shape)}; {scheme.describe()} "
                                  f"stores it as {kind} {shape}")


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


def check_groups(where: str, name: str, scheme: IntScheme, inputs: int, outputs: int, scales) -> None:
    """The scales are [groups, out] (compressed-tensors: [out, groups]) for the stated group size, else a
    QuantizedLayoutError: the grid transposed, or one of another group size."""
    groups = -(-inputs // scheme.group_size) if scheme.group_size else 1
    rows_first = scheme.method in (PACKED, STORED)
    expected = (outputs, groups) if rows_first else (groups, outputs)
    found = tuple(scales.shape)
    if found == expected:
        return
    said = (f"its scales have shape {list(found)} for a [{outputs}, {inputs}] weight; config.json's group_size "
            f"{scheme.group_size or -1} calls for {list(expected)}")
    if found == tuple(reversed(expected)):
        raise layout_error(where, name, f"{said}: they are that grid transposed", "group_scales_transposed")
    if len(found) != 2:
        raise layout_error(where, name, f"{said}: a grid of {len(found)} dimensions", "group_size_wrong")
    other = found[1] if rows_first else found[0]
    if other and outputs in found:
        size = -(-inputs // other)
        raise layout_error(where, name, f"{said}: {other} groups, those of group_size {size}, not the stated "
                           f"{scheme.group_size or -1}", "group_size_wrong")
    raise layout_error(where, name, f"{said}", "group_size_wrong")


def check_zero_groups(where: str, name: str, qzeros, scales) -> None:
    """GPTQ's and AWQ's qzeros hold one row of packed zero points per group, as the scales hold one of scales."""
    if qzeros.shape[0] != scales.shape[0]:
        raise layout_error(where, name, f"its qzeros hold {qzeros.shape[0]} groups of zero points and its scales "
                           f"{scales.shape[0]} groups", "group_size_wrong")


def bits_error(where: str, name: str, scheme: IntScheme, packed: int, values: int, what: str) -> QuantizedLayoutError:
    """``packed`` int32 words hold ``values`` codes: the bits they imply against the stated ones."""
    implied = packed * 32 / values if values else float("nan")
    return layout_error(where, name, f"{packed} packed int32 words hold {values} {what}: {implied:g} bits each, "
                        f"where config.json's quantization_config states {scheme.bits}", "group_bits_mismatched")


def read_gptq(where: str, name: str, scheme: IntScheme, parts: dict) -> GroupQuantized:
    """GPTQ's layout (GPTQModel's ``PackableQuantLinear.pack`` and ``dequantize_weight``, AutoGPTQ's
    ``QuantLinear``): ``qweight`` [in x bits / 32, out] packed along the inputs, ``qzeros`` [groups, out x bits / 32]
    packed along the outputs, ``scales`` [groups, out], ``g_idx`` [in] (each input's group); checkpoint_format
    "gptq" (v1) stores each zero point minus one and its readers add one (GPTQModel's
    ``convert_gptq_v1_to_v2_format_module``)."""
    import torch

    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    g_idx = parts.get("g_idx")
    outputs = qweight.shape[1]
    # the inputs are g_idx's length: GPTQModel pads a dimension that is not a multiple of 32 / bits (``holds``)
    inputs = packed_count(qweight.shape[0], scheme.bits) if g_idx is None else g_idx.numel()
    if g_idx is not None and not holds(qweight.shape[0], inputs, scheme.bits):
        raise bits_error(where, name, scheme, qweight.shape[0], inputs, "input rows (g_idx's length)")
    if inputs is None:
        raise layout_error(where, name, f"its qweight's {qweight.shape[0]} packed rows are not whole runs of "
                           f"{per_block(scheme.bits)[0]} int32 words, as config.json's bits {scheme.bits} packs them",
                           "group_bits_mismatched")
    if not holds(qzeros.shape[-1], outputs, scheme.bits):
        raise bits_error(where, name, scheme, qzeros.shape[-1], outputs, "zero points per group (the outputs)")
    check_groups(where, name, scheme, inputs, outputs, scales)
    check_zero_groups(where, name, qzeros, scales)
    codes = unpack_rows(qweight, scheme.bits, inputs).t()
    zeros = unpack_columns(qzeros, scheme.bits, count=outputs).float() + (1.0 if scheme.v1 else 0.0)
    sequential = torch.arange(inputs) // (scheme.group_size or inputs)
    g_idx = sequential if g_idx is None else g_idx.to(torch.int64)
    if int(g_idx.min()) < 0 or int(g_idx.max()) >= scales.shape[0]:
        raise layout_error(where, name, f"g_idx names groups {int(g_idx.min())} to {int(g_idx.max())}; its scales "
                           f"hold {scales.shape[0]}", "group_size_wrong")
    return GroupQuantized(codes, scales.float().t().contiguous(), zeros.t().contiguous(), g_idx, 0,
                          (1 << scheme.bits) - 1, "gptq", scheme.bits)


def read_awq(where: str, name: str, scheme: IntScheme, parts: dict) -> GroupQuantized:
    """AutoAWQ's GEMM layout (``WQLinear_GEMM.from_linear``; read back by ``awq.utils.packing_utils``'s
    ``unpack_awq`` and ``reverse_awq_order``): ``qweight`` [in, out x bits / 32] and ``qzeros`` [groups, out x bits
    / 32], both packed along the outputs in AWQ_ORDER, ``scales`` [groups, out]; the zero points as they are."""
    import torch

    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    inputs, outputs = qweight.shape[0], qweight.shape[1] * 32 // scheme.bits
    if outputs not in scales.shape:  # the packed words hold another count of outputs than the scales: other bits
        raise bits_error(where, name, scheme, qweight.shape[1], scales.shape[-1],
                         "outputs per input row (scales' columns)")
    check_groups(where, name, scheme, inputs, outputs, scales)
    if qzeros.shape[-1] * 32 // scheme.bits != outputs:
        raise bits_error(where, name, scheme, qzeros.shape[-1], outputs, "zero points per group (the outputs)")
    check_zero_groups(where, name, qzeros, scales)
    order = AWQ_ORDER if scheme.bits == 4 else None
    codes = unpack_columns(qweight, scheme.bits, order=order).t()
    zeros = unpack_columns(qzeros, scheme.bits, order=order).float()
    g_idx = torch.arange(inputs) // (scheme.group_size or inputs)
    return GroupQuantized(codes, scales.float().t().contiguous(), zeros.t().contiguous(), g_idx, 0,
                          (1 << scheme.bits) - 1, "awq", scheme.bits)


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


READERS = {"gptq": read_gptq, "awq": read_awq}
