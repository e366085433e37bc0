"""`assert_parity` for a project's own test suite: one line per checked module, and a
failure message a reader can act on (the per-layer table and the diagnosis).
"""

from __future__ import annotations

from typing import Any, Iterable

from .report import Report, render


class ParityAssertionError(AssertionError):
    """A layer deviates from transformers; ``.report`` holds the full report."""

    def __init__(self, message: str, report: Report):
        super().__init__(message)
        self.report = report


def assert_parity(model: str, target: str | Any | None = None, layers: str | int | Iterable[int] | None = None,
                  checkpoint: str | None = None, mapping: str | None = None, revision: str | None = None,
                  seed: int = 0, atol: float | None = None, require_real_weights: bool = False,
                  allow_pickle: bool = False, experts: str | int | Iterable[int] | None = None,
                  logits: bool = False) -> Report:
    """Check ``target`` (a class, factory or 'pkg.module:Name') against transformers; return the report.

    Raises ParityAssertionError (an AssertionError) when a layer deviates, with the table.
    Bad input (no such checkpoint, unimportable target) raises parity's own ParityError, as
    the CLI's exit code 2 does: a broken test set-up is not a failing module.
    ``require_real_weights`` fails instead of silently checking the synthetic stand-in that
    is used when the default hub checkpoint is unreachable.
    """
    from .runner import check

    report = check(model, layers=layers, target=target, checkpoint=checkpoint, mapping=mapping, revision=revision,
                   seed=seed, atol=atol, allow_pickle=allow_pickle, experts=experts, logits=logits)
    if require_real_weights and report.weights != "real":
        raise ParityAssertionError(f"parity: {model} was checked on {report.weights} weights "
                                   f"({report.weights_note}); real weights were required\n\n{render(report)}", report)
    if not report.passed:
        raise ParityAssertionError("parity: the module deviates from transformers\n\n" + render(report), report)
    return report
