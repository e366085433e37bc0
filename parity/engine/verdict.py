"""The verdict on one layer, from its tensors alone.

passed  = the reference can judge this layer (``unverifiable_reason`` is None)
          and the target left its input alone
          and its output is finite and the same in two identical runs
          and max |target - reference64| <= tolerance,
tolerance = atol, or max(NOISE_FACTOR x noise floor, RELATIVE_FLOOR x max |reference64|),
noise floor = max |reference32 - reference64| (the float32 reference against its own float64 run).

A low-precision run (``--dtype bfloat16`` / ``float16``) is held to the reference's own error in
that dtype instead: transformers' MLP cast to the dtype, on the target's device, run on the same
inputs, against the float64 truth,
tolerance = atol, or max(LOW_PRECISION_FACTOR x reference error, RELATIVE_FLOOR x max |reference64|),
reference error = max |reference_low - reference64|,
and the layer's ``ratio_to_reference_error`` = max |target - reference64| / reference error
(docs/precision.md: why the factor is LOW_PRECISION_FACTOR).

A layer the reference cannot judge (its float32 output overflows, the tolerance is as large
as the output itself, a weight matrix is all zeros, two weights are identical, the output
does not depend on the input) is reported as
unverifiable with the reason: a pass there would be a green light that proves nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from parity.definitions.mistakes import MistakeId, diagnosis
from parity.engine.results import LayerResult
from parity.errors import ShapeMismatchError

NOISE_FACTOR = 16.0  # tolerance = NOISE_FACTOR x noise floor ...
RELATIVE_FLOOR = 2.0 ** -20  # ... but never below this x max |reference| (fp32 rounding of the output)
LOW_PRECISION_FACTOR = 4.0  # low-precision runs: tolerance = this x the reference's own error in that dtype


@dataclass
class Runs:
    """What one layer's check computed; every tensor is float64 and shaped like the reference output."""

    reference64: torch.Tensor  # the truth: transformers' MLP in float64
    reference32: torch.Tensor  # the same MLP in float32: its distance to the truth is the noise floor
    target: torch.Tensor  # the module under test, first run
    again: torch.Tensor  # the module under test, second identical run
    input_change: str | None = None  # what the target did to its own copy of the inputs, if anything
    low: torch.Tensor | None = None  # low-precision runs: the reference in the compute dtype on the device
    dtype: str = "float32"  # the target's compute dtype
    # the two identical runs compared for determinism where they are not (target, again): a block too large to hold
    # reads its experts at every run, so its second run is two on a few tokens (engine.check.block_check)
    repeated: tuple[torch.Tensor, torch.Tensor] | None = None


def measures(runs: Runs) -> tuple[float, float, float | None]:
    """(noise floor, output scale, the reference's own low-precision error or None) of these runs."""
    noise = float((runs.reference32 - runs.reference64).abs().max())
    scale = float(runs.reference64.abs().max())
    own = None if runs.low is None else float((runs.low - runs.reference64).abs().max())  # NaN: overflowed
    return noise, scale, own


def parity_tolerance(noise: float, scale: float, own: float | None) -> float:
    """The tolerance parity derives (what ``--atol`` replaces): from the noise floor, or in a low-precision run
    from the reference's own error in that dtype."""
    error, factor = (noise, NOISE_FACTOR) if own is None else (own, LOW_PRECISION_FACTOR)
    return max(factor * error, RELATIVE_FLOOR * scale)


def own_tolerance(runs: Runs) -> float:
    """parity's own tolerance for these runs (the separability statement of an --atol run compares with it)."""
    return parity_tolerance(*measures(runs))


def ratio(value: float | None, reference: float | None) -> float | None:
    if value is None or reference is None:
        return None
    return value / reference if reference else math.inf if value else 0.0


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality where NaN equals NaN: a NaN in both runs is not non-determinism."""
    return a.shape == b.shape and bool(torch.allclose(a, b, rtol=0.0, atol=0.0, equal_nan=True))


TOLERANCE_TOO_LARGE = "lower --atol"  # a check's remedy for a tolerance as large as the output (a compare has its own)


def unverifiable_reason(weights: dict[str, torch.Tensor], runs: Runs, tolerance: float,
                        facts: dict[str, Any] | None = None, *, too_large: str = TOLERANCE_TOO_LARGE) -> str | None:
    """Why comparing against this layer's reference could not tell a right module from a wrong one.  ``facts``
    (engine.layer.TensorFacts by weight name, from the read's one pass) answer "all zero?" and "identical?"
    without another pass over the weights; ``too_large`` says why the tolerance is as large as the output, or what
    to do about it, in the caller's terms."""
    facts = facts or {}
    for name, output in (("float32", runs.reference32), ("float64", runs.reference64), (runs.dtype, runs.low)):
        if output is not None and not bool(torch.isfinite(output).all()):
            largest = max((float(w.abs().max()) for w in weights.values() if w.numel()), default=0.0)
            if output is runs.low:
                return (f"transformers' MLP gives NaN/Inf in {name} on this layer (largest |weight| {largest:.3g}): "
                        f"the layer overflows {name} itself, so {name} has no error to hold the module to; "
                        "check it with --dtype bfloat16 or float32")
            return (f"transformers' MLP gives NaN/Inf in {name} on this layer (largest |weight| {largest:.3g}): "
                    "the reference overflows, so it is no truth to compare against")
    if not math.isfinite(tolerance):
        return f"the tolerance is not finite ({tolerance})"
    matrices = {name: w for name, w in weights.items() if w.dim() >= 2 and w.numel()}
    for name, w in matrices.items():
        zero = facts[name].all_zero if facts.get(name) is not None else not bool(w.any())
        if zero:
            return f"weight '{name}' is all zeros: the layer computes a constant, so any module built like it passes"
    names = sorted(matrices)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            differ = facts.get(a) is not None and facts.get(b) is not None and facts[a].crc != facts[b].crc
            if matrices[a].shape == matrices[b].shape and not differ and torch.equal(matrices[a], matrices[b]):
                return f"weights '{a}' and '{b}' are identical: exchanging them (e.g. gate and up) cannot be seen"
    scale = float(runs.reference64.abs().max())
    if tolerance >= scale:
        return (f"the tolerance {tolerance:.3g} is at least the reference output's largest magnitude {scale:.3g}: "
                f"a module that outputs zeros would pass ({too_large})")
    truth = runs.reference64.reshape(-1, runs.reference64.shape[-1])
    spread = float((truth - truth[:1]).abs().max())
    if spread <= tolerance:
        return (f"the reference output does not depend on the input (it varies by {spread:.2e} over all tokens, "
                f"tolerance {tolerance:.2e}): every module computing that constant would pass")
    return None


def first_nonfinite(output: torch.Tensor) -> str:
    """'3 of 1536 values, first at [batch 0, token 2, channel 7]'."""
    bad = ~torch.isfinite(output)
    where = [int(i) for i in torch.unravel_index(bad.flatten().nonzero()[0, 0], bad.shape)]
    labels = ("batch", "token", "channel") if len(where) == 3 else tuple(f"dim{i}" for i in range(len(where)))
    return (f"{int(bad.sum())} of {bad.numel()} values are NaN/Inf, first at "
            f"[{', '.join(f'{label} {i}' for label, i in zip(labels, where, strict=True))}]")


def input_change(before: torch.Tensor, after: torch.Tensor) -> str | None:
    """None when the module left its input alone; else how many elements it changed, and the first."""
    if after.shape == before.shape and torch.equal(after, before):
        return None
    if after.shape != before.shape:
        return f"the input's shape changed from {list(before.shape)} to {list(after.shape)}"
    changed = after != before
    if before.is_floating_point():
        changed &= ~(after.isnan() & before.isnan())
    index = [int(i) for i in torch.unravel_index(changed.flatten().nonzero()[0, 0], changed.shape)]
    return (f"{int(changed.sum())} of {changed.numel()} input elements changed, first at {index}: "
            f"{float(before[tuple(index)]):.4g} -> {float(after[tuple(index)]):.4g}")


def judge(layer: int, expert: int | None, runs: Runs, weights: dict[str, torch.Tensor], z: torch.Tensor | None,
          atol: float | None, weights_kind: str, facts: dict[str, Any] | None = None, *,
          too_large: str = TOLERANCE_TOO_LARGE) -> LayerResult:
    """The formula at the top of this module, and the findings that need no replay named (``too_large``: as for
    ``unverifiable_reason``)."""
    noise, scale, own = measures(runs)
    first, second = runs.repeated or (runs.target, runs.again)
    tolerance = atol if atol is not None else parity_tolerance(noise, scale, own)
    diff = (runs.target - runs.reference64).abs()
    finite = bool(torch.isfinite(runs.target).all())
    max_abs = float(diff.max()) if finite else None
    result = LayerResult(
        layer=layer, passed=False, max_abs_diff=max_abs,
        max_rel_diff=None if max_abs is None else max_abs / scale if scale else math.inf,
        mean_abs_diff=float(diff.mean()) if finite else None,
        max_at=[int(i) for i in torch.unravel_index(diff.nan_to_num(math.inf).argmax(), diff.shape)],
        noise_floor=noise, tolerance=tolerance,
        ratio_to_noise=ratio(max_abs, noise),
        preactivation_range=[float(z.min()), float(z.max())] if z is not None else None,
        deterministic=same_values(first, second), expert=expert, weights=weights_kind,
        reference_error=own, ratio_to_reference_error=ratio(max_abs, own),
    )
    result.unverifiable = unverifiable_reason(weights, runs, tolerance, facts, too_large=too_large)
    if runs.input_change is not None:  # a definite bug, whatever the reference can judge
        result.diagnosis = diagnosis(MistakeId.INPUT_MUTATED, None, max_abs, runs.input_change)
    elif result.unverifiable is not None:
        pass
    elif not finite:
        result.diagnosis = diagnosis(MistakeId.NONFINITE_OUTPUT, None, None, first_nonfinite(runs.target))
    elif not result.deterministic:  # no replay can match a moving target
        moved = float((first - second).abs().nan_to_num(math.inf).max())
        result.diagnosis = diagnosis(MistakeId.DROPOUT_ACTIVE, moved, max_abs)
    else:
        result.passed = max_abs <= tolerance
    return result


def shape_failure(layer: int, expert: int | None, error: ShapeMismatchError, weights_kind: str) -> LayerResult:
    """A layer whose module cannot hold the checkpoint's tensors: failed, with the likely cause."""
    result = LayerResult(layer=layer, passed=False, max_abs_diff=None, max_rel_diff=None, mean_abs_diff=None,
                         max_at=None, noise_floor=None, tolerance=None, ratio_to_noise=None, preactivation_range=None,
                         expert=expert, weights=weights_kind)
    result.diagnosis = diagnosis(error.mistake_id, None, None, str(error))
    return result
