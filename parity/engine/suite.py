"""Many checks in one run: plan every (check, layer) unit, keep this shard's, run them.

``open_session`` is where every front door (CLI, ``parity.check``, project files) resolves a
check.  Planning resolves each check (its config and tensor index; nothing is compared yet) to know
its layers, so `--shard K/N` can split units, not whole checks; the session opened then is
the one the check runs on.  A check that cannot be set up is
recorded as an error and the others still run: one CI run shows every problem.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from parity.definitions.project import CheckSpec, CompareSpec
from parity.definitions.run_selection import shard_units
from parity.definitions.selection import parse_selection
from parity.definitions.values import check_compute
from parity.engine.check.logits import logits_impact
from parity.engine.check.run import torch_device
from parity.engine.check.session import Session, run_session
from parity.engine.layout.resolve import resolve
from parity.engine.results import LayerResult, Report
from parity.errors import ParityError, SyntheticWeightsError, UsageError


@dataclass
class CheckRun:
    spec: CheckSpec | CompareSpec
    layers: list[int] = field(default_factory=list)  # planned for this shard
    report: Report | None = None
    error: str | None = None
    seconds: list[float] = field(default_factory=list)  # per checked layer
    plan_notes: list[str] = field(default_factory=list)
    session: object | None = None  # opened while planning, reused to run: resolved once

    @property
    def label(self) -> str:
        return self.spec.label


# Opens a compare (``engine.compare.comparison.open_comparison``): passed in by the caller, since the compare sits
# above a session, as this module does, and an import here would stack the two.
CompareOpener = Callable[[CompareSpec], Any]


def plan_layers(spec: CheckSpec | CompareSpec, open_compare: CompareOpener | None = None
                ) -> tuple[list[int], list[str], object]:
    """The layers `parity MODEL` (`parity compare A B`) would check for this spec, notes about the choice, and the
    session (for a compare, the Comparison ``open_compare`` opened)."""
    if isinstance(spec, CompareSpec):
        if open_compare is None:
            raise UsageError(f"{spec.label}: a compare needs open_compare (engine.compare.comparison.open_comparison)")
        comparison = open_compare(spec)
        return comparison.layers(spec.layers), [], comparison
    session = open_session(spec)
    layers = spec.layers
    notes: list[str] = []
    if layers is None and session.checkpoint.weights == "synthetic":
        layers = session.synthetic_layers(notes)
    return parse_selection(layers, session.num_layers), notes, session


def plan(specs: list[CheckSpec | CompareSpec], shard: tuple[int, int] | None = None, raise_errors: bool = False,
         open_compare: CompareOpener | None = None) -> list[CheckRun]:
    runs = [CheckRun(spec) for spec in specs]
    units = []
    for index, run in enumerate(runs):
        try:
            layers, run.plan_notes, run.session = plan_layers(run.spec, open_compare)
        except ParityError as exc:
            if raise_errors:
                raise
            run.error = f"{run.spec.where + ': ' if run.spec.where else ''}{exc}"
            continue
        units.extend((index, layer) for layer in layers)
    for index, layer in shard_units(units, shard):
        runs[index].layers.append(layer)
    for run in runs:
        if not run.layers:
            run.session = None  # nothing of this check in this shard: do not hold its checkpoint open
    return runs


def execute(runs: list[CheckRun], on_layer: Callable[[CheckRun, Report, LayerResult], None] | None = None,
            raise_errors: bool = False, on_check: Callable[[CheckRun], None] | None = None) -> list[CheckRun]:
    """Run each planned check's layers (runs with none, or with a planning error, are skipped)."""

    for run in runs:
        if run.error is not None or not run.layers:
            continue
        spec = run.spec
        clock = [time.perf_counter()]

        def record(report: Report, result: LayerResult, run: CheckRun = run, clock: list[float] = clock) -> None:
            now = time.perf_counter()
            run.seconds.append(now - clock[0])
            clock[0] = now
            report.name = run.spec.name
            run.report = report
            if on_layer is not None:
                on_layer(run, report, result)

        try:
            if isinstance(spec, CompareSpec):
                report = run.session.run(run.layers, on_layer=record)  # a Comparison (open_compare's)
            else:
                report = run_session(run.session, run.layers, on_layer=record, experts=spec.experts,
                                     block=spec.block_choice)
            if getattr(spec, "logits", False):
                report.logits = logits_impact(run.session, sorted({r.layer for r in report.layers}))
        except ParityError as exc:
            if raise_errors:
                raise
            run.error = f"{spec.where + ': ' if spec.where else ''}{exc}"
        else:
            report.notes.extend(n for n in run.plan_notes if n not in report.notes)
            run.report = report
        finally:
            run.session = None  # release the resolved checkpoint once its check is done
        if on_check is not None:
            on_check(run)
    return runs


def exit_code(runs: list[CheckRun], regressions: int = 0) -> int:
    """2: a check could not run, a layer could not be verified, or nothing was checked at all;
    1: some layer deviates or regressed; 0: every checked layer matches (and at least one was checked)."""
    if any(run.error is not None for run in runs):
        return 2
    reports = [run.report for run in runs if run.report is not None]
    if not any(report.layers for report in reports) or any(report.unverifiable for report in reports):
        return 2
    if regressions or any(run.report is not None and not run.report.passed for run in runs):
        return 1
    return 0


def open_session(check: CheckSpec | str, /, **options: Any) -> Session:
    """Resolve a check (mapping, checkpoint, config) and open a session on it: the one place every front door
    (CLI, project files, ``parity.check``, ``assert_parity``) turns its options into a session.

    Args:
        check: a CheckSpec, or MODEL with the CheckSpec's fields as keyword options (``checkpoint``, ``mapping``,
            ``revision``, ``target``, ``seed``, ``atol``, ``allow_pickle``, ``require_real``, ``device``, ``dtype``).

    Returns:
        The Session (``run_session`` checks its layers).

    Raises:
        SyntheticWeightsError: ``require_real`` and only the synthetic stand-in is available (before anything is
            computed).  ParityError: bad input of any other kind; a missing GPU is said before anything is resolved.
    """
    spec = check if isinstance(check, CheckSpec) else CheckSpec(model=check, **options)
    torch_device(check_compute(spec.device, spec.dtype)[0])
    resolved = resolve(spec.model, spec.checkpoint, spec.mapping, spec.revision, spec.allow_pickle)
    if spec.require_real and resolved.checkpoint.weights != "real":
        why = (resolved.checkpoint.weights_note or "").removeprefix("SYNTHETIC weights: ").split(";")[0]
        error = SyntheticWeightsError(
            f"{spec.model}: real weights are required, but {why or 'only synthetic weights are available'}. Make it "
            "reachable (network, or an HF cache that holds it: HF_HOME) or pass --checkpoint PATH (checkpoint = "
            "\"...\" in a project file); to check the synthetic stand-in instead, drop --require-real "
            "(require_real = false in a project file)."
        )
        error.reason = why or "only synthetic weights are available"  # the cause alone, for front doors' own words
        raise error
    return Session(resolved, target=spec.target, seed=spec.seed, atol=spec.atol, device=spec.device,
                   dtype=spec.dtype)
