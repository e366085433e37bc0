"""Name the mistake behind a mismatch.

Each known mistake is replayed as a *modified reference*: transformers' own MLP for the
layer, built from the same weights, with one thing changed (its activation swapped for
another of transformers' activations, gate and up exchanged, a weight transposed, biases
zeroed) or run in half precision.  The hypothesis whose output reproduces the target's
output within the noise-floor tolerance names the mistake.

Why the hypotheses are separable: inputs drive the activation's input to |z| ~ 8, where
exact GELU, tanh GELU, quick GELU and SiLU all differ well above float32 noise (tanh vs
exact: 4.7e-4 per unit near |z| = 2.7, quick GELU: 2e-2, SiLU vs GELU: O(0.1)); checkpoint
tensors are distinct (gate and up never share values), so a swap changes the function;
transposing a square matrix or dropping a nonzero bias changes it by O(1) of its scale.
Mistakes are tried one at a time, exact replays first; half precision is tested last and
by its own signature (outputs that are exactly bfloat16/float16 values, or an error that
lines up with the error of the reference replayed in that format).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from parity.spec.mistakes import MistakeId, diagnosis
from parity.engine.reference import activation_module, activation_name
from parity.spec.families import configured_activation

TANH_GELUS = {"gelu_new", "gelu_pytorch_tanh", "gelu_python_tanh", "gelu_fast", "gelu_accurate"}
EXACT_GELUS = {"gelu", "gelu_python"}
SILUS = {"silu", "swish"}


@dataclass
class Hypothesis:
    id: MistakeId
    detail: str
    tensors: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] = lambda t: t
    patch: Callable[[nn.Module], None] = lambda m: None


def _activation_swap(name: str) -> Callable[[nn.Module], None]:
    from transformers.activations import ACT2FN

    def patch(module: nn.Module) -> None:
        act = activation_module(module)
        for parent in list(module.modules()):  # every place it is registered (an MoE wrapper holds it twice)
            for child_name, child in list(parent.named_children()):
                if child is act:
                    setattr(parent, child_name, ACT2FN[name])
    return patch


def _swap(a: str, b: str) -> Callable[[dict], dict]:
    def tensors(t: dict) -> dict:
        out = dict(t)
        for suffix in ("weight", "bias"):
            if f"{a}.{suffix}" in t and f"{b}.{suffix}" in t:
                out[f"{a}.{suffix}"], out[f"{b}.{suffix}"] = t[f"{b}.{suffix}"], t[f"{a}.{suffix}"]
        return out
    return tensors


def _swap_halves(name: str) -> Callable[[dict], dict]:
    def tensors(t: dict) -> dict:
        first, second = t[name].chunk(2, dim=0)
        return {**t, name: torch.cat([second, first], dim=0)}
    return tensors


def _replace(name: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict], dict]:
    return lambda t: {**t, name: fn(t[name])}


def hypotheses(reference: nn.Module, tensors: dict[str, torch.Tensor], config) -> list[Hypothesis]:
    """The known mistakes that apply to this reference MLP."""
    found: list[Hypothesis] = []
    act = activation_name(reference, configured_activation(config))
    if act in TANH_GELUS:
        found += [Hypothesis(MistakeId.GELU_EXACT_INSTEAD_OF_TANH, f"reference runs {act}", patch=_activation_swap("gelu")),
                  Hypothesis(MistakeId.QUICK_GELU, f"reference runs {act}", patch=_activation_swap("quick_gelu")),
                  Hypothesis(MistakeId.SILU_INSTEAD_OF_GELU, f"reference runs {act}", patch=_activation_swap("silu"))]
    elif act in EXACT_GELUS:
        found += [Hypothesis(MistakeId.GELU_TANH_INSTEAD_OF_EXACT, f"reference runs {act}",
                             patch=_activation_swap("gelu_pytorch_tanh")),
                  Hypothesis(MistakeId.QUICK_GELU, f"reference runs {act}", patch=_activation_swap("quick_gelu")),
                  Hypothesis(MistakeId.SILU_INSTEAD_OF_GELU, f"reference runs {act}", patch=_activation_swap("silu"))]
    elif act in SILUS:
        found += [Hypothesis(MistakeId.GELU_INSTEAD_OF_SILU, f"tanh GELU; reference runs {act}",
                             patch=_activation_swap("gelu_pytorch_tanh")),
                  Hypothesis(MistakeId.GELU_INSTEAD_OF_SILU, f"exact GELU; reference runs {act}", patch=_activation_swap("gelu"))]
    if "gate_proj.weight" in tensors and "up_proj.weight" in tensors:
        found.append(Hypothesis(MistakeId.GATE_UP_SWAPPED, "gate_proj <-> up_proj", tensors=_swap("gate_proj", "up_proj")))
    if "gate" in tensors and "up" in tensors:  # one MoE expert (parity.engine.experts)
        found.append(Hypothesis(MistakeId.GATE_UP_SWAPPED, "expert gate <-> up",
                                tensors=lambda t: {**t, "gate": t["up"], "up": t["gate"]}))
    for name, value in tensors.items():
        if name.endswith("gate_up_proj.weight") or name.endswith("gate_up_proj"):
            found.append(Hypothesis(MistakeId.GATE_UP_SWAPPED, f"halves of {name}", tensors=_swap_halves(name)))
    squares = [n for n, v in tensors.items() if v.dim() == 2 and v.shape[0] == v.shape[1]]
    for name in squares:
        found.append(Hypothesis(MistakeId.MISSING_TRANSPOSE, f"{name} not transposed", tensors=_replace(name, torch.t)))
    if len(squares) > 1:
        found.append(Hypothesis(MistakeId.MISSING_TRANSPOSE, "square weights not transposed",
                                tensors=lambda t: {**t, **{n: t[n].t() for n in squares}}))
    biases = [n for n, v in tensors.items() if n.endswith("bias") and bool(v.abs().max() > 0)]
    for name in biases:
        found.append(Hypothesis(MistakeId.BIAS_DROPPED, f"{name} missing", tensors=_replace(name, torch.zeros_like)))
    if len(biases) > 1:
        found.append(Hypothesis(MistakeId.BIAS_DROPPED, "all biases missing",
                                tensors=lambda t: {**t, **{n: torch.zeros_like(t[n]) for n in biases}}))
    return found


def _exactly_representable(values: torch.Tensor, dtype: torch.dtype) -> bool:
    return bool(torch.equal(values, values.to(dtype).to(values.dtype)))


def _low_precision(build, tensors, x, got, reference64, reference_distance, dtype) -> dict:
    low = build(tensors).to(dtype)(x.to(dtype)).double()
    name = str(dtype).removeprefix("torch.")
    detail = f"{name}: the reference computed in {name} deviates from float64 by {(low - reference64).abs().max():.2e}"
    return diagnosis(MistakeId.LOW_PRECISION_COMPUTE, float((got - low).abs().max()), reference_distance, detail)


def diagnose(build: Callable[[dict[str, torch.Tensor]], nn.Module], tensors: dict[str, torch.Tensor], config,
             x: torch.Tensor, got: torch.Tensor, reference64: torch.Tensor, tolerance: float) -> dict:
    """Explain a failing layer.  ``build(tensors)`` returns a fresh float32 reference MLP."""
    reference_distance = float((got - reference64).abs().max())
    probe = build(tensors)
    best: tuple[float, Hypothesis] | None = None
    with torch.no_grad():
        for hypothesis in hypotheses(probe, tensors, config):
            module = build(hypothesis.tensors(tensors))
            hypothesis.patch(module)
            distance = float((got - module(x).double()).abs().max())
            if best is None or distance < best[0]:
                best = (distance, hypothesis)
        if best is not None and best[0] <= tolerance:
            return diagnosis(best[1].id, best[0], reference_distance, best[1].detail)
        for dtype in (torch.bfloat16, torch.float16):  # bf16 values are also fp16 values: bf16 first
            if _exactly_representable(got, dtype) and not _exactly_representable(reference64, dtype):
                return _low_precision(build, tensors, x, got, reference64, reference_distance, dtype)
        error = got - reference64
        for dtype in (torch.bfloat16, torch.float16):
            # Rounding the same weights to the same format leaves the same error pattern: a
            # half-precision module's error lines up with a half-precision replay's error.
            # Two replays: everything in that format, and only weights and input rounded to it.
            whole = build(tensors).to(dtype)(x.to(dtype)).double()
            rounded = build({k: v.to(dtype).float() for k, v in tensors.items()})(x.to(dtype).float()).double()
            for replay in (whole, rounded):
                low_error = replay - reference64
                alike = float(torch.nn.functional.cosine_similarity(error.flatten(), low_error.flatten(), dim=0))
                scale = reference_distance / max(float(low_error.abs().max()), 1e-30)
                if alike > 0.5 and 0.25 <= scale <= 4:
                    return _low_precision(build, tensors, x, got, reference64, reference_distance, dtype)
    closest = f"closest known mistake: {best[1].id}, {best[1].detail}, at {best[0]:.2e}" if best else ""
    return diagnosis(MistakeId.UNEXPLAINED, best[0] if best else None, reference_distance, closest)
