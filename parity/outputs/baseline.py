"""Stored deviations of an earlier run, so CI fails when a layer's deviation grows even
while it is still under tolerance (a quiet drift is how a wrong GELU creeps in).

The file is plain JSON, sorted and indented, one entry per model | checkpoint | target |
layer, so a reviewer reads a baseline change in a diff.  Updating merges: entries of
units not run this time (another shard, another check) are kept.

Keys follow the repository, not the folder it sits in: a local path is written relative
to the project file's folder (or the working directory), never absolute, so a CI runner's
fresh clone matches the committed baseline.  Each entry also stores the layer's weight
fingerprint: a baseline made from other weights is reported, never silently compared.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from parity.definitions.files import not_regular, short, shown
from parity.engine.results import LayerResult, Report
from parity.errors import BaselineError
from parity.outputs.atomic import write_output

BASELINE_VERSION = 2  # 2: portable keys, fingerprint and weights per entry; 1: neither
DEFAULT_FACTOR = 2.0
DEFAULT_SLACK = 1e-8  # absolute: growth from 1e-9 to 3e-9 is float noise, not a regression
SHOWN_KEYS = 3  # keys quoted in a message; the JSON report lists them all


class NotABaseline(ValueError):
    """What is wrong with a file's content; the caller adds what to do (which differs when updating)."""


@dataclass
class Regression:
    key: str
    report: Report
    layer: LayerResult
    message: str


@dataclass
class Comparison:
    """A run against a baseline: what regressed, and what could not be compared and why."""

    regressions: list[Regression] = field(default_factory=list)
    compared: int = 0
    other_weights: list[Regression] = field(default_factory=list)  # entry made from other weights: not compared
    not_compared: list[str] = field(default_factory=list)  # keys of this run's layers without an entry
    unfingerprinted: int = 0  # compared, but the entry has no fingerprint to confirm the weights (format 1)
    notes: list[str] = field(default_factory=list)  # said once each: "target was mymod:MLP, now mymod.ffn:MLP"

    @property
    def run_keys(self) -> int:
        return self.compared + len(self.other_weights) + len(self.not_compared)


# -- keys -------------------------------------------------------------------------------------------

def portable_path(location: str, roots: Sequence[Path]) -> str:
    """A local path as the repository names it: relative to the first of ``roots`` that holds it
    (forward slashes on every OS), else only its last component.  Never absolute: an absolute
    path differs on every CI runner, so no entry would ever match."""
    path = Path(location).expanduser().resolve()
    for root in roots:
        try:
            return path.relative_to(Path(root).resolve()).as_posix()
        except ValueError:
            continue
    return path.name


def source_key(text: str, roots: Sequence[Path]) -> str:
    """MODEL or checkpoint as a key part: an existing local path made portable; a mapping name
    or hub id (``id`` or ``id@revision`` as asked; the fingerprint notices weights that moved) as is."""
    return portable_path(text, roots) if Path(text).expanduser().exists() else text


def default_roots() -> tuple[Path, ...]:
    return (Path.cwd(),)


def checkpoint_key(report: Report, roots: Sequence[Path] | None = None) -> str:
    """A checkpoint name that is the same on every machine (no cache or clone folder in it)."""
    if report.weights == "synthetic":
        return "synthetic:" + Path(report.checkpoint).name
    return source_key(report.checkpoint, roots or default_roots())


def compared_sides(report: Report) -> dict | None:
    """A `parity compare A B` report's ``comparison`` (its two sides), or None for a check's report."""
    sides = getattr(report, "comparison", None)
    return sides if isinstance(sides, dict) and "reference" in sides else None


def compare_key(report: Report, layer: LayerResult, roots: Sequence[Path] | None = None) -> str:
    """A compare's layer: a named one (a project file's ``[[compares]]`` ``name``) by that name, so a new export
    path keeps its entries (the fingerprint of both sides still tells other weights); an unnamed one by A and B
    as located (local paths made portable, hub ids as ``id@revision``)."""
    roots = roots or default_roots()
    if report.name:
        head = f"compare {report.name}"
    else:
        head = f"compare {source_key(report.checkpoint, roots)} | {source_key(report.target, roots)}"
    return f"{head} | layer {layer.layer:04d}" + _key_tail(report, layer)


def entry_key(report: Report, layer: LayerResult, roots: Sequence[Path] | None = None) -> str:
    """The layer's key: a named check (a project file's ``name``) by that name and the model, so moving or
    renaming the target class keeps its entries; an unnamed one by model, checkpoint and target; a compare's by
    ``compare_key``."""
    if compared_sides(report) is not None:
        return compare_key(report, layer, roots)
    if not report.name:
        return legacy_key(report, layer, roots)
    roots = roots or default_roots()
    return f"check {report.name} | {source_key(report.model, roots)} | layer {layer.layer:04d}" + _key_tail(
        report, layer)


def legacy_key(report: Report, layer: LayerResult, roots: Sequence[Path] | None = None) -> str:
    """model | checkpoint | target | layer: the key of unnamed checks, and of named ones before they had names."""
    roots = roots or default_roots()
    return (f"{source_key(report.model, roots)} | {checkpoint_key(report, roots)} | {report.target} "
            f"| layer {layer.layer:04d}") + _key_tail(report, layer)


def _key_tail(report: Report, layer: LayerResult) -> str:
    tail = "" if layer.expert is None else f" | expert {layer.expert:04d}"
    tail += "" if layer.unit is None else f" | {layer.unit}"
    if getattr(report, "dtype", "float32") != "float32" or getattr(report, "device", "cpu") != "cpu":
        tail += f" | {report.dtype} on {report.device}"  # a bf16 run's deviations are not a float32 run's
    return tail


def _entry(report: Report, layer: LayerResult) -> dict:
    def short(value: float | None) -> float | None:  # None: no number (module not loadable, or NaN/inf output)
        return None if value is None or not math.isfinite(value) else float(f"{value:.4e}")

    # a compare's target is B's location, which differs between machines: its key and fingerprint name B
    target = None if compared_sides(report) is not None else report.target
    return {"passed": layer.passed, "max_abs_diff": short(layer.max_abs_diff), "tolerance": short(layer.tolerance),
            "noise_floor": short(layer.noise_floor), "fingerprint": layer.fingerprint,
            "weights": report.weights, "target": target}


# -- reading ----------------------------------------------------------------------------------------

def _read(path: Path) -> tuple[int, dict[str, dict]]:
    """(format version, entries) of a baseline file; NotABaseline says why it is not one.
    FileNotFoundError and OSError pass through: the callers word them (reading vs. updating)."""
    kind = not_regular(path) if path.exists() and not path.is_dir() else None
    if kind is not None:  # a FIFO or device would block the read forever
        raise BaselineError(f"{shown(path)}: {kind}; --baseline takes a JSON file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise NotABaseline(f"not valid JSON ({exc})") from None
    except RecursionError:
        raise NotABaseline("JSON nested too deeply to read") from None
    if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
        raise NotABaseline('expected {"parity_baseline": N, "entries": {key: {"max_abs_diff": ...}}}')
    version = data.get("parity_baseline", 1)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise NotABaseline(f"'parity_baseline' is {version!r}, not a format number")
    if version > BASELINE_VERSION:  # a baseline, just not ours to read (nor to overwrite)
        raise BaselineError(f"{path}: baseline format {version} was written by a newer parity (this one reads "
                            f"1-{BASELINE_VERSION}); upgrade parity (a newer checkout) to use it")
    for key, entry in data["entries"].items():
        _check_entry(key, entry)
    return version, data["entries"]


def _check_entry(key: str, entry: object) -> None:
    """Every field compare() reads must be there and of its type: a hand-edited entry must not crash a run."""
    def number(value: object) -> bool:
        return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)
                                 and math.isfinite(value))

    if not isinstance(entry, dict):
        raise NotABaseline(f"entry '{shown(key, 200)}' is {type(entry).__name__}, not an object")
    if "max_abs_diff" not in entry:
        raise NotABaseline(f"entry '{shown(key, 200)}' has no 'max_abs_diff'")
    if not number(entry["max_abs_diff"]) or (entry["max_abs_diff"] or 0) < 0:
        raise NotABaseline(f"entry '{shown(key, 200)}': 'max_abs_diff' is {short(entry['max_abs_diff'])}, not a "
                           "finite number or null (nor negative)")
    if not isinstance(entry.get("passed", True), bool):
        raise NotABaseline(f"entry '{shown(key, 200)}': 'passed' is {short(entry['passed'])}, not true or false")
    if not isinstance(entry.get("target", ""), (str, type(None))):
        raise NotABaseline(f"entry '{shown(key, 200)}': 'target' is {short(entry['target'])}, not a string or null")
    if not isinstance(entry.get("fingerprint", ""), (str, type(None))):
        raise NotABaseline(f"entry '{shown(key, 200)}': 'fingerprint' is {short(entry['fingerprint'])}, not a string "
                           "or null")


def load_baseline(path: str | Path) -> dict[str, dict]:
    """The entries to compare with; every problem is a BaselineError saying what to do."""
    path = Path(path)
    try:
        return _read(path)[1]
    except FileNotFoundError:
        raise BaselineError(f"{path}: baseline file not found; create it with --update-baseline") from None
    except IsADirectoryError:
        raise BaselineError(f"{path}: is a folder, not a baseline file; pass the file's path") from None
    except OSError as exc:
        raise BaselineError(f"{path}: cannot read the baseline ({exc.strerror or exc})") from None
    except NotABaseline as exc:
        raise BaselineError(f"{path}: not a parity baseline: {exc}. If it is a damaged baseline, delete it and "
                            "create a new one with --update-baseline") from None


def load_for_update(path: str | Path) -> tuple[int, dict[str, dict]]:
    """(format version, entries) to merge into; (current version, {}) when the file does not exist yet.

    A file that exists but is not a baseline is never overwritten: --baseline may point at the
    wrong file (a typo, a package.json), and that file is not ours to replace."""
    path = Path(path)
    try:
        return _read(path)
    except FileNotFoundError:
        return BASELINE_VERSION, {}
    except OSError as exc:
        raise BaselineError(f"{path}: cannot read the existing baseline to merge into "
                            f"({exc.strerror or exc})") from None
    except NotABaseline as exc:
        raise BaselineError(f"{path}: exists but is not a parity baseline ({exc}); --update-baseline will not "
                            "overwrite it. Delete or move it if it is a damaged baseline, "
                            "or pass another file") from None


# -- comparing --------------------------------------------------------------------------------------

class BaselineJudge:
    """Judges each layer against its stored entry as the layer finishes, so every view of the run (the table
    row, the check's summary and status, JSON, JUnit, HTML) carries the baseline's verdict, not only the
    suite's last line.  The finding is stored on the layer (``LayerResult.baseline``)."""

    def __init__(self, entries: dict[str, dict], factor: float = DEFAULT_FACTOR, slack: float = DEFAULT_SLACK,
                 roots: Sequence[Path] | None = None):
        self.entries, self.factor, self.slack, self.roots = entries, factor, slack, roots
        self.comparison = Comparison()

    def layer(self, report: Report, layer: LayerResult) -> None:
        result = self.comparison
        key = entry_key(report, layer, self.roots)
        old = self.entries.get(key)
        if old is None and report.name and compared_sides(report) is None:  # named before checks had names
            old = self.entries.get(legacy_key(report, layer, self.roots))
        if old is None:
            result.not_compared.append(key)
            layer.baseline = {"key": key, "status": "not_compared", "max_abs_diff": None, "passed": None,
                              "target": None, "message": "no entry in the baseline"}
            return
        found = {"key": key, "max_abs_diff": old["max_abs_diff"], "passed": old.get("passed", True),
                 "target": old.get("target")}
        moved = old.get("target")
        if isinstance(moved, str) and moved != report.target:
            note = f"target was {moved}, now {report.target}"
            if note not in result.notes:
                result.notes.append(note)
        stored = old.get("fingerprint")
        if stored is not None and layer.fingerprint is not None and scheme(stored) != scheme(layer.fingerprint):
            stored = None  # written by an older parity with another hash: compared, said as unfingerprinted
        if stored is not None and layer.fingerprint is not None and stored != layer.fingerprint:
            message = (f"baseline entry made from other weights (fingerprint {stored}, now {layer.fingerprint}): "
                       "not compared")
            result.other_weights.append(Regression(key, report, layer, message))
            layer.baseline = {**found, "status": "other_weights", "message": message}
            return
        result.compared += 1
        result.unfingerprinted += stored is None and layer.fingerprint is not None
        message = _regression(old, layer, self.factor, self.slack)
        if message is not None:
            result.regressions.append(Regression(key, report, layer, message))
        layer.baseline = {**found, "status": "ok" if message is None else "regressed", "message": message}


def compare_baseline(reports: Iterable[Report], entries: dict[str, dict], factor: float = DEFAULT_FACTOR,
                     slack: float = DEFAULT_SLACK, roots: Sequence[Path] | None = None) -> Comparison:
    """Each layer of the run against its entry: regressed, made from other weights, or without an entry
    (each layer's ``baseline`` is set as the judge sets it)."""
    judge = BaselineJudge(entries, factor, slack, roots)
    for report in reports:
        for layer in report.layers:
            judge.layer(report, layer)
    return judge.comparison


def scheme(fingerprint: str) -> str:
    """'crc32:' for today's fingerprints, '' for the older blake2b ones."""
    return fingerprint.partition(":")[0] if ":" in fingerprint else ""


def _regression(old: dict, layer: LayerResult, factor: float, slack: float) -> str | None:
    """Why this layer regressed against its entry, or None."""
    if old.get("passed", True) and not layer.passed:
        now = "cannot be loaded" if layer.max_abs_diff is None else f"{layer.max_abs_diff:.2e}"
        return f"passed in the baseline, fails now (max|Δ| {old['max_abs_diff']} -> {now})"
    if old["max_abs_diff"] is None or layer.max_abs_diff is None:
        return None  # no numbers to compare: the verdicts above said what matters
    before = float(old["max_abs_diff"])
    if layer.max_abs_diff <= factor * before + slack:
        return None
    grown = layer.max_abs_diff / before if before else float("inf")
    return f"max|Δ| grew {before:.2e} -> {layer.max_abs_diff:.2e} ({grown:.4g}x; allowed {factor:g}x + {slack:g})"


def compare(reports: Iterable[Report], entries: dict[str, dict], factor: float = DEFAULT_FACTOR,
            slack: float = DEFAULT_SLACK, roots: Sequence[Path] | None = None) -> tuple[list[Regression], int]:
    """Layers that regressed, and how many layers had an entry to compare with (see compare_baseline)."""
    result = compare_baseline(reports, entries, factor, slack, roots)
    return result.regressions, result.compared


def problem_message(path: str | Path, result: Comparison, entries: dict[str, dict]) -> str | None:
    """Why this comparison cannot be trusted (exit 2), or None: the baseline matches none of the
    run's layers, or some of its entries were made from other weights."""
    if result.run_keys and not result.compared and not result.other_weights:
        keys = sorted(entries)
        held = (f"the file holds {len(keys)} entr{'y' if len(keys) == 1 else 'ies'}: {_quoted(keys)}" if keys
                else "the file holds no entries")
        return (f"baseline {path} matches none of this run's {result.run_keys} layer(s): this run's keys are "
                f"{_quoted(result.not_compared)}; {held}. The baseline was made for other checks, paths or "
                "targets: regenerate it with --update-baseline")
    if result.other_weights:
        return (f"baseline {path} does not describe these weights: {len(result.other_weights)} entr"
                f"{'y was' if len(result.other_weights) == 1 else 'ies were'} made from other weights "
                f"({_quoted([r.key for r in result.other_weights])}); regenerate it with --update-baseline")
    return None


def note_lines(path: str | Path, result: Comparison) -> list[str]:
    """What the comparison left out, for the log: layers without an entry, entries without a fingerprint."""
    lines = list(result.notes)
    if result.not_compared and len(result.not_compared) < result.run_keys:
        lines.append(f"{len(result.not_compared)} layer(s) not compared (no entry in {path}): "
                     f"{_quoted(result.not_compared)}")
    if result.unfingerprinted:
        lines.append(f"{result.unfingerprinted} entr{'y has' if result.unfingerprinted == 1 else 'ies have'} no weight "
                     "fingerprint (a format-1 baseline, or a layer that could not be loaded when it was made): "
                     "compared without confirming they describe these weights; "
                     "regenerate with --update-baseline to add them")
    return lines


def _quoted(keys: Sequence[str]) -> str:
    listed = ", ".join(f"'{shown(key, 200)}'" for key in keys[:SHOWN_KEYS])  # a key is capped: a message, not a dump
    return listed + (f" and {len(keys) - SHOWN_KEYS} more" if len(keys) > SHOWN_KEYS else "")


# -- writing ----------------------------------------------------------------------------------------

def write_baseline(path: str | Path, reports: Iterable[Report], roots: Sequence[Path] | None = None) -> tuple[int, int]:
    """Merge this run's layers into the file (creating it, atomically); returns (entries written,
    format-1 entries dropped).  Format-1 entries are dropped, not kept: their keys may hold
    absolute paths and they have no fingerprint, so they would never be trusted again."""
    path = Path(path)
    version, entries = load_for_update(path)
    dropped = 0
    if version < BASELINE_VERSION:
        dropped, entries = len(entries), {}
    written = 0
    for report in reports:
        for layer in report.layers:
            if report.name and compared_sides(report) is None:  # replaces the entry stored before it had a name
                entries.pop(legacy_key(report, layer, roots), None)
            entries[entry_key(report, layer, roots)] = _entry(report, layer)
            written += 1
    data = {"parity_baseline": BASELINE_VERSION, "entries": dict(sorted(entries.items()))}
    write_output(path, json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n", "baseline")
    return written, dropped
