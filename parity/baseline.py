"""Stored deviations of an earlier run, so CI fails when a layer's deviation grows even
while it is still under tolerance (a quiet drift is how a wrong GELU creeps in).

The file is plain JSON, sorted and indented, one entry per model | checkpoint | target |
layer, so a reviewer reads a baseline change in a diff.  Updating merges: entries of
units not run this time (another shard, another check) are kept.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from .errors import ParityError
from .report import LayerResult, Report

BASELINE_VERSION = 1
DEFAULT_FACTOR = 2.0
DEFAULT_SLACK = 1e-8  # absolute: growth from 1e-9 to 3e-9 is float noise, not a regression


class BaselineError(ParityError):
    """The baseline file cannot be read or is not a parity baseline."""


@dataclass
class Regression:
    key: str
    report: Report
    layer: LayerResult
    message: str


def checkpoint_key(report: Report) -> str:
    """A checkpoint name that is the same on every machine (no cache or clone folder in it)."""
    location = report.checkpoint
    if report.weights == "synthetic":
        return "synthetic:" + Path(location).name
    path = Path(location)
    if path.is_absolute():
        try:
            return str(path.relative_to(Path.cwd()))
        except ValueError:
            return location
    return location


def entry_key(report: Report, layer: LayerResult) -> str:
    key = f"{report.model} | {checkpoint_key(report)} | {report.target} | layer {layer.layer:04d}"
    if layer.expert is not None:
        key += f" | expert {layer.expert:04d}"
    return key


def _entry(layer: LayerResult) -> dict:
    def short(value: float | None) -> float | None:  # None: the module could not even be loaded
        return None if value is None else float(f"{value:.4e}")

    return {"passed": layer.passed, "max_abs_diff": short(layer.max_abs_diff), "tolerance": short(layer.tolerance),
            "noise_floor": short(layer.noise_floor)}


def load_baseline(path: str | Path) -> dict[str, dict]:
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BaselineError(f"{path}: baseline file not found; create it with --update-baseline") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BaselineError(f"{path}: not a readable JSON baseline ({exc}); regenerate it with --update-baseline") from None
    entries = data.get("entries") if isinstance(data, dict) else None
    if not isinstance(entries, dict) or not all(
            isinstance(v, dict) and (v.get("max_abs_diff") is None or isinstance(v.get("max_abs_diff"), (int, float)))
            for v in entries.values()):
        raise BaselineError(f"{path}: not a parity baseline (expected {{\"entries\": {{key: {{\"max_abs_diff\": ...}}}}}}); "
                            "regenerate it with --update-baseline")
    return entries


def compare(reports: Iterable[Report], entries: dict[str, dict], factor: float = DEFAULT_FACTOR,
            slack: float = DEFAULT_SLACK) -> tuple[list[Regression], int]:
    """Layers that regressed against the baseline, and how many layers had an entry to compare with."""
    regressions, compared = [], 0
    for report in reports:
        for layer in report.layers:
            key = entry_key(report, layer)
            old = entries.get(key)
            if old is None:
                continue
            compared += 1
            if old.get("passed", True) and not layer.passed:
                now = "cannot be loaded" if layer.max_abs_diff is None else f"{layer.max_abs_diff:.2e}"
                regressions.append(Regression(key, report, layer, f"passed in the baseline, fails now "
                                              f"(max|Δ| {old['max_abs_diff']} -> {now})"))
                continue
            if old["max_abs_diff"] is None or layer.max_abs_diff is None:
                continue  # no numbers to compare: the verdicts above said what matters
            before = float(old["max_abs_diff"])
            allowed = factor * before + slack
            if layer.max_abs_diff > allowed:
                grown = layer.max_abs_diff / before if before else float("inf")
                regressions.append(Regression(key, report, layer, f"max|Δ| grew {before:.2e} -> {layer.max_abs_diff:.2e} "
                                              f"({grown:.1f}x; allowed {factor:g}x + {slack:g})"))
    return regressions, compared


def write_baseline(path: str | Path, reports: Iterable[Report]) -> int:
    """Merge this run's layers into the file (creating it); returns the number of entries written."""
    path = Path(path)
    entries = load_baseline(path) if path.is_file() else {}
    written = 0
    for report in reports:
        for layer in report.layers:
            entries[entry_key(report, layer)] = _entry(layer)
            written += 1
    data = {"parity_baseline": BASELINE_VERSION, "entries": dict(sorted(entries.items()))}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    except OSError as exc:
        raise BaselineError(f"{path}: cannot write the baseline: {exc.strerror or exc}") from None
    return written
