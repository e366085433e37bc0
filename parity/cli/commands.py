"""What each command does: plan and run checks, then print, compare with the baseline and
write the CI files.  Heavy imports (torch, transformers) happen inside, when a check runs."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field

from parity.errors import MappingError, ParityError, UsageError

EXIT_PASS, EXIT_MISMATCH, EXIT_BAD_INPUT = 0, 1, 2


def run_inspect(args: argparse.Namespace) -> int:
    from parity.engine.inspect import inspect_model, inspection_json, render_inspection

    info = inspect_model(args.model, checkpoint=args.checkpoint, mapping=args.mapping, revision=args.revision,
                         target=args.target, layer=args.layer, allow_pickle=args.allow_pickle)
    # a target a check could not build or fill: the check would exit 2, and so does its inspection
    code = EXIT_BAD_INPUT if info["target_error"] is not None else EXIT_PASS
    if args.json == "-":
        print(inspection_json(info))
    else:
        print(render_inspection(info))
    if args.json and args.json != "-":
        from parity.outputs.atomic import write_output

        write_output(args.json, inspection_json(info) + "\n", "--json", create_folder=False)
    if code != EXIT_PASS:
        what = one_line(info["target_error"]).split(":", 1)[0]  # "cannot be built" / "cannot be filled"
        where = "in the JSON's target_error" if args.json == "-" else "above, after '!! target'"
        print(f"parity: error: target {info['target']} {what}: the reason is {where}", file=sys.stderr)
    return code


def run_project(args: argparse.Namespace) -> int:
    return with_error_outputs(args, "parity check", False, lambda: _run_project(args))


def _run_project(args: argparse.Namespace) -> int:
    from parity.spec.project import load_project, parse_shard, select_checks

    project = load_project(args.config)
    if args.select is not None:
        project.checks = select_checks(project.checks, args.select)
    shard = parse_shard(args.shard) if args.shard else None  # validated before any model is resolved
    for folder in (str(project.path.parent.resolve()), os.getcwd()):
        if folder not in sys.path:
            sys.path.insert(0, folder)  # targets of the project being checked
    for key in ("baseline", "junit", "html", "baseline_factor", "baseline_slack"):
        if getattr(args, key) is None:
            setattr(args, key, getattr(project, key))
    args.key_root = project.path.parent  # baseline keys name local paths relative to the project
    return run_specs(project.checks, args, single=False, shard=shard)


def one_line(text: str) -> str:
    """A message as exactly one line: a newline (or another control character) in a path is shown escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


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


def run_specs(specs, args: argparse.Namespace, single: bool, shard=None) -> int:
    """Plan, run and report checks: tables, progress, baseline, JUnit, JSON; returns the exit code."""
    from parity.engine.suite import exit_code
    from parity.outputs.baseline import load_baseline, load_for_update

    if args.update_baseline and not args.baseline:
        raise UsageError("--update-baseline needs --baseline FILE (or 'baseline' in the project file)")
    entries = load_baseline(args.baseline) if args.baseline and not args.update_baseline else None
    if args.update_baseline:
        load_for_update(args.baseline)  # refuse a file that is not a baseline before computing anything
    out = sys.stderr if args.json == "-" else sys.stdout  # stdout is the JSON's
    judge = baseline_judge(entries, args) if entries is not None else None
    runs = run_with_progress(specs, args, single, shard, out, judge)
    reports = [run.report for run in runs if run.report is not None]
    comparison = judge.comparison if judge is not None else None
    regressions = comparison.regressions if comparison is not None else []
    for run in runs:
        if run.error is not None:
            print(f"parity: error: {one_line(run.error)}", file=sys.stderr)
    for line in baseline_lines(args.baseline, comparison):
        print(line, file=out)
    code = exit_code(runs, len(regressions))
    problem = baseline_problem(args.baseline, comparison, entries)
    if problem is not None:
        code = max(code, EXIT_BAD_INPUT)  # a baseline that does not describe this run proves nothing
    print(summary(runs, args, single, shard, code, regressions, entries is not None), file=out)
    if args.update_baseline:
        update_baseline(args, reports, out)
    elif comparison is not None and not args.quiet:
        print(f"baseline: {comparison.compared} layer(s) compared with {args.baseline}, {len(regressions)} regressed",
              file=out)
    if problem is not None:
        print(f"parity: error: {problem}", file=sys.stderr)
    write_outputs(args, runs, single, shard, comparison, problem, code)
    return code


def run_with_progress(specs, args: argparse.Namespace, single: bool, shard, out, judge=None) -> list:
    """Plan and execute the checks, streaming each table (unless --quiet) under a progress bar; ``judge``
    (a BaselineJudge) marks each layer against the baseline before its row is printed."""
    from parity.engine.suite import execute, plan
    from parity.outputs.progress import Progress, bar_wanted, silence_downloads
    from parity.outputs.text import TextWriter

    json_stdout = args.json == "-"
    if args.quiet or json_stdout:  # download bars would interleave with the table / JSON consumers' stderr
        silence_downloads()
    if not bar_wanted(False, False):  # stderr is no terminal (a CI log): no library's bars either
        silence_foreign_bars()
    runs = plan(specs, shard, raise_errors=single)
    progress = Progress(sum(len(run.layers) for run in runs), bar_wanted(args.quiet, json_stdout))
    writer = TextWriter(lambda text: None if args.quiet else progress.say(text, out))

    def on_layer(run, report, result) -> None:
        if judge is not None:
            judge.layer(report, result)
        writer.layer(report, result)
        progress.step(f"{run.label} layer {result.layer}")

    def on_check(run) -> None:
        if run.report is not None:
            writer.finish(run.report, summary=not single)  # a single check's summary comes last, with the baseline's

    try:
        execute(runs, on_layer, raise_errors=single, on_check=on_check)
    finally:
        progress.close()
    return runs


def silence_foreign_bars() -> None:
    """huggingface_hub's download bars and transformers' own ("Loading weights", under --logits) write
    carriage returns into CI logs: only a terminal gets them."""
    from transformers.utils import logging as hf_logging

    from parity.outputs.progress import silence_downloads

    silence_downloads()
    hf_logging.disable_progress_bar()


def summary(runs, args: argparse.Namespace, single: bool, shard, code: int, regressions: list, compared: bool) -> str:
    from parity.outputs.text import suite_summary, summary_line

    if not single:
        return suite_summary(runs, code, len(regressions) if compared else None, shard)
    return summary_line(runs[0].report)  # a regression is the report's own verdict (LayerResult.baseline)


def key_roots(args: argparse.Namespace) -> tuple:
    """Folders a local path in a baseline key is relative to: the project file's (`parity check`),
    then the working directory; never an absolute path, which differs on every CI runner."""
    from pathlib import Path

    root = getattr(args, "key_root", None)
    return tuple(dict.fromkeys(p.resolve() for p in ([Path(root)] if root is not None else []) + [Path.cwd()]))


def baseline_judge(entries: dict, args: argparse.Namespace):
    from parity.outputs.baseline import DEFAULT_FACTOR, DEFAULT_SLACK, BaselineJudge

    factor = args.baseline_factor if args.baseline_factor is not None else DEFAULT_FACTOR
    slack = args.baseline_slack if args.baseline_slack is not None else DEFAULT_SLACK
    return BaselineJudge(entries, factor, slack, key_roots(args))


def baseline_lines(path, comparison) -> list[str]:
    """Regressions, entries made from other weights, and what was left out: printed even with
    --quiet, since each says the baseline result is not what the exit code alone suggests."""
    from parity.outputs.baseline import note_lines

    if comparison is None:
        return []
    return [*(f"baseline: {r.key}: {r.message}" for r in comparison.regressions + comparison.other_weights),
            *(f"baseline: {line}" for line in note_lines(path, comparison))]


def baseline_problem(path, comparison, entries) -> str | None:
    from parity.outputs.baseline import problem_message

    return None if comparison is None else problem_message(path, comparison, entries)


def update_baseline(args: argparse.Namespace, reports, out) -> None:
    from parity.outputs.baseline import BASELINE_VERSION, write_baseline

    written, dropped = write_baseline(args.baseline, reports, key_roots(args))
    print(f"baseline: wrote {written} layer entr{'y' if written == 1 else 'ies'} to {args.baseline}", file=out)
    if dropped:
        print(f"baseline: dropped {dropped} entr{'y' if dropped == 1 else 'ies'} of the old format (no weight "
              f"fingerprint, keys that may hold absolute paths); the file is now format {BASELINE_VERSION}", file=out)


def write_outputs(args: argparse.Namespace, runs, single: bool, shard, comparison, problem: str | None,
                  code: int) -> None:
    """--junit, --html and --json, each written atomically (parity.outputs.atomic): a CI step never reads half a
    file."""
    regressions = comparison.regressions if comparison is not None else []
    if args.junit:
        from parity.outputs.junit import write_junit

        write_junit(args.junit, runs, {id(r.layer): r.message for r in regressions},
                    {id(r.layer): r.message for r in (comparison.other_weights if comparison is not None else [])},
                    problem)
    if getattr(args, "html", None):
        from parity.outputs.html import write_html

        line = summary(runs, args, single, shard, code, regressions, comparison is not None)
        write_html(args.html, runs, line, code, problem)
    if single and getattr(args, "save_mapping", None):
        save_mapping(args.save_mapping, runs[0].report, given=args.mapping, force=args.force)
    if args.json:
        _write_json(args.json, json.dumps(json_document(runs, single, shard, args, comparison, problem, code),
                                          indent=2))


def save_mapping(path: str, report, *, given: str | None = None, force: bool = False) -> None:
    """--save-mapping: the routes this run used, as a mapping file that repeats the run with --mapping FILE.
    Replaces only a file that --save-mapping wrote (or any with ``force``), and never the mapping the run was
    given: the saved file extends that mapping, and would then extend itself."""
    from parity.outputs.atomic import write_output
    from parity.spec.toml_text import mapping_text

    refuse_to_replace(path, given, force)
    if report is None or not report.routes:
        raise UsageError(f"--save-mapping {path}: no layer was built, so no routes were used; nothing written")
    routes = report.routes
    how = "read off the target's parameter names" if routes["inferred"] else "of the mapping it extends"
    header = (f"Written by `parity {report.model} --save-mapping`: target {report.target}, routes {how}.\n"
              f"The same run: parity {report.model} --mapping {path}")
    if routes["args"] is None:
        header += "\nThe run checked an nn.Module instance: set [target].args to build its class as it was built."
    if "<" in report.target:
        header += f"\n{report.target} cannot be imported by name: put the factory in a module (module:function)."
    text = mapping_text(routes["extends"], report.target, routes["args"], routes["tensors"], header=header)
    write_output(path, text, "--save-mapping", create_folder=False)


def refuse_to_replace(path: str, given: str | None, force: bool) -> None:
    from pathlib import Path

    from parity.spec.files import shown
    from parity.spec.toml_text import SAVED_MAPPING_MARK

    target = Path(path)
    if given is not None and target.exists() and Path(given).exists() and os.path.samefile(target, given):
        raise UsageError(f"--save-mapping {shown(path)}: is the mapping this run was given (--mapping); the saved "
                         "mapping extends it, so writing it there would lose its content and make it extend itself. "
                         "Save to another file")
    if force or not target.is_file():
        return
    try:
        with open(target, encoding="utf-8", errors="replace") as handle:
            first = handle.readline(4096)
    except OSError:
        first = ""
    if not first.startswith(SAVED_MAPPING_MARK):
        raise UsageError(f"--save-mapping {shown(path)}: the file exists and was not written by --save-mapping; "
                         "parity will not replace it. Choose another file, or add --force to replace it")


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
                    "error": problem}
    if single:
        data = runs[0].report.to_dict()
        if baseline is not None:
            data["baseline"] = baseline
        return data
    return {
        "schema_version": SCHEMA_VERSION, "kind": "suite", "passed": code == 0,
        "shard": list(shard) if shard else None,
        "checks": [{"name": run.label, "where": run.spec.where, "error": run.error,
                    "report": run.report.to_dict() if run.report is not None else None} for run in runs],
        "baseline": baseline,
    }


def list_mappings() -> int:
    from parity.spec.datafiles import builtin_mapping_dir
    from parity.spec.registry import builtin_mappings

    mappings = builtin_mappings()
    width = max(map(len, mappings), default=4)
    print(f"Built-in mappings ({builtin_mapping_dir()}):")
    for name, mapping in mappings.items():
        print(f"  {name:<{width}}  {mapping.description}")
        print(f"  {'':<{width}}  model_type: {', '.join(mapping.model_types)}; default: {mapping.default_checkpoint}")
    return EXIT_PASS


def run_check(args: argparse.Namespace) -> int:
    from parity.spec.project import CheckSpec

    layers = args.layer if args.layer is not None else args.layers
    spec = CheckSpec(model=args.model, checkpoint=args.checkpoint, layers=layers, target=args.target,
                     mapping=args.mapping, revision=args.revision, seed=args.seed, atol=args.atol, logits=args.logits,
                     allow_pickle=args.allow_pickle, experts=args.experts, require_real=args.require_real,
                     device=args.device, dtype=args.dtype)
    try:
        return with_error_outputs(args, spec.label, True, lambda: run_specs([spec], args, single=True))
    except MappingError as exc:
        if getattr(exc, "details", None) is None:
            raise
        print(exc.details, file=sys.stderr)  # the target's parameters, the checkpoint's tensors, a mapping to edit
        raise MappingError(exc.headline) from None


