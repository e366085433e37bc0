"""What each command does: plan and run checks, print them, compare with the baseline (its reports are
written by ``reports``).  Heavy imports (torch, transformers) happen inside, when a check runs.
"""

from __future__ import annotations

import argparse
import os
import sys

from parity.cli.reports import (
    EXIT_BAD_INPUT,
    EXIT_PASS,
    key_roots,
    save_template,
    summary,
    update_baseline,
    with_error_outputs,
    write_outputs,
)
from parity.definitions.files import one_line
from parity.definitions.policy import synthetic_action
from parity.errors import MappingError, UsageError


def run_inspect(args: argparse.Namespace) -> int:
    from parity.engine.check.inspect import inspect_model, inspection_json, render_inspection

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
    from parity.definitions.project import load_project
    from parity.definitions.run_selection import parse_shard, select_checks

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
    args.project_file = str(project.path)
    return run_specs(project.checks, args, single=False, shard=shard)


def run_specs(specs, args: argparse.Namespace, single: bool, shard=None) -> int:
    """Plan, run and report checks: tables, progress, baseline, JUnit, JSON; returns the exit code."""
    from parity.engine.suite import exit_code
    from parity.outputs.baseline import load_baseline, load_for_update

    if args.update_baseline and not args.baseline:
        raise UsageError("--update-baseline needs --baseline FILE (or 'baseline' in the project file)")
    check_run_destinations(specs, args)
    entries = load_baseline(args.baseline) if args.baseline and not args.update_baseline else None
    if args.update_baseline:
        load_for_update(args.baseline)  # refuse a file that is not a baseline before computing anything
    out = sys.stderr if json_on_stdout(args.json) else sys.stdout  # stdout is the JSON's
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


def json_on_stdout(path: str | None) -> bool:
    """--json - (or a path that is this process's stdout): the text report then goes to stderr, so stdout is
    exactly the JSON document a pipe's reader parses."""
    from parity.outputs.atomic import STDOUT_PATHS

    return path == "-" or path in STDOUT_PATHS


def check_run_destinations(specs, args: argparse.Namespace) -> None:
    """Before anything is computed: no output onto one of the run's inputs or onto another output, and every
    output's folder writable (parity.outputs.destinations)."""
    from parity.outputs.destinations import check_destinations

    outputs = {"--json": args.json, "--junit": args.junit, "--html": getattr(args, "html", None),
               "--save-mapping": getattr(args, "save_mapping", None)}
    inputs = [(what, value) for spec in specs for what, value in spec.inputs()]
    inputs.append(("project file", getattr(args, "project_file", None)))
    if args.baseline and args.update_baseline:
        outputs["--baseline"] = args.baseline  # written by this run: no other output may take its path
    elif args.baseline:
        inputs.append(("baseline", args.baseline))
    check_destinations(outputs, inputs)
    if outputs["--save-mapping"]:  # a file the user edited is refused now, not after the whole check has run
        from parity.cli.reports import refuse_to_replace

        refuse_to_replace(outputs["--save-mapping"], getattr(args, "force", False))


def run_with_progress(specs, args: argparse.Namespace, single: bool, shard, out, judge=None) -> list:
    """Plan and execute the checks, streaming each table (unless --quiet) under a progress bar; ``judge``
    (a BaselineJudge) marks each layer against the baseline before its row is printed."""
    from parity.engine.suite import execute, plan
    from parity.outputs.compare_text import SuiteWriter
    from parity.outputs.progress import Progress, bar_wanted, silence_downloads

    json_stdout = json_on_stdout(args.json)
    if args.quiet or json_stdout:  # download bars would interleave with the table / JSON consumers' stderr
        silence_downloads()
    if not bar_wanted(False, False):  # stderr is no terminal (a CI log): no library's bars either
        silence_foreign_bars()
    from parity.engine.compare.comparison import open_comparison

    runs = plan(specs, shard, raise_errors=single, open_compare=open_comparison)
    progress = Progress(sum(len(run.layers) for run in runs), bar_wanted(args.quiet, json_stdout))
    writer = SuiteWriter(lambda text: None if args.quiet else progress.say(text, out))  # checks' and compares

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


def list_mappings() -> int:
    from parity.definitions.datafiles import builtin_mapping_dir
    from parity.definitions.registry import builtin_mappings

    mappings = builtin_mappings()
    width = max(map(len, mappings), default=4)
    print(f"Built-in mappings ({builtin_mapping_dir()}):")
    for name, mapping in mappings.items():
        print(f"  {name:<{width}}  {mapping.description}")
        print(f"  {'':<{width}}  model_type: {', '.join(mapping.model_types)}; default: {mapping.default_checkpoint}")
    print("Any other model type: its layout is derived from transformers (dense FFNs, each expert of a mixture "
          "of experts, shared experts, dense layers before MoE ones; GGUF names from gguf's own name map: "
          "docs/formats.md#derived-layouts).")
    return EXIT_PASS


def run_check(args: argparse.Namespace) -> int:
    from parity.definitions.project import CheckSpec

    layers = args.layer if args.layer is not None else args.layers
    spec = CheckSpec(model=args.model, checkpoint=args.checkpoint, layers=layers, target=args.target,
                     mapping=args.mapping, revision=args.revision, seed=args.seed, atol=args.atol, logits=args.logits,
                     allow_pickle=args.allow_pickle, experts=args.experts, block=args.block,
                     require_real=args.require_real, device=args.device, dtype=args.dtype)
    try:
        return with_error_outputs(args, spec.label, True, lambda: run_specs([spec], args, single=True))
    except MappingError as exc:
        if getattr(exc, "details", None) is None:
            raise
        print(exc.details, file=sys.stderr)  # the target's parameters, the checkpoint's tensors, a mapping to edit
        template = getattr(exc, "template", None)
        if template and args.save_mapping:  # the mapping to edit, as a file: exit 2 all the same
            save_template(args.save_mapping, template, force=args.force)
        raise MappingError(exc.headline) from None


def run_compare(args: argparse.Namespace) -> int:
    """`parity compare A B`: one compare, run as `parity check` runs a project's (``run_specs``): a row per layer,
    the diagnoses, the inventory, the baseline's findings and the summary; exit 0 (every layer of B matches A's),
    1 (some layer differs or regressed against --baseline), 2 (bad input, or nothing verified)."""
    from parity.definitions.project import CompareSpec

    spec = CompareSpec(a=args.a, b=args.b, layers=args.layers, revision=args.revision, revision_b=args.revision_b,
                       seed=args.seed, allow_pickle=args.allow_pickle, experts=args.experts,
                       require_real=synthetic_action("parity compare", args.require_real or None) == "refuse")
    args.model = spec.label  # what the error JSON names
    return with_error_outputs(args, spec.label, True, lambda: run_specs([spec], args, single=True))
