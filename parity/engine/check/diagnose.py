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

In a low-precision run (--dtype bfloat16 / float16) the replays run in that dtype on the
target's device and match within the dtype-aware tolerance; every replay's distance is kept
in the diagnosis (``candidates``).  Not every mistake stays visible there: ``separability``
measures, per layer, how far each mistake moves the output against that dtype's own error
(exact vs tanh GELU never comes near bfloat16's), and reports the ones it cannot see.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from parity.definitions.aliases import load_aliases
from parity.definitions.families import TANH_GELUS, configured_activation
from parity.definitions.mistakes import MistakeId, diagnosis
from parity.definitions.records import Candidate, Diagnosis, Separability
from parity.engine.reference import activation_module, activation_name, replace_activation

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
        replace_activation(module, ACT2FN[name])
    return patch


def _gate_and_up(tensors: dict[str, torch.Tensor]) -> tuple[str, str] | None:
    """The reference's gate and up projections (their names without ``.weight``), read off the names by
    aliases.toml's roles (``gate_proj``/``up_proj``, xLSTM's ``proj_up_gate``/``proj_up``, ...): one of each, else
    None."""
    aliases = load_aliases()
    owners = {role: [name.removesuffix(".weight") for name in tensors if name.endswith(".weight")
                     and (role, "weight") in aliases.roles_of(name)] for role in ("gate", "up")}
    return (owners["gate"][0], owners["up"][0]) if all(len(v) == 1 for v in owners.values()) else None


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


def _reordered(interleaved: bool) -> Callable[[dict], dict]:
    """One expert's gate and up (and their biases) fused in one layout and read in the other: a port that takes
    the halves of GPT-OSS's interleaved gate_up_proj (``interleaved``), or alternate rows of [gate; up]."""
    from parity.engine.gate_up_layout import layout_misread

    return functools.partial(layout_misread, stored_interleaved=interleaved)


def _replace(name: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict], dict]:
    return lambda t: {**t, name: fn(t[name])}


def _sparsity_of(reference: nn.Module) -> tuple[nn.Module, float] | None:
    """The module inside transformers' MLP that sparsifies its gate before the activation (its own
    ``activation_sparsity`` attribute, a fraction above 0: Gemma 3n's early layers) and that fraction; else None."""
    for module in reference.modules():
        value = getattr(module, "activation_sparsity", None)
        if isinstance(value, float) and value > 0.0:
            return module, value
    return None


def _setting_owner(reference: nn.Module, name: str) -> tuple[nn.Module, float] | None:
    """The module inside the reference holding a numeric setting ``name`` (GPT-OSS's experts: ``limit``, the
    clamp of gate and up, and ``alpha``, the gate's sigmoid slope), and its value; None where none does."""
    for module in reference.modules():
        value = getattr(module, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return module, float(value)
    return None


def _set(name: str, value: float) -> Callable[[nn.Module], None]:
    def patch(module: nn.Module) -> None:
        owner = _setting_owner(module, name)
        if owner is not None:
            setattr(owner[0], name, value)
    return patch


def _swiglu_settings(reference: nn.Module) -> list[Hypothesis]:
    """One expert of a clamped SwiGLU (its module's ``limit`` and ``alpha``): the clamp left out (or its limit read
    as 0) and alpha dropped, as the whole block's replays (engine.routing_mistakes) name them."""
    found = []
    limit, alpha = _setting_owner(reference, "limit"), _setting_owner(reference, "alpha")
    if limit is not None:
        found += [Hypothesis(MistakeId.SWIGLU_CLAMP_MISSING, f"limit {limit[1]:g} -> {to:g}", patch=_set("limit", to))
                  for to in (float("inf"), 0.0)]
    if alpha is not None and alpha[1] != 1.0:
        found.append(Hypothesis(MistakeId.SWIGLU_ALPHA_MISSING, f"alpha {alpha[1]:g} -> 1", patch=_set("alpha", 1.0)))
    return found


def _without_sparsity(module: nn.Module) -> None:
    found = _sparsity_of(module)
    if found is not None:
        found[0].activation_sparsity = 0.0


def hypotheses(reference: nn.Module, tensors: dict[str, torch.Tensor], config) -> list[Hypothesis]:
    """The known mistakes that apply to this reference MLP."""
    found: list[Hypothesis] = []
    act = activation_name(reference, configured_activation(config))
    if act in TANH_GELUS:
        found += [Hypothesis(MistakeId.GELU_EXACT_INSTEAD_OF_TANH, f"reference runs {act}",
                             patch=_activation_swap("gelu")),
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
                  Hypothesis(MistakeId.GELU_INSTEAD_OF_SILU, f"exact GELU; reference runs {act}",
                             patch=_activation_swap("gelu"))]
    sparse = _sparsity_of(reference)
    if sparse is not None:
        found.append(Hypothesis(MistakeId.ACTIVATION_SPARSITY_MISSING,
                                f"the layer's activation sparsity {sparse[1]} not applied",
                                patch=_without_sparsity))
    found += _swiglu_settings(reference)
    pair = _gate_and_up(tensors)
    if pair is not None:
        found.append(Hypothesis(MistakeId.GATE_UP_SWAPPED, f"{pair[0]} <-> {pair[1]}", tensors=_swap(*pair)))
    if "gate" in tensors and "up" in tensors:  # one MoE expert (parity.engine.experts), its biases with it
        found.append(Hypothesis(MistakeId.GATE_UP_SWAPPED, "expert gate <-> up",
                                tensors=lambda t: {**t, "gate": t["up"], "up": t["gate"],
                                                   **({"gate_bias": t["up_bias"], "up_bias": t["gate_bias"]}
                                                      if "gate_bias" in t and "up_bias" in t else {})}))
        found += [Hypothesis(MistakeId.GATE_UP_REORDERED, "expert gate/up interleaved, read as [gate; up] halves",
                             tensors=_reordered(interleaved=True)),
                  Hypothesis(MistakeId.GATE_UP_REORDERED, "expert [gate; up] halves, read as alternate rows",
                             tensors=_reordered(interleaved=False))]
    for name in tensors:
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


def _values(act: nn.Module, grid: torch.Tensor) -> torch.Tensor | None:
    """``act`` on ``grid`` in float64, or None for one that holds parameters or does not run on a plain vector."""
    if next(iter(act.parameters()), None) is not None:
        return None
    try:
        with torch.no_grad():
            out = act(grid)
    except Exception:  # an activation that cannot run alone (it needs arguments or a shape) is no candidate
        return None
    return out if isinstance(out, torch.Tensor) and out.shape == grid.shape else None


def other_activations(reference: nn.Module, config) -> list[Hypothesis]:
    """Every other activation transformers ships (ACT2FN), one per distinct function, put where the reference's
    sits: a port that wrote ReLU for GELU, GELU for ReLU, or none at all (``linear``).  Tried only after the named
    mistakes (the GELU variants, SiLU/GELU, ...) explain nothing, so they cost a failing layer nothing more.
    Two names computing the same values over [-12, 12] (gelu_new and gelu_pytorch_tanh) are one candidate; one
    computing the reference's own is none."""
    from transformers.activations import ACT2FN

    own = activation_module(reference)
    grid = torch.linspace(-12.0, 12.0, 481, dtype=torch.float64)
    seen = [_values(own, grid)] if own is not None else []
    if not seen or seen[0] is None:
        return []  # no activation module to replace (or one that cannot be measured): nothing to replay
    act = activation_name(reference, configured_activation(config))
    found = []
    for name in sorted(ACT2FN):
        try:
            values = _values(ACT2FN[name].double(), grid)
        except Exception:  # an ACT2FN entry that needs constructor arguments
            continue
        if values is None or any(torch.allclose(values, v, rtol=1e-6, atol=1e-9) for v in seen):
            continue
        seen.append(values)
        found.append(Hypothesis(MistakeId.WRONG_ACTIVATION, f"{name} where transformers' FFN runs {act}",
                                patch=_activation_swap(name)))
    return found


Builder = Callable[..., nn.Module]  # build(tensors, dtype=torch.float32, on_call=False) -> transformers' MLP
GELU_VARIANTS = {MistakeId.GELU_EXACT_INSTEAD_OF_TANH, MistakeId.GELU_TANH_INSTEAD_OF_EXACT}
SEPARATION = 2.0  # a mistake is told apart at a low precision when its replay is this x the tolerance away


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _run(module: nn.Module, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``module`` on ``x`` in ``dtype``, on the module's device -> float64 on the CPU."""
    param = next(module.parameters(), None)
    device = param.device if param is not None else x.device
    return module(x.to(device=device, dtype=dtype)).cpu().double()


def replay(build: Builder, hypothesis: Hypothesis, tensors: dict[str, torch.Tensor], x: torch.Tensor,
           dtype: torch.dtype = torch.float32, on_call: bool = False) -> torch.Tensor:
    """transformers' MLP for the layer with one mistake made, run on ``x`` in ``dtype`` (on the
    run's device for a low precision) -> float64 on the CPU."""
    module = build(hypothesis.tensors(tensors), dtype=dtype, on_call=on_call)
    hypothesis.patch(module)
    return _run(module, x, dtype)


def _exactly_representable(values: torch.Tensor, dtype: torch.dtype) -> bool:
    return bool(torch.equal(values, values.to(dtype).to(values.dtype)))


def _low_precision(build, tensors, x, got, reference64, reference_distance, dtype) -> dict:
    low = build(tensors, dtype=dtype, on_call=False).cpu()(x.to(dtype)).double()
    name = dtype_name(dtype)
    detail = f"{name}: the reference computed in {name} deviates from float64 by {(low - reference64).abs().max():.2e}"
    return diagnosis(MistakeId.LOW_PRECISION_COMPUTE, float((got - low).abs().max()), reference_distance, detail)


def _coarser(dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The half-precision formats a module checked in ``dtype`` may wrongly compute in (bf16 values are also
    fp16 values: bf16 first).  A bfloat16 run has none: every format it could drop to is as fine as its own."""
    return {torch.float32: (torch.bfloat16, torch.float16), torch.float16: (torch.bfloat16,)}.get(dtype, ())


def _low_precision_signature(build, tensors, x, got, reference64, reference_distance, formats) -> dict | None:
    """Half precision, recognised by its signature: outputs that are exactly values of the format, or an
    error pattern that lines up with the error of the reference replayed in that format."""
    integral = torch.equal(got, got.round())  # zeros, integers, booleans: representable in any format, not a sign
    for dtype in formats:
        if not integral and _exactly_representable(got, dtype) and not _exactly_representable(reference64, dtype):
            return _low_precision(build, tensors, x, got, reference64, reference_distance, dtype)
    error = got - reference64
    for dtype in formats:
        # Rounding the same weights to the same format leaves the same error pattern: a
        # half-precision module's error lines up with a half-precision replay's error.
        # Two replays: everything in that format, and only weights and input rounded to it.
        whole = build(tensors, dtype=dtype, on_call=False).cpu()(x.to(dtype)).double()
        rounded = build({k: v.to(dtype).float() for k, v in tensors.items()})(x.to(dtype).float()).double()
        for low in (whole, rounded):
            low_error = low - reference64
            alike = float(torch.nn.functional.cosine_similarity(error.flatten(), low_error.flatten(), dim=0))
            scale = reference_distance / max(float(low_error.abs().max()), 1e-30)
            if alike > 0.5 and 0.25 <= scale <= 4:
                return _low_precision(build, tensors, x, got, reference64, reference_distance, dtype)
    return None


def _closest(build: Builder, tried: list[Hypothesis], tensors: dict[str, torch.Tensor], x: torch.Tensor,
             got: torch.Tensor, dtype: torch.dtype, candidates: list[Candidate],
             best: tuple[float, Hypothesis] | None) -> tuple[float, Hypothesis] | None:
    """Replay each hypothesis, add its distance from the target's output to ``candidates``; the closest so far."""
    for hypothesis in tried:
        distance = float((got - replay(build, hypothesis, tensors, x, dtype)).abs().max())
        candidates.append(Candidate(str(hypothesis.id), hypothesis.detail, distance))
        if best is None or distance < best[0]:
            best = (distance, hypothesis)
    return best


def diagnose(build: Builder, tensors: dict[str, torch.Tensor], config, x: torch.Tensor, got: torch.Tensor,
             reference64: torch.Tensor, tolerance: float, dtype: torch.dtype = torch.float32) -> Diagnosis:
    """Explain a failing layer.  ``build(tensors, dtype)`` returns a fresh reference MLP computing in ``dtype``
    (on the run's device for a low precision); each mistake is replayed in the dtype the target ran in and
    matched within ``tolerance``, the one the layer was judged with.  ``candidates`` lists every replay."""
    reference_distance = float((got - reference64).abs().max())
    probe = build(tensors)
    candidates: list[Candidate] = []
    with torch.no_grad():
        best = _closest(build, hypotheses(probe, tensors, config), tensors, x, got, dtype, candidates, None)
        if best is None or best[0] > tolerance:
            best = _closest(build, other_activations(probe, config), tensors, x, got, dtype, candidates, best)
        if best is not None and best[0] <= tolerance:
            return diagnosis(best[1].id, best[0], reference_distance, best[1].detail, candidates)
        found = _low_precision_signature(build, tensors, x, got, reference64, reference_distance, _coarser(dtype))
    if found is not None:
        return dataclasses.replace(found, candidates=candidates)
    closest = f"closest known mistake: {best[1].id}, {best[1].detail}, at {best[0]:.2e}" if best else ""
    return diagnosis(MistakeId.UNEXPLAINED, best[0] if best else None, reference_distance, closest, candidates)


def separability(build: Builder, tensors: dict[str, torch.Tensor], config, x: torch.Tensor,
                 reference64: torch.Tensor, tolerance: float, reference_error: float | None, dtype: str,
                 atol: float | None = None, own_tolerance: float | None = None) -> list[Separability]:
    """Which known mistakes this check can still tell from a correct module on this layer, at its dtype and
    tolerance (a low-precision run, or any run with ``atol``: a tolerance that is not parity's own).

    Each mistake is replayed in float32 (its own error, ~1e-6, is far below any low-precision
    tolerance) and its distance d from the float64 truth measured.  A module making the mistake
    is off by at least d minus its own rounding error, which a correct module's is held to stay
    under the tolerance T; so the mistake is certain to fail only when d > SEPARATION x T.
    Below that it may pass, and is reported as not checked, with its cause: the tolerance (when parity's own,
    ``own_tolerance``, would tell it) or the dtype.
    """
    rows = []
    with torch.no_grad():
        for hypothesis in hypotheses(build(tensors, on_call=True), tensors, config):
            distance = float((replay(build, hypothesis, tensors, x, on_call=True) - reference64).abs().max())
            checked = distance > SEPARATION * tolerance
            what = f"{hypothesis.id} ({hypothesis.detail})" if hypothesis.detail else str(hypothesis.id)
            message = None if checked else not_checked_message(what, distance, tolerance, reference_error, dtype,
                                                               atol, own_tolerance)
            rows.append(Separability(str(hypothesis.id), hypothesis.detail, distance, checked, message))
    return rows


def not_checked_message(what: str, distance: float, tolerance: float, reference_error: float | None, dtype: str,
                        atol: float | None, own_tolerance: float | None) -> str:
    """Why a mistake is not checked, naming the real cause: the --atol given, or the dtype."""
    sure = f"only beyond {SEPARATION * tolerance:.2e} is it sure to fail"
    if atol is not None and (own_tolerance is None or distance > SEPARATION * own_tolerance):
        return (f"{what} not checked with --atol {atol:g}: drop --atol to check it (on this layer the mistake "
                f"changes the output by max|Δ| {distance:.2e}, within the tolerance {tolerance:.2e} allows: {sure}; "
                f"parity's own tolerance here is {own_tolerance:.2e})" if own_tolerance is not None else
                f"{what} not checked with --atol {atol:g}: drop --atol to check it (the mistake changes the output "
                f"by max|Δ| {distance:.2e}: {sure})")
    error = f"{dtype}'s own error here is {reference_error:.2e}, " if reference_error is not None else ""
    also = " and without --atol" if atol is not None else ""
    return (f"{what} not checked at {dtype}: run with --dtype float32{also} to check it (on this layer the mistake "
            f"changes the output by max|Δ| {distance:.2e}; {error}the tolerance {tolerance:.2e}: {sure})")
