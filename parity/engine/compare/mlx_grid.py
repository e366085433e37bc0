"""MLX-LM's quantization (``parity.sources.mlx_quantized``) judged against its own grid, for ``parity compare``.

Affine mode: each value's step is its group's scale (w = scale x code + bias, codes 0 .. 2^bits - 1), A re-quantized
the way mlx_lm.convert does (A cast to the dtype B's scales are stored in, then ``mlx.core.quantize`` with B's group
size and bits), and the conversion mistakes a writer of the format makes that keep its shapes, replayed on A's tensor:
scales and biases exchanged, a bias a step off, a square scale grid transposed.

Microscaled modes (mxfp4, mxfp8, nvfp4): each value's step is the gap beside its code's level (FP4 e2m1, FP8 e4m3:
the wider of the two, ``storage.level_steps``) times its group's scale, A re-quantized by ``mlx.core.quantize`` in B's
mode (A cast to the model's dtype first: the scales are bytes and do not say it), and the replays: GGUF's MXFP4 order
read as MLX's (mxfp4), a square scale grid transposed.

(Another group size, another bit width, another mode and a non-square grid transposed change the shapes or the
storage: the reader names those from the file, ``mlx_quantized.check_shapes`` and ``check_mode_storage``.)

A value of B may lie its step from A's (``conversion.STEP_SLACK``) plus what storing the scale and bias in their dtype
moves it by, and at a clamped end of its group a step more (``allowance``).  Measured on tests/test_quantized_mlx.py's
faithful exports: up to 1.02 steps at 4 bits (the far end clamped), 1.04 at 8 bits with float16 scales, 1.67 at 8 bits
with bfloat16 scales (A's own bfloat16 rounding and the scale's, times codes up to 255), none beyond the allowance; in
the microscaled modes 0.5 steps (mxfp4, mxfp8) and up to 1.47 (nvfp4, whose e4m3 scale rounded down clips the
group's largest value).

Everything here works in the layout the file stores ([out, in]); ``conversion`` routes it to the reference's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from parity.definitions.mapping import TensorRoute
from parity.engine.compare.storage import Storage, level_steps, rms_distance
from parity.engine.layer import route_tensor

# A group's scale in B's file may exceed the step A's values there call for ((max - min) / (2^bits - 1)) by this before
# it is grid_too_coarse: mlx.core.quantize moves the scale so the group's larger-magnitude end is a code exactly
# (edge / round(edge / scale)): by at most (q + 0.5) / q with q >= round((2^bits - 1) / 2), 1.25x at 2 bits, 1.07x at
# 4; a grid one bit coarser is 2x.  A microscaled mode's group scale is held to the one mlx.core.quantize chooses for
# A's values there (A cast as B's writer casts it), which every faithful export measured holds byte for byte: a
# power-of-two (e8m0) scale one up is 2x, an e4m3 scale one byte off another rounding of it, at most 1.125x (its
# 3-bit mantissa), which the function and the values judge.
GRID_FACTOR = 1.5
MICROSCALED_GRID_FACTOR = 1.2
GGUF_ORDER_MODE = "mxfp4"  # the mode whose blocks ggml also stores (GGML_TYPE_MXFP4: 32 e2m1 codes, one e8m0 scale)


@dataclass
class MLXStorage:
    """How B stores one MLX-quantized matrix (stored layout, one expert's slice of a stacked tensor): each value's
    code, each group's scale (and affine's bias; float32 of the stored values), the parameters, the dtype the model
    was cast to before quantizing (affine: the scales' stored dtype); a microscaled mode's levels (ascending)."""

    codes: torch.Tensor
    scales: torch.Tensor
    biases: torch.Tensor | None
    group_size: int
    bits: int
    dtype: str
    mode: str = "affine"
    levels: torch.Tensor | None = None
    global_scale: float | None = None  # nvfp4's, as the file stores it: A is re-quantized with it

    @property
    def affine(self) -> bool:
        return self.biases is not None

    @property
    def name(self) -> str:
        """The storage as reports show it: ``mlx affine 4-bit/64 (bfloat16 scales)``, ``mlx mxfp4/32``."""
        if self.affine:
            return f"mlx affine {self.bits}-bit/{self.group_size} ({self.dtype} scales)"
        return f"mlx {self.mode}/{self.group_size}"

    def code_steps(self) -> torch.Tensor:
        """A microscaled mode's step at each value's code: the wider gap beside its level."""
        return level_steps(self.levels)[torch.searchsorted(self.levels, self.codes.contiguous())]

    def steps(self) -> torch.Tensor:
        if self.affine:
            return expand(self.scales.abs(), self.group_size)
        return self.code_steps() * expand(self.scales, self.group_size)


def held(checkpoint, key: str, expert: int | None) -> MLXStorage | None:
    """How an MLX checkpoint stores ``key`` (``expert``'s slice of a stacked [E, out, in] tensor), None for a tensor
    stored unquantized or a checkpoint of another format."""
    quantized = getattr(checkpoint, "mlx_quantized", None)
    found = quantized(key, expert=expert) if quantized is not None else None
    if found is None:
        return None
    return MLXStorage(found.codes, found.scales, found.biases, found.params.group_size, found.params.bits,
                      found.scale_dtype, found.params.mode, found.levels, found.global_scale)


def stored(checkpoint, key: str, route: TensorRoute, expert: int | None) -> Storage | None:
    """How an MLX-quantized checkpoint stores ``key`` (``parity.sources.mlx_quantized``): each value's step read
    from the file (its group's scale, times its code's gap in a microscaled mode); None for a tensor stored
    unquantized."""
    store = held(checkpoint, key, expert)
    if store is None:
        return None
    bad = ~torch.isfinite(store.scales)
    if store.biases is not None:
        bad |= ~torch.isfinite(store.biases)
    problem = None
    if bool(bad.any()):
        first = [int(i) for i in bad.nonzero()[0]]
        problem = f"group {first}: {int(bad.sum())} of {bad.numel()} groups have a NaN/Inf scale or bias"
    return Storage(store.name, True, route_tensor(route, store.steps()), "file", route,
                   nonfinite_scale=problem, zeroed=not bool(store.codes.any()), mlx=store)


def expand(per_group: torch.Tensor, group: int) -> torch.Tensor:
    """Each group's value at every value of its group."""
    return per_group.float().repeat_interleave(group, dim=-1)


def spacing(values: torch.Tensor, dtype: str) -> torch.Tensor:
    """One unit in the last place of ``dtype`` at each value (float32)."""
    info = torch.finfo(getattr(torch, dtype))
    exponent = torch.frexp(values.float())[1]
    magnitude = torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent - 1)
    return info.eps * torch.where(values == 0, info.tiny, magnitude.clamp_min(info.tiny))


def needed_steps(x: torch.Tensor, group: int, bits: int) -> torch.Tensor:
    """The step A's values call for in each group: their range over the 2^bits - 1 steps of the codes."""
    groups = x.float().reshape(*x.shape[:-1], -1, group)
    return (groups.amax(-1) - groups.amin(-1)) / (2 ** bits - 1)


def allowance(x: torch.Tensor, store: MLXStorage) -> torch.Tensor:
    """What a value of B may lie from A's beyond its step (stored layout).  Affine: storing the scale and bias in
    their dtype (code x half the scale's spacing + half the bias's + half A's own rounding to that dtype), and at
    either end of its group's codes (0 or 2^bits - 1) a step A's values call for: mlx.core.quantize makes the group's
    larger-magnitude end a code exactly (scale edge / round(edge / scale)), which may shrink the scale and clamp the
    other end by up to that much.  Microscaled: half A's rounding to the model's dtype, and at the top level what A's
    value exceeds it by (a scale rounded down, as e4m3's and e8m0's may be, clips the group's largest values)."""
    group = store.group_size
    if not store.affine:
        held = store.codes * expand(store.scales, group)
        top = store.codes.abs() == store.levels.abs().max()
        clip = torch.where(top, (x.float().abs() - held.abs()).clamp_min(0.0), 0.0)
        return spacing(x, store.dtype) / 2 + clip
    scale = expand(spacing(store.scales, store.dtype), group)
    bias = expand(spacing(store.biases, store.dtype), group)
    at_end = (store.codes == 0) | (store.codes == 2 ** store.bits - 1)
    clamp = torch.where(at_end, expand(needed_steps(x, group, store.bits), group), 0.0)
    return (store.codes * scale + bias + spacing(x, store.dtype)) / 2 + clamp


# nvfp4 re-quantizes A at B's own global scale unless that rounds A this many times worse (root mean square) than the
# global scale a writer gives A (its largest magnitude, which puts its largest group's scale at e4m3's top): a global
# scale stored 6 or 1e30 times off made A's own conversion as far from A as B (the layer unverifiable, exit 2) where it
# is B's mistake.  e4m3's range leaves room: on Gaussian and Student-t (3 degrees) weights, 256 x 512, a global scale
# x 0.9 to x 6 the writer's rounds A 0.996 to 1.003 x as far as it, x 1/6 (group scales past e4m3's 448) 3.1 to 5.2 x.
GLOBAL_SOUND = 1.25


def quantize(x: torch.Tensor, store: MLXStorage) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                            torch.Tensor]:
    """A's matrix (stored layout) quantized as mlx_lm.convert does: cast to B's dtype (affine: its scales'), then
    ``mlx.core.quantize`` with B's group size, bits and mode.  Returns the codes, scales and biases (float32; a
    microscaled mode: its scales relative to its reference byte, no biases) and the values mlx.core.dequantize reads
    back from them (float32)."""
    import numpy as np

    from parity.sources.mlx_quantized import Held, MLXParams, decode_scales, dequantize, even_rows, require_mlx, unpack

    mx = require_mlx("MLX quantization")
    params = MLXParams(store.group_size, store.bits, store.mode)
    w = mx.array(x.float().contiguous().numpy()).astype(getattr(mx, store.dtype))
    gs = None if store.global_scale is None else mx.array(np.float32(store.global_scale))
    found = even_rows(mx, lambda t: mx.quantize(t, group_size=store.group_size, bits=store.bits, mode=store.mode,
                                                global_scale=gs), w)
    words = torch.from_numpy(np.array(found[0]).view(np.int32))
    codes = unpack(mx, words, params)
    if store.affine:
        scales, biases = (torch.from_numpy(np.array(t.astype(mx.float32))) for t in found[1:])
        return codes, scales, biases, values(codes, scales, biases, store.group_size)
    raw = torch.from_numpy(np.array(found[1]))
    return (codes, decode_scales(raw, store.mode, store.global_scale), None,
            dequantize(mx, Held(words, raw, None, params, store.global_scale)))


def values(codes: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor | None, group: int) -> torch.Tensor:
    """scale x code + bias in each group (float32), as mlx.core.dequantize computes it from float32 scales (no bias:
    a microscaled mode)."""
    held = codes * expand(scales, group)
    return held + expand(biases, group) if biases is not None else held


def reference(x: torch.Tensor, storage: Storage) -> tuple[torch.Tensor, str, torch.Tensor]:
    """A's matrix (stored layout) as B's MLX storage would hold it (float32), how it was made, and each value's step
    as that quantization chose it."""
    store = storage.mlx
    codes, scales, biases, held = quantize(x, store)
    said = f"{store.bits}-bit" if store.affine else store.mode
    if store.global_scale is not None:
        said += f" at B's global scale {store.global_scale:g}"
        own = replace(store, global_scale=float(x.to(getattr(torch, store.dtype)).float().abs().max()))
        mine = quantize(x, own)
        errors = [rms_distance(values, x) for values in (held, mine[3])]
        if errors[0] > GLOBAL_SOUND * errors[1]:
            codes, scales, biases, held = mine
            said = (f"{store.mode} at the global scale mlx_lm.convert gives A, its largest magnitude "
                    f"{own.global_scale:g}: B's own {store.global_scale:g} rounds A's values "
                    f"{errors[0] / max(errors[1], 1e-30):.3g} x worse (root mean square), so it is no global scale "
                    "of A's")
    each = MLXStorage(codes, scales, biases, store.group_size, store.bits, store.dtype, store.mode,
                      store.levels).steps()
    return (held, f"re-quantized with mlx.core.quantize ({said}, groups of {store.group_size}, A cast to "
            f"{store.dtype} first)", each)


def coarse_groups(x: torch.Tensor, store: MLXStorage) -> dict | None:
    """Groups whose scale in B's file exceeds what a writer of the format chooses for A's values there: affine,
    ``GRID_FACTOR`` x the step they call for ((max - min) / (2^bits - 1), never less than the dtype's spacing at the
    group's largest value); microscaled, ``MICROSCALED_GRID_FACTOR`` x the scale mlx.core.quantize gives them.  None
    when none does; else how many and the worst, with evidence (the keys ``findings.grid_finding`` words; a
    microscaled group's step is its top level's gap times its scale)."""
    if store.affine:
        needed = needed_steps(x, store.group_size, store.bits)
        floor = spacing(x.float().reshape(*x.shape[:-1], -1, store.group_size).abs().amax(-1), store.dtype)
        limit = torch.maximum(GRID_FACTOR * needed, floor) * (1 + 2 * torch.finfo(getattr(torch, store.dtype)).eps)
        b_steps = store.scales.abs()
    else:
        top = float(level_steps(store.levels)[-1])
        needed, b_steps = quantize(x, store)[1] * top, store.scales * top
        limit = MICROSCALED_GRID_FACTOR * needed
    over = (b_steps / limit).nan_to_num(0.0)
    if not bool((over > 1).any()):
        return None
    worst = int(over.argmax())
    per_row = over.shape[-1]
    first = worst % per_row * store.group_size
    b_step, a_step = float(b_steps.reshape(-1)[worst]), float(needed.reshape(-1)[worst])
    return {"blocks_too_coarse": int((over > 1).sum()), "blocks": over.numel(), "worst_block": worst,
            "row": worst // per_row, "values": [first, first + store.group_size - 1], "b_step": b_step,
            "a_step": a_step, "limit": float(limit.reshape(-1)[worst]),
            "times_coarser": b_step / a_step if a_step else float("inf")}


def gguf_order(per_group: int) -> torch.Tensor:
    """Where MLX's reading of a block packed in ggml's MXFP4 order finds each value: ggml puts value j and value
    j + 16 of a 32-value block in byte j (low, high nibble), MLX reads byte j as values 2j and 2j + 1."""
    half = torch.arange(per_group // 2)
    return torch.stack([half, half + per_group // 2], dim=1).reshape(-1)


def mistakes(x: torch.Tensor, store: MLXStorage) -> list[tuple[str, str, torch.Tensor]]:
    """The MLX conversion mistakes that keep B's shapes, each as (mistake id, detail, A's matrix as the broken
    export reads back; stored layout).  Affine: scales and biases exchanged; each bias one step (its group's scale) up
    or down, which is a zero point one code off (scale x code + bias = scale x (code - zero)).  mxfp4: ggml's block
    order read as MLX's.  Every mode: a square scale grid transposed."""
    codes, scales, biases, _ = quantize(x, store)
    group = store.group_size
    found = []
    if store.affine:
        found.append(("mlx_scales_biases_exchanged", "X.scales and X.biases exchanged (bias x code + scale)",
                      values(codes, biases, scales, group)))
        found += [("zero_point_off_by_one", f"X.biases one step {'up' if shift > 0 else 'down'} (each group's bias "
                   f"{'+' if shift > 0 else '-'} its scale: a zero point one code off)",
                   values(codes, scales, biases + shift * scales, group)) for shift in (1, -1)]
    elif store.mode == GGUF_ORDER_MODE:
        moved = codes.reshape(*codes.shape[:-1], -1, group)[..., gguf_order(group)].reshape(codes.shape)
        found.append(("packed_order_wrong", "X.weight packed in ggml's MXFP4 order (value j and j + 16 of each "
                      "block in byte j) and read in MLX's (values 2j and 2j + 1)", values(moved, scales, None, group)))
    if scales.shape[-1] == scales.shape[-2] and scales.shape[-1] > 1:
        both = "X.scales and X.biases" if store.affine else "X.scales"
        found.append(("mlx_scales_transposed", f"{both} transposed (grid {list(scales.shape)})",
                      values(codes, scales.transpose(-1, -2),
                             biases.transpose(-1, -2) if biases is not None else None, group)))
    return found


def replays(x: torch.Tensor, store: MLXStorage, back: Callable[[torch.Tensor], torch.Tensor]
            ) -> list[tuple[str, str, torch.Tensor]]:
    """``mistakes`` with each result put into the reference's layout by ``back``."""
    return [(mistake, detail, back(found)) for mistake, detail, found in mistakes(x, store)]
