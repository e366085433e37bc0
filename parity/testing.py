"""`assert_parity` for a project's own test suite: one line per checked module, and a
failure message a reader can act on (the per-layer table and the diagnosis).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from parity.engine.results import Report
from parity.errors import ParityAssertionError
from parity.outputs.render import render
from parity.outputs.text import diagnosis_ids, summary_line, units_label


def assert_parity(model: str, target: str | Any | None = None, layers: str | int | Iterable[int] | None = None,
                  checkpoint: str | None = None, mapping: str | None = None, revision: str | None = None,
                  seed: int = 0, atol: float | None = None, require_real: bool = False,
                  allow_pickle: bool = False, experts: str | int | Iterable[int] | None = None,
                  logits: bool = False, require_real_weights: bool = False, device: str = "cpu",
                  dtype: str = "float32") -> Report:
    """Check ``target`` (a class, a factory, an nn.Module instance, which is not modified, or 'pkg.module:Name')
    against transformers; return the report.

    Raises ParityAssertionError (an AssertionError) unless every checked layer matches: a deviation,
    a layer that could not be verified, or nothing checked.  Its first line is the verdict, so
    ``pytest --tb=line`` says what failed; the table and diagnosis follow.  Bad input (no such
    checkpoint, unimportable target) raises parity's own ParityError, as the CLI's exit code 2
    does: a broken test set-up is not a failing module.  ``require_real`` (``require_real_weights``,
    its older name) fails instead of checking the synthetic stand-in used when the default hub
    checkpoint is unreachable.
    """
    __tracebackhide__ = True  # pytest shows the assertion, not parity's frames
    from parity.api import check

    require_real = require_real or require_real_weights
    report = check(model, layers=layers, target=target, checkpoint=checkpoint, mapping=mapping, revision=revision,
                   seed=seed, atol=atol, allow_pickle=allow_pickle, experts=experts, logits=logits, device=device,
                   dtype=dtype)
    if require_real and report.synthetic:
        raise ParityAssertionError(f"parity: {model} was checked on synthetic weights "
                                   f"({report.weights_note}); real weights were required\n\n{render(report)}", report)
    if not report.passed:
        raise ParityAssertionError(f"{failure_line(model, report)}\n\n{render(report)}", report)
    return report


def failure_line(model: str, report: Report) -> str:
    """The verdict in one line, the diagnosis early (pytest's short summary cuts the line at the terminal's
    width): 'parity: gpt2 layer 3: MISMATCH max|Δ| 9.0e-04 > tol 3.5e-05 — gelu_exact_instead_of_tanh [target]'."""
    failed = [r for r in report.layers if not r.passed and r.unverifiable is None]
    if not failed:
        return f"parity: {model} [{report.target}]: {summary_line(report)}"
    measured = [r for r in failed if r.max_abs_diff is not None and r.tolerance is not None]
    worst = max(measured, key=lambda r: r.max_abs_diff / r.tolerance if r.tolerance else math.inf, default=None)
    size = f" max|Δ| {worst.max_abs_diff:.1e} > tol {worst.tolerance:.1e}" if worst is not None else ""
    count = f" ({len(failed)} of {len(report.layers)})" if len(failed) > 1 else ""
    return f"parity: {model} {units_label(failed)}{count}: MISMATCH{size}{diagnosis_ids(failed)} [{report.target}]"
