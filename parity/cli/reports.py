"""What a run leaves behind: the summary line, --json, --junit, --html, --save-mapping and the baseline file.

Every output is written for every run that got as far as parsing its arguments, exit 2 included (the JUnit
file then holds an <error> case, the JSON the error document), into exactly the path named
(``parity.outputs.atomic``); a report that could not be written is exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field

from parity.definitions.files import one_line
from parity.errors import DestinationError, ParityError, UsageError

EXIT_PASS, EXIT_MISMATCH, EXIT_BAD_INPUT = 0, 1, 2  # every layer matches | some deviates | bad input


@dataclass
class FailedRun:
    """A run that ended in a ParityError before it had a report: what --junit, --json and --html then hold."""

    label: str
    error: str
    report: None = None
    seconds: list = field(default_factory=list)
    spec: None = None


def with_error_outputs(args: argparse.Namespace, label: str, single: bool, run) -> int:
    """``run()``; when it raises a ParityError (exit 2), --json, --junit and --html still get written, holding the
    error: a CI upload step must find a file, and never the previous run's green one."""
    try:
        return run()
    except (DestinationError, OutputsNotWritten):  # the outputs themselves are the problem: none is rewritten
        raise
    except ParityError as exc:
        failed = FailedRun(label, " ".join(str(getattr(exc, "headline", None) or exc).split()))
        for write in (_error_junit, _error_html, _error_json):
            try:
                write(args, failed, single)
            except ParityError as also:  # this output cannot be written either: say so, the error stays the cause
                if str(also) not in str(exc):
                    print(f"parity: error: {one_line(str(also))}", file=sys.stderr)
        raise


def _error_junit(args: argparse.Namespace, failed: FailedRun, single: bool) -> None:
    if getattr(args, "junit", None):
        from parity.outputs.junit import write_junit

        write_junit(args.junit, [failed])


def _error_html(args: argparse.Namespace, failed: FailedRun, single: bool) -> None:
    if getattr(args, "html", None):
        from parity.outputs.html import write_html

        write_html(args.html, [failed], f"ERROR: {failed.error}", EXIT_BAD_INPUT)


def _error_json(args: argparse.Namespace, failed: FailedRun, single: bool) -> None:
    if not getattr(args, "json", None):
        return
    from parity.engine.results import SCHEMA_VERSION

    document = {"schema_version": SCHEMA_VERSION, "kind": "error", "passed": False, "status": "error",
                "model": getattr(args, "model", None) if single else None, "command": "check" if not single else None,
                "error": failed.error, "exit_code": EXIT_BAD_INPUT}
    _write_json(args.json, json.dumps(document, indent=2))


def _write_json(path: str, text: str) -> None:
    if path == "-":
        print(text)
        return
    from parity.outputs.atomic import write_output

    write_output(path, text + "\n", "--json", create_folder=False)


def summary(runs, args: argparse.Namespace, single: bool, shard, code: int, regressions: list, compared: bool) -> str:
    from parity.outputs import compare_text
    from parity.outputs.baseline import compared_sides
    from parity.outputs.text import suite_summary, summary_line

    if not single:
        return suite_summary(runs, code, len(regressions) if compared else None, shard)
    report = runs[0].report  # a regression is the report's own verdict (LayerResult.baseline)
    return compare_text.summary_line(report) if compared_sides(report) is not None else summary_line(report)


def key_roots(args: argparse.Namespace) -> tuple:
    """Folders a local path in a baseline key is relative to: the project file's (`parity check`),
    then the working directory; never an absolute path, which differs on every CI runner."""
    from pathlib import Path

    root = getattr(args, "key_root", None)
    return tuple(dict.fromkeys(p.resolve() for p in ([Path(root)] if root is not None else []) + [Path.cwd()]))


def update_baseline(args: argparse.Namespace, reports, out) -> None:
    from parity.outputs.baseline import BASELINE_VERSION, write_baseline

    if not any(report.layers for report in reports):  # an empty file would then read as 'matches nothing'
        print(f"baseline: not written: no layer was checked in this run, so there is nothing to record in "
              f"{args.baseline}", file=out)
        return
    written, dropped = write_baseline(args.baseline, reports, key_roots(args))
    print(f"baseline: wrote {written} layer entr{'y' if written == 1 else 'ies'} to {args.baseline}", file=out)
    if dropped:
        print(f"baseline: dropped {dropped} entr{'y' if dropped == 1 else 'ies'} of the old format (no weight "
              f"fingerprint, keys that may hold absolute paths); the file is now format {BASELINE_VERSION}", file=out)


def write_outputs(args: argparse.Namespace, runs, single: bool, shard, comparison, problem: str | None,
                  code: int) -> None:
    """--junit, --html, --save-mapping and --json, each written into the path named (parity.outputs.atomic).
    Every one is attempted: one that cannot be written (a full disk) leaves the others holding the run's real
    results, and the run ends in one OutputsNotWritten naming each that failed (exit 2)."""
    regressions = comparison.regressions if comparison is not None else []
    failed: list[str] = []

    def attempt(write) -> None:
        try:
            write()
        except ParityError as exc:
            failed.append(str(exc))

    if args.junit:
        from parity.outputs.junit import write_junit

        attempt(lambda: write_junit(
            args.junit, runs, {id(r.layer): r.message for r in regressions},
            {id(r.layer): r.message for r in (comparison.other_weights if comparison is not None else [])}, problem))
    if getattr(args, "html", None):
        from parity.outputs.html import write_html

        line = summary(runs, args, single, shard, code, regressions, comparison is not None)
        if comparison is not None and comparison.notes:  # "target was mymod:MLP, now mymod.ffn:MLP": on the page too
            line += " Baseline: " + "; ".join(comparison.notes) + "."
        attempt(lambda: write_html(args.html, runs, line, code, problem))
    if single and getattr(args, "save_mapping", None):
        attempt(lambda: save_mapping(args.save_mapping, runs[0].report, force=args.force))
    if args.json:
        document = json.dumps(json_document(runs, single, shard, args, comparison, problem, code), indent=2)
        attempt(lambda: _write_json(args.json, document))
    if failed:
        raise OutputsNotWritten("; ".join(failed))


class OutputsNotWritten(ParityError):
    """Some report could not be written after the run: the others hold its real results (not an error page)."""


def save_mapping(path: str, report, *, force: bool = False) -> None:
    """--save-mapping: the routes this run used, as a mapping file that repeats the run with --mapping FILE.
    Replaces only a file that --save-mapping wrote (or any with ``force``); never the mapping the run was given
    (the saved file extends it, and would then extend itself): parity.outputs.destinations refuses that first."""
    from parity.definitions.toml_text import mapping_text, sealed
    from parity.outputs.atomic import write_output

    refuse_to_replace(path, force)
    if report is not None and report.framework == "onnx":
        raise UsageError(f"--save-mapping {path}: an ONNX graph holds its own weights and is not filled, so there are "
                         "no routes to write; nothing written")
    if report is None or not report.routes:
        raise UsageError(f"--save-mapping {path}: no layer was built, so no routes were used; nothing written")
    routes = report.routes
    if routes["extends"].startswith("derived from "):  # no file to extend: the derived layout, written in full
        write_output(path, sealed(derived_layout_text(path, report)), "--save-mapping", create_folder=False)
        return
    how = "read off the target's parameter names" if routes["inferred"] else "of the mapping it extends"
    header = (f"Written by `parity {report.model} --save-mapping`: target {report.target}, routes {how}.\n"
              f"The same run: parity {report.model} --mapping {path}")
    if routes["args"] is None:
        header += "\nThe run checked a module instance: set [target].args to build its class as it was built."
    if "<" in report.target:
        header += f"\n{report.target} cannot be imported by name: put the factory in a module (module:function)."
    text = mapping_text(routes["extends"], report.target, routes["args"], routes["tensors"], header=header)
    write_output(path, sealed(text), "--save-mapping", create_folder=False)


def derived_layout_text(path: str, report) -> str:
    """--save-mapping of a run whose layout was derived from transformers: that layout as a mapping file of its
    own, with the target and routes the run used; a layout the mapping format cannot express is exit 2, naming
    the part, and nothing is written."""
    from parity.definitions.layout_text import layout_text, unsaid_part

    routes, layout = report.routes, report.layout
    unsaid = unsaid_part(layout) if layout is not None else "the run kept no derived layout"
    if unsaid is not None:
        raise UsageError(f"--save-mapping {path}: this run's layout was derived from transformers (no mapping file), "
                         f"and a mapping file cannot express part of it: {unsaid}; nothing written. The routes it "
                         "used are the report's `routes` (--json)")
    how = "read off the target's parameter names" if routes["inferred"] else "of the derived layout"
    header = (f"Written by `parity {report.model} --save-mapping`: target {report.target}, routes {how}, layout "
              f"{layout.name}.\nThe same run: parity {report.model} --mapping {path}")
    if routes["args"] is None:
        header += "\nThe run checked a module instance: set [target].args to build its class as it was built."
    return layout_text(layout, report.target, routes["args"], routes["tensors"], header=header)


def save_template(path: str, template: str, *, force: bool = False) -> None:
    """--save-mapping when the routes could not be inferred: the mapping to edit (its "?" still to fill in), written
    so the user edits a file; the run still exits 2."""
    from parity.definitions.toml_text import SAVED_MAPPING_MARK, sealed
    from parity.outputs.atomic import write_output

    refuse_to_replace(path, force)
    header = (f"{SAVED_MAPPING_MARK.removeprefix('# ')}--save-mapping`: a mapping to complete. Replace each \"?\" with "
              "what its comment proposes, then run with --mapping this file.\n")
    write_output(path, sealed(f"# {header}{template}"), "--save-mapping", create_folder=False)
    print(f"parity: wrote the mapping to complete to {path}", file=sys.stderr)


SAVED_LIMIT = 1 << 20  # a mapping --save-mapping wrote is a few KiB; a larger file is not one


def refuse_to_replace(path: str, force: bool) -> None:
    """A file exists at ``path``: replaced only when --save-mapping wrote it and nobody has edited it since (its
    seal matches), or with ``force``.  A mapping the user completed in place is theirs."""
    from pathlib import Path

    from parity.definitions.files import shown
    from parity.definitions.toml_text import SAVED_MAPPING_MARK, untouched_since_saved

    target = Path(path)  # never the run's --mapping file: parity.outputs.destinations refused that before the run
    if force or not target.is_file():
        return
    try:
        with open(target, encoding="utf-8", errors="replace") as handle:
            text = handle.read(SAVED_LIMIT + 1)
    except OSError:
        text = ""
    if untouched_since_saved(text):
        return
    how = ("was written by --save-mapping and has been edited since (its lines no longer match the sha256 on its "
           "first line)" if text.startswith(SAVED_MAPPING_MARK) else "was not written by --save-mapping")
    raise UsageError(f"--save-mapping {shown(path)}: the file exists and {how}; parity will not replace it. Choose "
                     "another file, or add --force to replace it")


def json_document(runs, single: bool, shard, args, comparison, problem: str | None, code: int) -> dict:
    """Single check: the report (schema_version 1, unchanged).  `parity check`: a suite of reports."""
    from parity.engine.results import SCHEMA_VERSION

    baseline = None
    if comparison is not None:
        def listed(items):
            return [{"key": r.key, "layer": r.layer.layer, "message": r.message} for r in items]

        baseline = {"file": str(args.baseline), "compared": comparison.compared,
                    "regressions": listed(comparison.regressions), "other_weights": listed(comparison.other_weights),
                    "not_compared": comparison.not_compared, "unfingerprinted": comparison.unfingerprinted,
                    "notes": comparison.notes, "error": problem}
    if single:
        data = runs[0].report.to_dict()
        if baseline is not None:
            data["baseline"] = baseline
        return data
    return {
        "schema_version": SCHEMA_VERSION, "kind": "suite", "passed": code == 0,
        "shard": list(shard) if shard else None,
        "checks": [{"name": run.label, "kind": getattr(run.spec, "kind", "check"), "where": run.spec.where,
                    "error": run.error,
                    "report": run.report.to_dict() if run.report is not None else None} for run in runs],
        "baseline": baseline,
    }
