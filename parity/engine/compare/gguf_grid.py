"""A GGUF B judged against its own grid, for ``parity compare``: how each tensor is stored (a float type, a type whose
blocks carry their scale, or one whose grid parity cannot read), A made as B's file would hold it, and how far each of
B's values may lie from A's.

* a quantized type's step is read from the file (``gguf_blocks``): the float16 scale ``d`` in the first two bytes of
  Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 blocks, MXFP4's E8M0 exponent, the K-quants' super-block scales; for the other types it
  is estimated from the levels the block holds (``level_steps``; evidence only: the function judges them);
* A is re-quantized with ``gguf.quants.quantize`` in B's stored layout (``requantize``), or for the K-quants (which
  gguf cannot write) quantized by round-to-nearest on the grid A's own blocks call for (``k_requantize``).  Types with
  neither (IQ1 to IQ4, NVFP4) have A rounded to the nearest value B's block holds (``on_levels``);
* each block's step is held to what a quantizer of the format chooses for A's values there (``coarse_blocks``:
  grid_too_coarse; a row using one level in k of its grids: ``skipped_levels``), and a K-quant value at an end of its
  block's grid may lie farther (``k_ends``).  Where B's metadata names an importance matrix (llama-quantize
  ``--imatrix``) and B's type is one whose llama.cpp quantizer uses it (``IMPORTANCE_WEIGHTED``), the steps and grid
  are held to what a weighted quantizer does (``IMPORTANCE_STEPS``, ``IMPORTANCE_GRID_FACTOR``), B's least-squares
  scale on A near 1 (``importance_scales``), the function within ``IMPORTANCE_FACTOR``.

Everything but ``stored``, ``reference`` and ``bounds`` works in the layout the file stores; ``conversion`` dispatches
here for a GGUF B.
"""

from __future__ import annotations

import math

import torch

from parity.definitions.mapping import TensorRoute
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
from parity.engine.compare.storage import (
    Storage,
    dtype_name,
    least_squares_scales,
    spacing,
    stored_layout,
    unstored,
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
# A row whose blocks' codes sit on one residue mod k (2 <= k <= SKIP_MAX) for at least SKIP_SHARE of them on average
# holds one level in k (``skipped_levels``): a quantizer rounding to the nearest level leaves 0.57 (k = 2, blocks of
# 32), 0.60 (blocks of 16), the mean of many blocks within a few hundredths of it.
SKIP_MAX = 4
SKIP_SHARE = 0.9
# ... counting only the blocks of at least this many distinct codes: a block of fewer says nothing about a grid
# (K-quants beside 4 input columns x300: quiet sub-blocks of 1 to 3 codes, most of them one code, put 606 of 768 rows
# of a reviewer's faithful Q3_K "on one level in 2", and 72 of its Q4_K's "in 4", 4 with this rule); a block of
# normal values on one level in k holds 4 or more.
SKIP_DISTINCT = 4
# The largest code a block of Q4_0..Q8_0 can hold (the symmetric types' largest magnitude, -8 for Q4_0; the
# asymmetric ones' top code above their minimum m), and the least share of it every block's codes reach
# (``short_reach``): each quantizer of these types picks d from the block's own largest value, so the codes reach
# the top whatever rounds the others.  Measured on llama-quantize's own exports (llama-cpp-python 0.3.36's vendored
# llama.cpp) of the stories260K, Gemma 3 270M and Qwen2.5 0.5B stand-ins, with and without --imatrix, 39.9 million
# blocks: every block reaches top - 1 or top (Q4_0 7 of 8, Q4_1 14 of 15, Q5_0 15 of 16, Q5_1 30 of 31, Q8_0 127);
# gguf's quantizer reaches the top.  A block re-quantized onto a grid twice as coarse (d x2, codes halved) reaches
# half, which no bound on d against A's values sees where an importance matrix lets d range over 3 x.
TOP_CODE = {"Q4_0": 8, "Q5_0": 16, "Q8_0": 127, "Q4_1": 15, "Q5_1": 31}
REACH = 0.75
FLOAT16_ROUNDING = 1 + 2.0 ** -10  # a block's d is stored as float16: B's step may exceed the exact one by this
# A GGUF quantized with an importance matrix (``Storage.importance``): llama.cpp's weighted quantizers choose each
# block's scale by the error weighted with it and refit it by least squares, so values of little importance lie
# several steps from A's, clamped or not, and a block's step exceeds what A's values call for.  Measured with
# llama.cpp's own llama-imatrix and llama-quantize (vendored in llama-cpp-python 0.3.36) on a trained tiny LLaMA
# (d 256, d_ff 768, 20 chunks of 128 tokens of this project's text): Q4_0 to Q6_K and Q2_K/Q3_K values up to 9.4
# steps from A's (up to 5.8 away from either end of the grid), block steps up to 1.8 x A's; the layer's function
# 0.56 to 1.9 x round-to-nearest (a trained tiny Qwen2: up to 1.34 x).  Such a B is judged by the function within
# this factor, its steps and grid by the wider bounds below (IMPORTANCE_STEPS on).  The IQ types chosen with an
# importance matrix (a codebook's eight values at once, weighted) moved the same layers 0.61 to 3.1 x the rounding
# onto B's own levels (IQ2_XS and IQ2_S at 3.1 x on one layer, IQ1 at up to 2.37 x): LEVELS_FACTOR does not hold
# them, so 4 x.
IMPORTANCE_FACTOR = 3.0
IMPORTANCE_LEVELS_FACTOR = 4.0
# The GGUF types whose llama.cpp quantizer uses the importance matrix: only these are relaxed by B's metadata naming one
# (llama.cpp's ggml/src/ggml-quants.c, vendored in llama-cpp-python 0.3.36; quantize_q8_0, quantize_mxfp4,
# quantize_nvfp4, quantize_tq1_0/tq2_0 ignore quant_weights, quantize_q1_0/q2_0 call their reference quantizer row by
# row whatever it is: those are judged as without the matrix).
IMPORTANCE_WEIGHTED = {
    "Q4_0",  # quantize_row_q4_0_impl: make_qx_quants(..., weight = qw x sqrt(sigma2 + x^2))
    "Q4_1",  # quantize_row_q4_1_impl: make_qkx3_quants with the weights
    "Q5_0",  # quantize_row_q5_0_impl: make_qx_quants with the weights
    "Q5_1",  # quantize_row_q5_1_impl: make_qkx3_quants with the weights
    "Q2_K",  # quantize_row_q2_K_impl (asserts quant_weights): make_qp_quants, make_qkx3_quants
    "Q3_K",  # quantize_row_q3_K_impl: make_qx_quants with qw per 16 values
    "Q4_K",  # quantize_row_q4_K_impl: make_qkx3_quants, make_qp_quants with qw per 32 values
    "Q5_K",  # quantize_row_q5_K_impl: likewise
    "Q6_K",  # quantize_row_q6_K_impl: make_qx_quants with qw per 16 values
    "IQ1_S",  # quantize_row_iq1_s_impl (asserts quant_weights)
    "IQ1_M",  # quantize_row_iq1_m_impl: qw when given
    "IQ2_XXS",  # quantize_row_iq2_xxs_impl (asserts quant_weights)
    "IQ2_XS",  # quantize_row_iq2_xs_impl (asserts quant_weights)
    "IQ2_S",  # quantize_row_iq2_s_impl: qw when given
    "IQ3_XXS",  # quantize_row_iq3_xxs_impl: qw when given
    "IQ3_S",  # quantize_row_iq3_s_impl: qw when given
    "IQ4_NL",  # quantize_row_iq4_nl_impl via quantize_iq4_nl: qw when given
    "IQ4_XS",  # quantize_iq4_xs -> quantize_row_iq4_nl_impl: qw when given
}
# What a weighted quantizer cannot do, kept for an importance-weighted B (``bounds``, ``importance_scales``).  Measured
# with llama.cpp's own llama-imatrix and llama-quantize (llama-cpp-python 0.3.36's vendored copy, built here) on a
# byte-level tiny LLaMA (d 256, d_ff 768, 2 layers, 79 AdamW steps on this project's docs; imatrix: 20 chunks of 128
# tokens of the same text), exported with --imatrix to Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K_M, Q4_K_M, Q5_K_M, Q6_K,
# IQ4_XS, IQ3_S, IQ2_XS, IQ1_M (every FFN tensor of both layers):
# * a value's distance from A's: at most 4.15 steps (the earlier trained LLaMA and Qwen2: 9.4), so 16;
# * a block's step over what A's values call for: at most 1.54 x (Q2_K; earlier 1.8 x), so 3;
# * B's least-squares factor on A, sum(A B) / sum(A A): whole tensors 0.949 to 0.999 (IQ: 0.897 to 1.019), rows
#   0.912 to 1.008 (IQ: 0.789 to 1.057), blocks 0.676 to 1.156 (Q2_K; Q4_0 0.860 to 1.131; IQ: 0.329 to 1.386).  A
#   quantizer refitting a scale by least squares shrinks B toward zero (sum(A B) = sum(B B) < sum(A A)), the fewer the
#   bits the more, so the bounds below 1 are the looser.  A whole tensor x1.25, a row x1.5, a block x2 or negated
#   lie beyond them.  The IQ types (``Storage.levels``) get their own, wider.
# * the share of each block's codes on one residue mod k, per row (``skipped_levels``): at most 0.688 (Q6_K, k = 2);
#   a grid with one bit passed off holds nearly 1.
# Re-measured on llama-quantize --imatrix exports of the stories260K, Gemma 3 270M and Qwen2.5 0.5B stand-ins (their
# real FFN shapes, lightly trained; llama-imatrix on 32 x 128 tokens): a value of a column the matrix barely weights
# lies up to 28.1 steps from A's (Qwen2.5's Q6_K, the same few outlier weights in Q3_K to Q6_K, Q4_1, Q5_1: 18 to 25),
# which 16 failed; block factors 0.50 to 1.39 (Q4_0), 0.42 (Q3_K), and for the 1- to 3-bit types (Q2_K, IQ1 to IQ3)
# -0.05 (a Q2_K sub-block whose scale is zero) to 2.88 (IQ3_XXS), which 0.4 to 1.5 and 0.1 to 2.0 failed.
IMPORTANCE_STEPS = 64.0  # each value within this many of its block's steps from A's
IMPORTANCE_GRID_FACTOR = 3.0  # each block's step within this x what A's values there call for
IMPORTANCE_SCALE = (0.77, 1.12)  # B's least-squares factor on A, whole tensor and each row
IMPORTANCE_BLOCK_SCALE = (0.2, 1.8)  # and each block (a K-quant's sub-block)
IMPORTANCE_LEVELS_SCALE = (0.6, 1.2)  # the IQ types: tensor and row
IMPORTANCE_LEVELS_BLOCK_SCALE = (0.1, 2.0)  # and each block of LEVEL_GROUP values (IQ4_NL, IQ4_XS)
# The 1- to 3-bit weighted types, whose blocks a weighted quantizer may leave near zero or well above A's: a block's
# factor only beyond these (a block negated) is a finding; their tensors and rows keep the bounds above.
LOW_BITS = {"Q2_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S"}
IMPORTANCE_LOW_BITS_BLOCK_SCALE = (-0.5, 4.0)


def stored(path, info, tensor: torch.Tensor, route: TensorRoute, expert: int | None = None) -> Storage:
    """How the GGUF file at ``path`` stores the tensor its index describes as ``info`` (``tensor``: as read; for MoE,
    one ``expert``'s slice of a tensor that may stack every expert, as GGUF's ``*_exps`` do)."""
    from parity.sources.gguf_header import qtype_name

    name = qtype_name(info.qtype)
    if name in FLOAT_TYPES:
        return Storage(dtype_name(FLOAT_TYPES[name]), route=route)
    if name not in K_QUANTS and name not in SCALE_FIRST and name != "MXFP4":
        group = min(qtype_block(info.qtype), LEVEL_GROUP)
        return Storage(name, True, route_tensor(route, level_steps(tensor, group)), "estimated", route, info.qtype,
                       levels=tensor.float() if tensor.numel() % group == 0 else None)
    stacked = expert is not None and len(info.shape) == tensor.dim() + 1  # this expert's blocks only
    raw = read_blocks(path, info, expert if stacked else None)
    steps, offsets, scales = block_grid(raw, name, tuple(tensor.shape))
    if name == "MXFP4":
        steps = mxfp4_steps(steps, tensor)
    return Storage(name, True, route_tensor(route, steps), "file", route, info.qtype,
                   None if offsets is None else route_tensor(route, offsets),
                   nonfinite_scale=scale_problem(scales, tensor.numel() // len(raw), tensor.shape[-1]),
                   zeroed=codes_zero(raw, name))


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


def on_lattice(a: torch.Tensor, steps: torch.Tensor | None, offsets: torch.Tensor | None = None) -> torch.Tensor:
    """A's values rounded to the nearest point of B's per-value grid (``offsets`` + k x ``steps``): used only where
    no quantizer of the type is known here (types whose step is estimated), never for a type judged by its grid."""
    a = a.float()
    if steps is None:
        return a
    start = offsets if offsets is not None else torch.zeros_like(steps)
    safe = torch.where(steps > 0, steps, torch.ones_like(steps))
    return torch.where(steps > 0, torch.round((a - start) / safe) * safe + start, a)


def reference(a: torch.Tensor, storage: Storage) -> tuple[torch.Tensor, str, torch.Tensor | None]:
    """A's tensor (reference layout) as a GGUF B's storage would hold it (float32), how it was made, and each value's
    step as the format's quantizer chose it for A (stored layout; None where it cannot be had): re-quantized where a
    quantizer runs here, else rounded onto the levels or the grid B's blocks hold.  Also what any quantized storage
    whose blocks span a fused tensor's halves falls back to (B's grid, read from the file)."""
    stored = stored_layout(storage.route, a.float())
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


def bounds(allowed: torch.Tensor, x: torch.Tensor, b: torch.Tensor, storage: Storage, a_dtype: str,
           a_steps: torch.Tensor | None) -> tuple[torch.Tensor, dict | None]:
    """A GGUF B's values' allowed distance from A's (``allowed``: the step and A's own rounding, reference layout;
    ``x``: A in the stored layout) and its blocks coarser than the format's quantizer chooses for A (``coarse_blocks``).

    In a K-quant a value at either end of its block's grid (its code clamped, or in a zero-step block) may lie farther
    by as much as the rounding of the block's scale to a multiple of d (and of its minimum to a multiple of dmin) moves
    it: (levels x d + dmin) / 2, with d and dmin those A's values call for, plus the float16 rounding of d and dmin
    themselves (times ``SEARCH``).  A type whose blocks carry d is held to the d gguf's quantizer chose
    (``a_steps``).  Rows whose codes use one level in k (``skipped_levels``) are a grid as coarse, d unchanged.  An
    importance-weighted B (``Storage.importance``) gets ``IMPORTANCE_STEPS`` steps per value and
    ``IMPORTANCE_GRID_FACTOR`` per block."""
    weighted = storage.importance is not None
    b_steps = stored_layout(storage.route, storage.steps.float())
    held = stored_layout(storage.route, b.float())
    if weighted:
        allowed = IMPORTANCE_STEPS * allowed
    if storage.dtype in K_QUANTS and x.shape[-1] % SUPER_BLOCK == 0:
        span, sub, levels = K_FORMAT[storage.dtype]
        ideal, _, quantum, mquantum = k_statistics(x, storage.dtype)
        # d and dmin are float16: a step moves by up to levels x half d's float16 spacing (a subnormal d: by much)
        d_rounding, m_rounding = (levels * spacing(unit, "float16") / 2 for unit in (quantum, mquantum))
        offsets = None if storage.offsets is None else stored_layout(storage.route, storage.offsets.float())
        if not weighted:  # 0 away from the grid's ends; IMPORTANCE_STEPS holds a weighted B's ends too
            ends = k_ends(held, b_steps, offsets, storage.dtype,
                          SEARCH * ((span * quantum + mquantum) / 2 + span * d_rounding + m_rounding))
            allowed = allowed + unstored(storage.route, ends).float()
        else:  # a sub-block a weighted quantizer left at scale zero (Q2_K's of little importance): A's own step there
            zero = ideal.unsqueeze(-1).expand(-1, -1, sub).reshape(x.shape) * (b_steps == 0)
            allowed = allowed + IMPORTANCE_STEPS * unstored(storage.route, zero).float()
        limit = (IMPORTANCE_GRID_FACTOR if weighted else K_GRID_FACTOR) * (ideal + quantum / 2) + d_rounding
        return allowed, (coarse_blocks(b_steps, ideal, limit, sub, x, a_dtype)
                         or skipped_levels(held, b_steps, offsets, sub))
    # a legacy type's d (and Q4_1's, Q5_1's m) are float16 too: its codes were chosen on d before that rounding, so a
    # value moves by up to |code| x half d's float16 spacing (a subnormal d, under 6.1e-5: by up to 6 % of a step at
    # Q4_0's code 8, past its clamped end's one step) and half m's
    offsets = None if storage.offsets is None else stored_layout(storage.route, storage.offsets.float())
    codes = torch.where(b_steps > 0, (held - (0 if offsets is None else offsets)).abs() / b_steps.clamp_min(1e-38), 0)
    rounding = codes * spacing(b_steps, "float16") / 2
    if offsets is not None:
        rounding = rounding + spacing(offsets, "float16") / 2
    allowed = allowed + unstored(storage.route, rounding).float()
    if a_steps is None:
        return allowed, None
    group = block_values(storage)
    needed = a_steps.float().reshape(-1, group)[:, 0]
    limit = (IMPORTANCE_GRID_FACTOR if weighted else LEGACY_GRID_FACTOR) * needed + spacing(needed, "float16")
    return allowed, (coarse_blocks(b_steps, needed, limit, group, x, a_dtype)
                     or short_reach(held, b_steps, offsets, storage.dtype, x, group)
                     or skipped_levels(held, b_steps, None, group))


def short_reach(b: torch.Tensor, steps: torch.Tensor, offsets: torch.Tensor | None, name: str, x: torch.Tensor,
                group: int) -> dict | None:
    """Blocks of a Q4_0..Q8_0 B (stored layout, ``group`` values each) whose codes reach less than ``REACH`` of the
    type's top code (``TOP_CODE``: the largest |value| / d, or (largest value - m) / d for Q4_1/Q5_1): a step larger
    than the block's own values need, which a quantizer choosing d from them never writes.  The worst, in
    ``coarse_blocks``' terms (A's need: its block's largest magnitude, or range above min(0, min), over the top code),
    with the reach, or None."""
    top = TOP_CODE.get(name)
    if top is None:
        return None
    flat, step = b.reshape(-1, group), steps.reshape(-1, group)[:, 0]
    start = offsets.reshape(-1, group) if offsets is not None else torch.zeros_like(flat)
    reach = (flat - start).abs().amax(-1) / step.clamp_min(1e-30)
    short = (step > 0) & (reach < REACH * top)
    if not bool(short.any()):
        return None
    worst = int(torch.where(short, reach, math.inf).argmin())
    values = x.reshape(-1, group)[worst].float()
    low = values.min().clamp(max=0) if offsets is not None else -values.abs().max()
    need = float((values.max().clamp(min=0) - low) / top) if offsets is not None else float(values.abs().max() / top)
    chosen, start_at = float(step[worst]), worst * group % x.shape[-1]
    return {"blocks_too_coarse": int(short.sum()), "blocks": len(step), "worst_block": worst,
            "row": worst * group // x.shape[-1], "values": [start_at, start_at + group - 1], "b_step": chosen,
            "a_step": need, "limit": chosen * float(reach[worst]) / top, "reach": float(reach[worst]), "top": top,
            "times_coarser": chosen / need if need else math.inf}


def skipped_levels(b: torch.Tensor, steps: torch.Tensor, offsets: torch.Tensor | None, group: int) -> dict | None:
    """Rows of B (stored layout; blocks of ``group`` values) whose codes use one level in k of their blocks' grids
    (k of 2 to ``SKIP_MAX``, leaving at least 4 of the levels its codes span): in each block, the share of its codes
    on the residue mod k most of them are on, averaged over the row's blocks, at least ``SKIP_SHARE``.  A quantizer
    rounding to the nearest level, weighted or not, leaves about 1/k + a little there (0.57 for k = 2 in 32 values);
    values rounded onto k times the step before quantizing, d kept, leave nearly 1 (a bit of the code passed off,
    which no step read from the file shows).  The worst such row with its k, or None."""
    flat, step = b.reshape(-1, group), steps.reshape(-1, group)
    start = offsets.reshape(-1, group) if offsets is not None else torch.zeros_like(flat)
    safe = torch.where(step > 0, step, torch.ones_like(step))
    codes = torch.round((flat - start) / safe).long()
    rows = b.shape[0]
    found = None
    # one level in k of a grid keeps at least 4 levels: Q2_K's 4 codes are never judged so, Q3_K's 8 only for k = 2
    # (a block of few levels holding most values on one of them is a fact about A's values, not a passed-off bit)
    spread = int(codes.max() - codes.min()) + 1 if codes.numel() else 0
    distinct = (codes.sort(-1).values.diff(dim=-1) != 0).sum(-1) + 1
    for k in range(2, min(SKIP_MAX, spread // 4) + 1):
        residue = torch.remainder(codes, k)
        counts = torch.stack([(residue == r).sum(-1) for r in range(k)], -1)
        varied = (distinct >= SKIP_DISTINCT).reshape(rows, -1)
        per_block = (counts.amax(-1).float() / group).reshape(rows, -1)
        share = (per_block * varied).sum(-1) / varied.sum(-1).clamp_min(1)
        if bool((share >= SKIP_SHARE).any()):
            worst = int(share.argmax())
            found = {"every": k, "rows_skipping": int((share >= SKIP_SHARE).sum()), "rows": rows, "row": worst,
                     "share": float(share[worst])}
    return found


def importance_scales(x: torch.Tensor, b: torch.Tensor, group: int, *, levels: bool = False, dtype: str = "") -> dict:
    """How B's values scale against A's (``storage.least_squares_scales``, stored layout, ``group`` values per
    block), judged by ``IMPORTANCE_SCALE`` (tensor, row) and ``IMPORTANCE_BLOCK_SCALE`` (block; ``levels``: an IQ
    type's grid, ``IMPORTANCE_LEVELS_SCALE`` and ``IMPORTANCE_LEVELS_BLOCK_SCALE``; a ``dtype`` of ``LOW_BITS``: its
    blocks by ``IMPORTANCE_LOW_BITS_BLOCK_SCALE``).  An importance-weighted quantizer
    moves values of little importance several steps but refits each block's scale to the values, so B stays A's in
    scale while every value check is relaxed; a block, a row or the tensor multiplied (or negated) after quantizing
    is not."""
    bounds = (IMPORTANCE_LEVELS_SCALE, IMPORTANCE_LEVELS_BLOCK_SCALE) if levels \
        else (IMPORTANCE_SCALE, IMPORTANCE_BLOCK_SCALE)
    if dtype in LOW_BITS:
        bounds = (bounds[0], IMPORTANCE_LOW_BITS_BLOCK_SCALE)
    return least_squares_scales(x, b, group, bounds=bounds[0], block_bounds=bounds[1])


def scale_group(storage: Storage) -> int:
    """The values one scale of B's type covers: a K-quant's sub-block, a grid parity cannot read ``LEVEL_GROUP``,
    else the block."""
    if storage.dtype in K_QUANTS:
        return K_FORMAT[storage.dtype][1]
    return min(block_values(storage), LEVEL_GROUP) if storage.levels is not None else block_values(storage)


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
