"""`assert_parity` for a project's own test suite: one line per checked module, and a
failure message a reader can act on (the per-layer table and the diagnosis).

Synthetic weights (the stand-in used when the default hub checkpoint is unreachable) prove nothing
about a real checkpoint, so a test that did not ask for them is **skipped** with the reason rather
than passed: a CI log shows ``s``, never a silent green.  ``require_real=False`` checks them anyway;
``require_real=True``, ``pytest --parity-require-real`` or ``PARITY_REQUIRE_REAL=1`` make them a failure.
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from parity.definitions.policy import synthetic_action
from parity.engine.results import Report
from parity.errors import ParityAssertionError, ParityError, SyntheticWeightsError
from parity.outputs.render import render
from parity.outputs.text import diagnosis_ids, not_checked_summary, summary_line, unit_label, units_label

REQUIRE_REAL_VARIABLE = "PARITY_REQUIRE_REAL"


class ParityWarning(UserWarning):
    """A check passed with a caveat a reader must see: mistakes its dtype or tolerance cannot tell apart."""


def assert_parity(model: str, *, target: str | Any | None = None, layers: str | int | Iterable[int] | None = None,
                  checkpoint: str | None = None, mapping: str | None = None, revision: str | None = None,
                  seed: int = 0, atol: float | None = None, require_real: bool | None = None,
                  allow_pickle: bool = False, experts: str | int | Iterable[int] | None = None,
                  logits: bool = False, device: str = "cpu", dtype: str = "float32",
                  block: bool | None = None) -> Report:
    """Check ``target`` against transformers and fail the test unless every checked layer matches.

    Args:
        model: a mapping name (``"gpt2"``), a hub id, a local folder or file, as ``parity MODEL``.
        target: a class, a factory, an ``nn.Module`` instance (not modified) or ``"pkg.module:Name"``.
        layers, checkpoint, mapping, revision, seed, atol, allow_pickle, experts, logits, device, dtype, block:
            as for ``parity.check`` (``block=True``: each MoE layer's whole sparse block is one unit).
        require_real: ``None`` (default) skips the test when only synthetic weights are available, unless
            ``pytest --parity-require-real`` or ``PARITY_REQUIRE_REAL=1`` make that a failure; ``True`` fails
            it; ``False`` checks the synthetic weights (a pass then proves the module's shapes and code path).

    Returns:
        The report (``print(report)`` shows its table).

    Raises:
        ParityAssertionError: an AssertionError whose first line names the model, the layers and the
            diagnosis id (pytest's short summary shows it), followed by the table; ``.report`` holds the
            report.  Raised for a deviation, a layer that could not be verified, or nothing checked.
        ParityError: a broken set-up (no such checkpoint, unimportable target), as the CLI's exit code 2;
            its traceback starts at the test's call, not inside parity.
        pytest's Skipped (``unittest.SkipTest`` outside pytest): only synthetic weights, and not required.

    Example::

        def test_ffn():
            assert_parity("gpt2", target="mymodel:MLP", layers=[0, 11])
    """
    __tracebackhide__ = True  # pytest shows the test's line and the message, not parity's frames
    from parity.api import check

    action = synthetic_action("pytest", True if required_real(require_real) else require_real)
    try:
        report = check(model, layers=layers, target=target, checkpoint=checkpoint, mapping=mapping,
                       revision=revision, seed=seed, atol=atol, allow_pickle=allow_pickle, experts=experts,
                       logits=logits, device=device, dtype=dtype, require_real=action != "check", block=block)
    except SyntheticWeightsError as exc:
        why = getattr(exc, "reason", str(exc))
        if action == "refuse":
            raise ParityAssertionError(f"parity: {short_model(model)}: real weights are required, but {why}; pass "
                                       "checkpoint=PATH or make the checkpoint reachable (network, HF_HOME)", None
                                       ) from None
        skip(f"parity: {short_model(model)}: synthetic weights only ({why}); they prove nothing about a real "
             "checkpoint. Pass checkpoint=PATH for real ones, or require_real=False to check the stand-in")
    except ParityError as exc:  # a set-up error: its message, from the test's line, without parity's frames
        raise exc.with_traceback(None) from None
    if not report.passed:
        error = ParityAssertionError(f"{failure_line(model, report)}\n\n{render(report)}", report)
        error.short = short_line(model, report)
        raise error
    caveat = not_checked_summary(report).strip()
    if caveat:
        warnings.warn(ParityWarning(f"parity: {short_model(model)} passed, with a caveat: {caveat}"), stacklevel=2)
    return report


def required_real(require_real: bool | None) -> bool:
    """Whether synthetic weights fail the test: asked for here, or by the plugin's option or the variable."""
    if require_real is not None:
        return require_real
    plugin = sys.modules.get("parity.pytest_plugin")  # loaded by pytest when it runs; never imported from here
    from_plugin = bool(plugin is not None and plugin.REQUIRE_REAL["on"])
    return from_plugin or os.environ.get(REQUIRE_REAL_VARIABLE, "").strip().lower() in ("1", "true", "yes", "on")


def skip(reason: str) -> None:
    """pytest.skip inside pytest (an ``s`` and the reason in ``-rs``); unittest.SkipTest elsewhere."""
    __tracebackhide__ = True
    try:
        import pytest
    except ImportError:
        import unittest

        raise unittest.SkipTest(reason) from None
    pytest.skip(reason)


def short_model(model: str) -> str:
    """The model as a first line shows it: a local path by its last component, never absolute."""
    text = str(model)
    return Path(text).name or text if os.sep in text or (os.altsep and os.altsep in text) else text


def short_line(model: str, report: Report) -> str:
    """What pytest's short summary shows (the plugin puts it there): the diagnosis id first, since the line is cut
    at the terminal's width, and the units in brackets: 'gelu_exact_instead_of_tanh at gpt2[3] (MISMATCH, 26x tol)'."""
    failed = [r for r in report.layers if not r.passed and r.unverifiable is None]
    if not failed:
        return failure_line(model, report).removeprefix("parity: ")
    ids = diagnosis_ids(failed).removeprefix(" — ")
    measured = [r.max_abs_diff / r.tolerance for r in failed if r.max_abs_diff is not None and r.tolerance]
    size = f", {max(measured):.3g}x tol" if measured else ""
    units = ",".join(unit_label(r) for r in failed[:6]) + (",..." if len(failed) > 6 else "")
    return f"{ids or 'MISMATCH'} at {short_model(model)}[{units}] (MISMATCH{size})"


def failure_line(model: str, report: Report) -> str:
    """The verdict in one line, shortest first (pytest's short summary cuts the line at the terminal's width):
    'parity: gpt2 layer 3: gelu_exact_instead_of_tanh — MISMATCH max|Δ| 9.0e-04 > tol 3.5e-05 [target]'."""
    name = short_model(model)
    failed = [r for r in report.layers if not r.passed and r.unverifiable is None]
    if not failed:
        return f"parity: {name}: {summary_line(report)} [{report.target}]"
    measured = [r for r in failed if r.max_abs_diff is not None and r.tolerance is not None]
    worst = max(measured, key=lambda r: r.max_abs_diff / r.tolerance if r.tolerance else math.inf, default=None)
    size = f" max|Δ| {worst.max_abs_diff:.1e} > tol {worst.tolerance:.1e}" if worst is not None else ""
    count = f" ({len(failed)} of {len(report.layers)})" if len(failed) > 1 else ""
    ids = diagnosis_ids(failed).removeprefix(" — ")
    return f"parity: {name} {units_label(failed)}{count}: {ids + ' — ' if ids else ''}MISMATCH{size} [{report.target}]"
