"""The conversion mistakes that could turn A's tensors into B's, each as a hypothesis: A's layer tensors
(transformers' names) changed the way the mistake changes them, for ``parity.engine.compare.comparison`` to replay
through transformers' MLP and keep the one B's output reproduces.  Which hypotheses a tensor raises is read off
the tensors themselves (a square matrix may be transposed, a least-squares factor may be a scale or a sign flip),
never tried at random.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from parity.definitions.mistakes import MistakeId
from parity.engine.compare import codebook_grid, conversion, fp4_grid, fp8_grid, group_grid, mlx_grid, permutation
from parity.engine.gate_up_layout import interleave_rows


@dataclass
class Hypothesis:
    """One conversion mistake, as A's layer tensors (reference names) changed the way the mistake changes them."""

    id: MistakeId
    detail: str
    tensors: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def _swap(t: dict, a: str, b: str, biases: bool = True) -> dict:
    """A's tensors with a and b exchanged, their biases with them unless ``biases`` is False: an MoE expert's
    (parity.engine.experts: gate, up, down, gate_bias, up_bias: GPT-OSS's) or a dense FFN's (gate_proj.weight,
    gate_proj.bias)."""
    out = dict(t)
    pairs = [(a, b), *((f"{a}.{suffix}", f"{b}.{suffix}") for suffix in ("weight", "bias"))]
    if biases:
        pairs.append((f"{a}_bias", f"{b}_bias"))
    for first, second in pairs:
        if first in t and second in t and (biases or not first.endswith("bias")):
            out[first], out[second] = t[second], t[first]
    return out


def _refused_layout(t: dict, pairs: list[tuple[str, str]], interleaved: bool) -> dict:
    """Each (gate, up) pair fused in one layout and read back in the other: written as halves and read as
    alternate rows (``interleaved``), or written interleaved and read as halves."""
    out = dict(t)
    for gate, up in pairs:
        if gate in t and up in t and t[gate].shape == t[up].shape:
            if interleaved:
                fused = torch.cat([t[gate], t[up]])
                out[gate], out[up] = fused[0::2], fused[1::2]
            else:
                fused = interleave_rows(t[gate], t[up])
                out[gate], out[up] = fused.chunk(2)
    return out


def hypotheses(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], storage: dict[str, conversion.Storage],
               differing: list[str]) -> list[Hypothesis]:
    """The conversion mistakes that could turn A's tensors into B's: one set per tensor that differs beyond
    what its conversion allows, plus gate and up exchanged, and fused in the other layout (always tried)."""
    found = []
    for gate, up in (("gate_proj", "up_proj"), ("gate", "up")):
        names = {f"{gate}.weight", f"{up}.weight"} if gate.endswith("_proj") else {gate, up}
        if names <= set(a):  # tried even where neither differs beyond its bound: a bound taken from B's own grid
            # (integer groups rounded on B's codes' scales) can hide the exchange tensor by tensor
            found.append(Hypothesis(MistakeId.GATE_UP_EXCHANGED, f"B's {gate} is A's {up} and the reverse",
                                    lambda t, gate=gate, up=up: _swap(t, gate, up)))
            if {f"{gate}.bias", f"{up}.bias"} <= set(a):  # a converter may exchange the weights and keep the biases
                found.append(Hypothesis(MistakeId.GATE_UP_EXCHANGED, f"B's {gate} weight is A's {up}'s and the "
                                        "reverse, the biases in place", lambda t, g=gate, u=up: _swap(t, g, u, False)))
            weights = (f"{gate}.weight", f"{up}.weight") if gate.endswith("_proj") else (gate, up)
            pairs = [weights, (f"{gate}_bias", f"{up}_bias"), (f"{gate}.bias", f"{up}.bias")]
            for interleaved, how in ((True, "[gate; up] halves read as alternate rows"),
                                     (False, "alternate rows read as [gate; up] halves")):
                for which, said in ((pairs, ""), (pairs[:1], ", biases as A's")):  # a converter may miss the biases
                    found.append(Hypothesis(MistakeId.GATE_UP_REORDERED, f"B's {gate} and {up}: {how}{said}",
                                            lambda t, p=which, i=interleaved: _refused_layout(t, p, i)))
    scaled = {}
    for name in differing:
        found.extend(fused_hypotheses(name, a[name]))
        found.extend(tensor_hypotheses(name, a[name], b[name], storage[name]))
        factor = scale_factor(a[name], b[name])
        if factor is not None and abs(factor + 1) >= 1e-2 and abs(factor - 1) > 0.05:  # not a tensor merely rounded
            scaled[name] = factor
        found.extend(block_hypotheses(name, a[name], storage[name]))
        found.extend(codebook_hypotheses(name, a[name], storage[name]))
        found.extend(mlx_hypotheses(name, a[name], storage[name]))
        if storage[name].fp4 is not None:  # FP4 groups: replayed in the reference's layout (fp4_grid.mistakes)
            found.extend(Hypothesis(MistakeId(mistake), f"{name}: {detail}", _replace(name, values))
                         for mistake, detail, values in fp4_grid.mistakes(a[name], storage[name].fp4))
        # after the format's own replays, which win a tie: a packed order within each block is also an order
        found.extend(permuted_hypotheses(name, a[name], b[name]))
    if len(scaled) > 1:  # a reader that misapplies a scale does so to every tensor of the layer (every scale halved)
        found.append(Hypothesis(MistakeId.TENSOR_SCALED, ", ".join(f"{n} x {f:.4g}" for n, f in scaled.items()),
                                lambda t, s=scaled: {**t, **{n: t[n].float() * f for n, f in s.items()}}))
    # integer groups: a zero point off by one moves each value a step, which the tensor's largest distance may not show
    found.extend(group_hypotheses(a, storage))
    return found


def block_hypotheses(name: str, a: torch.Tensor, storage: conversion.Storage) -> list[Hypothesis]:
    """An FP8 block-quantized tensor's conversion mistakes (``fp8_grid.mistakes``): A quantized as the format does,
    then read back the way the mistake reads it.  None for other storage or a chunk of a fused tensor."""
    stored = conversion.stored_layout(storage.route, a.float())
    if storage.block is None or stored is None or stored.dim() != 2:
        return []
    return [Hypothesis(MistakeId(mistake), f"{name}: {detail}", _replace(name, values))
            for mistake, detail, values in fp8_grid.replays(stored, storage.block,
                                                            lambda t: conversion.unstored(storage.route, t),
                                                            power_of_two=storage.power_of_two,
                                                            scale_dtype=storage.scale_dtype)]


def codebook_hypotheses(name: str, a: torch.Tensor, storage: conversion.Storage) -> list[Hypothesis]:
    """A bitsandbytes 4-bit tensor's conversion mistakes (``codebook_grid.mistakes``): A quantized by bitsandbytes,
    then read back the way the mistake reads it.  None for other storage or a chunk of a fused tensor."""
    stored = conversion.stored_layout(storage.route, a.float())
    if storage.codebook is None or stored is None or stored.dim() != 2:
        return []
    return [Hypothesis(MistakeId(mistake), f"{name}: {detail}", _replace(name, values))
            for mistake, detail, values in codebook_grid.replays(stored, storage.codebook,
                                                                 lambda t: conversion.unstored(storage.route, t))]


def mlx_hypotheses(name: str, a: torch.Tensor, storage: conversion.Storage) -> list[Hypothesis]:
    """An MLX-quantized tensor's conversion mistakes (``mlx_grid.mistakes``): A quantized with
    mlx.core.quantize, then read back the way the mistake reads it.  None for other storage."""
    stored = conversion.stored_layout(storage.route, a.float())
    if storage.mlx is None or stored is None:
        return []
    return [Hypothesis(MistakeId(mistake), f"{name}: {detail}", _replace(name, values))
            for mistake, detail, values in mlx_grid.replays(stored, storage.mlx,
                                                               lambda t: conversion.unstored(storage.route, t))]


def group_hypotheses(a: dict[str, torch.Tensor], storage: dict[str, conversion.Storage]) -> list[Hypothesis]:
    """The integer group-quantized tensors' conversion mistakes (``group_grid.mistakes``): A quantized on B's grid,
    then read back the way the mistake reads it; each for one tensor, and for every such tensor of the layer at once
    (a writer's or reader's mistake is usually systematic).  None for other storage or a chunk of a fused tensor."""
    found, joint = [], {}
    for name, tensor in a.items():
        store = storage.get(name)
        stored = conversion.stored_layout(store.route, tensor.float()) if store is not None else None
        if store is None or store.group is None or stored is None or stored.dim() != 2:
            continue
        for mistake, detail, values in group_grid.mistakes(stored, store.group):
            value = conversion.unstored(store.route, values)
            found.append(Hypothesis(MistakeId(mistake), f"{name}: {detail}", _replace(name, value)))
            joint.setdefault((mistake, detail), {})[name] = value
    for (mistake, detail), values in joint.items():
        if len(values) > 1:
            found.append(Hypothesis(MistakeId(mistake), f"{', '.join(values)}: {detail}",
                                    lambda t, v=values: {**t, **v}))
    return found


def fused_hypotheses(name: str, a: torch.Tensor) -> list[Hypothesis]:
    """A tensor holding gate and up fused along its rows (transformers' names say so: Phi-3's gate_up_proj, in
    mappings/aliases.toml): its halves exchanged, or its rows written in the other layout (halves / interleaved)."""
    from parity.definitions.aliases import load_aliases

    if a.dim() == 0 or a.shape[0] % 2 or "gate_up" not in {role for role, _ in load_aliases().roles_of(name)}:
        return []
    first, second = a.float().chunk(2)
    alternate = interleave_rows(first, second)  # [g; u] -> g0 u0 g1 u1
    halves = torch.cat([a.float()[0::2], a.float()[1::2]])  # g0 u0 g1 u1 -> [g; u]
    return [Hypothesis(MistakeId.GATE_UP_EXCHANGED, f"{name}: its halves exchanged (up first, then gate)",
                       _replace(name, torch.cat([second, first]))),
            Hypothesis(MistakeId.GATE_UP_REORDERED, f"{name}: [gate; up] halves written as alternate rows",
                       _replace(name, alternate)),
            Hypothesis(MistakeId.GATE_UP_REORDERED, f"{name}: alternate rows written as [gate; up] halves",
                       _replace(name, halves))]


def permuted_hypotheses(name: str, a: torch.Tensor, b: torch.Tensor) -> list[Hypothesis]:
    """A matrix whose rows (or columns) are A's in another order (``permutation.permutations``): A's put in it."""
    return [Hypothesis(mistake, f"{name}: {detail}", _replace(name, value))
            for mistake, detail, value in permutation.permutations(a, b)]


def _replace(name: str, value: torch.Tensor) -> Callable[[dict], dict]:
    return lambda t: {**t, name: value}


# A least-squares factor names a tensor scaled only where factor x A explains B: the cosine of B with A at least this
# (int4 groups keep it above 0.99, MLX's 2-bit about 0.85).  Layer 1's GPTQ tensors in layer 0's place of
# llm-compressor 0.14's W4A16 export have A's gate x -0.004 as their factor (cosine 0.01): replayed, that zeroes gate,
# and the module that outputs zeros lay within the layer's tolerance of B before the shifted layer was searched.
RELATED = 0.5


def scale_factor(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """The least-squares factor of B's tensor on A's, where it is finite, not zero and not one (within 1e-3), and
    B is A times it but for a residual (``RELATED``)."""
    af, bf = a.float(), b.float()
    denominator = float((af * af).sum())
    factor = float((af * bf).sum()) / denominator if denominator else math.nan
    if not math.isfinite(factor) or abs(factor - 1) <= 1e-3 or factor == 0:
        return None
    cosine = abs(factor) * math.sqrt(denominator / max(float((bf * bf).sum()), 1e-300))
    return factor if cosine >= RELATED else None


def tensor_hypotheses(name: str, a: torch.Tensor, b: torch.Tensor, storage: conversion.Storage) -> list[Hypothesis]:
    """What one tensor may have suffered: transposed (square), scaled or negated (the least-squares factor of B
    on A), zero-filled, constant, cut short (a zero tail), its bytes read as the other 16-bit dtype."""
    found = []
    af, bf = a.float(), b.float()
    if a.dim() == 2 and a.shape[0] == a.shape[1]:
        found.append(Hypothesis(MistakeId.TENSOR_TRANSPOSED, f"{name} transposed", _replace(name, af.t())))
    factor = scale_factor(af, bf)
    if factor is not None:
        mistake = MistakeId.SIGN_FLIPPED if abs(factor + 1) < 1e-2 else MistakeId.TENSOR_SCALED
        found.append(Hypothesis(mistake, f"{name} x {factor:.4g}",
                                _replace(name, -af if mistake == MistakeId.SIGN_FLIPPED else af * factor)))
    if bf.numel() and not bool(bf.any()):
        found.append(Hypothesis(MistakeId.ZERO_FILLED, f"{name} all zeros", _replace(name, torch.zeros_like(af))))
    elif bf.numel() and float(bf.min()) == float(bf.max()):
        found.append(Hypothesis(MistakeId.CONSTANT_TENSOR, f"{name} = {float(bf.min()):.4g} everywhere",
                                _replace(name, torch.full_like(af, float(bf.min())))))
    end = conversion.zero_tail(af, bf)
    if end is not None:
        cut = af.clone().reshape(-1)
        cut[end:] = 0
        found.append(Hypothesis(MistakeId.TENSOR_TRUNCATED, f"{name}: the first {end} of {af.numel()} values are "
                                "A's, the rest zero", _replace(name, cut.reshape(af.shape))))
    why = conversion.reinterpreted(a, b, storage.dtype)
    if why is not None:
        other = torch.bfloat16 if storage.dtype == "float16" else torch.float16
        bits = a.to(other).view(torch.int16).view(getattr(torch, storage.dtype)).float()
        found.append(Hypothesis(MistakeId.BYTES_REINTERPRETED, f"{name}: {why}", _replace(name, bits)))
    return found
