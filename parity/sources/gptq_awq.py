"""GPTQ (AutoGPTQ / GPTQModel: ``quant_method "gptq"``) and AWQ (AutoAWQ's GEMM layout: ``quant_method "awq"``)
unpacked into ``int_schemes.GroupQuantized``: integer codes packed into int32 words beside a scale and a packed zero
point per group.

The ecosystem's libraries do not install here without replacing the project's torch: gptqmodel 7.7.0 requires torch
2.14.1, which pip installs in place of the project's 2.13 (in a scratch venv: the CUDA 13 build), and autoawq 0.2.9
(the last release; the project is archived) failed in pip's resolver after 32 s in a scratch venv sharing the
system's packages.  transformers 5's GPTQ and AWQ integrations load through gptqmodel.  So the small unpackers below
are ours; the layouts are pinned to those libraries' own code, cited at each function, and gptqmodel 7.7.0's own GPTQ
(2, 3, 4 and 8 bits) and AWQ GEMM exports, quantized on CPU in that venv, read here as it reads them (docs/compare.md,
"Checked on the tools' own files")."""

from __future__ import annotations

import math

from parity.sources.int_schemes import GroupQuantized, IntScheme, bits_error, check_groups, layout_error

# AutoAWQ's GEMM packing (awq/modules/linear/gemm.py, WQLinear_GEMM.from_linear): nibble i of each int32 holds output
# column 8 x col + AWQ_ORDER[i]
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


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


def check_zero_groups(where: str, name: str, qzeros, scales) -> None:
    """GPTQ's and AWQ's qzeros hold one row of packed zero points per group, as the scales hold one of scales."""
    if qzeros.shape[0] != scales.shape[0]:
        raise layout_error(where, name, f"its qzeros hold {qzeros.shape[0]} groups of zero points and its scales "
                           f"{scales.shape[0]} groups", "group_size_wrong")


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


READERS = {"gptq": read_gptq, "awq": read_awq}
