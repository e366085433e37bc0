"""The `parity` command.  Light commands (--help, --version, list) import neither torch
nor transformers; exit codes: 0 all layers match, 1 some layer deviates, 2 bad input."""

from __future__ import annotations

import argparse
import json
import os
import sys

from . import __version__
from .errors import ParityError

EXIT_PASS, EXIT_MISMATCH, EXIT_BAD_INPUT = 0, 1, 2

DESCRIPTION = """\
Check that a feed-forward module computes what transformers computes on the same
checkpoint weights, one layer at a time.

MODEL is a mapping name (gpt2, llama, gemma, ...; see `parity list`), a hub id
(owner/name), a local folder with config.json + *.safetensors, a .safetensors file, a
.gguf file, or (with --allow-pickle) a pytorch_model.bin / Meta consolidated.00.pth folder.

commands:
  parity MODEL [options]   check one model (this page)
  parity check [options]   run every check listed in ./parity.toml or [tool.parity] in
                           ./pyproject.toml (`parity check --help`); a folder literally
                           named "check" must be given as ./check
  parity inspect MODEL     show what would be checked, computing nothing
  parity list              the built-in mappings

exit codes: 0 every checked layer matches, 1 some layer deviates (or grew beyond the
baseline), 2 bad input or unusable checkpoint."""


def seed_value(text: str) -> int:
    """argparse type: torch seeds must fit in 64 bits (a larger one fails deep inside torch)."""
    from .project import SEED_LIMIT

    value = int(text)
    if not -SEED_LIMIT < value < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"{text} is out of range: use |seed| < 2**40")
    return value


def positive_float(text: str) -> float:
    """argparse type for --atol: a tolerance of 0, below 0 or NaN would fail every layer or none."""
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text}: expected a positive number")
    return value


def nonempty(hint: str):
    """argparse type: an empty value (`--checkpoint ''`, say from an unset shell variable) is a mistake;
    taken as absent it would silently check something else."""
    def value(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"the value is empty ({text!r}): {hint}")
        return text
    return value


MODEL_VALUE = nonempty("give a mapping name (see `parity list`), a hub id or a local path")
CHECKPOINT_VALUE = nonempty("give a local path or a hub id, or leave the option out to use the mapping's default")
TARGET_VALUE = nonempty("give pkg.module:Class, or leave the option out to use the mapping's target")
MAPPING_VALUE = nonempty("give a mapping file FILE.toml, or leave the option out to use the built-in one")
REVISION_VALUE = nonempty("give a branch, tag or commit, or leave the option out")


def baseline_option(key: str):
    """argparse type for --baseline-factor / --baseline-slack: the project file's rule (parity.project)."""
    from .project import baseline_number

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        try:
            return baseline_number(key, value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = key  # argparse names the type in some messages
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="parity", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"parity {__version__}")
    parser.add_argument("model", metavar="MODEL", type=MODEL_VALUE, help="mapping name, hub id, local folder or file; or 'list'")
    parser.add_argument("--checkpoint", metavar="PATH_OR_ID", type=CHECKPOINT_VALUE, help="weights to use instead of the mapping's default")
    layers = parser.add_mutually_exclusive_group()
    layers.add_argument("--layer", type=int, metavar="N", help="check one layer")
    layers.add_argument("--layers", metavar="SPEC", help="all | 0,3,5 | 2-7 (default: all; for large synthetic stand-ins first, middle, last)")
    parser.add_argument("--target", metavar="pkg.module:Class", type=TARGET_VALUE, help="module (class or factory) to check instead of the mapping's")
    parser.add_argument("--mapping", metavar="FILE.toml", type=MAPPING_VALUE, help="mapping file to use instead of the built-in one")
    parser.add_argument("--revision", metavar="REV", type=REVISION_VALUE, help="hub revision (branch, tag or commit)")
    parser.add_argument("--seed", type=seed_value, default=0, help="seed of the generated inputs (default 0)")
    parser.add_argument("--atol", type=positive_float, metavar="X", help="absolute tolerance instead of the noise-floor-derived one")
    parser.add_argument("--logits", action="store_true",
                        help="also substitute the module into the full model and compare its final logits")
    # checkpoint formats (issue 4): pickle-based files, mixture-of-experts layers
    parser.add_argument("--allow-pickle", action="store_true",
                        help="open pickle-based weights (pytorch_model*.bin, Meta consolidated.*.pth) with "
                             "torch.load(weights_only=True); only for files you trust")
    parser.add_argument("--experts", metavar="SPEC", help="MoE models: all | 0,3 | 2-5 experts of each layer (default: all)")
    parser.add_argument("--require-real", action="store_true",
                        help="exit 2 instead of checking synthetic weights when the default checkpoint is unreachable "
                             "(`parity check` requires real weights by default)")
    add_output_options(parser)
    return parser


# -- CI outputs, baselines, project checks, inspect ------------------------------------------------

CHECK_DESCRIPTION = """Run every check listed in the project file of the current directory: parity.toml, else
the [tool.parity] table of pyproject.toml (or --config FILE), with one summary at the end.

  [[tool.parity.checks]]
  model = "gpt2"                          # as `parity MODEL`
  layers = [0, 11]                        # or "all", "0,3", "2-7"; default all
  target = "mypkg.ffn:MLP"                # optional, as --target
  # checkpoint, mapping, revision, seed, atol (alias tolerance), logits, experts, allow_pickle, name: optional

--shard K/N runs the K-th of N shares of the (check, layer) units, dealt round-robin in
file and layer order, so N CI jobs together run each unit exactly once.

exit codes: 0 all match, 1 some layer deviates or regressed against the baseline,
2 a bad project file or a check that cannot run (named by file and entry)."""

INSPECT_DESCRIPTION = """Show what `parity MODEL` would check, without computing anything: the family and its
mapping file, d and d_ff (and whether d_ff follows the family's rule), the activation the
config names and the one transformers runs, biases, and one layer's FFN tensors (names,
shapes, dtypes, shard files) read from safetensors headers. No tensor is loaded."""


def add_output_options(parser: argparse.ArgumentParser) -> None:
    out = parser.add_argument_group("CI outputs")
    out.add_argument("--json", metavar="FILE|-", help="write the JSON report to FILE, or to stdout with '-'")
    out.add_argument("--junit", metavar="FILE", help="write JUnit XML: one test case per layer (per expert), failures with the diagnosis")
    out.add_argument("--quiet", "-q", action="store_true", help="print only the summary line, baseline findings and errors")
    out.add_argument("--baseline", metavar="FILE", help="fail (exit 1) when a layer's max|Δ| grew beyond the stored run's, or a passing layer now fails; "
                          "exit 2 when the file matches none of the run's layers or was made from other weights")
    out.add_argument("--baseline-factor", type=baseline_option("baseline_factor"), metavar="F",
                     help="allowed growth factor over the baseline, >= 1 (default 2.0)")
    out.add_argument("--baseline-slack", type=baseline_option("baseline_slack"), metavar="X",
                     help="absolute growth always allowed, >= 0 (default 1e-8): noise, not drift")
    out.add_argument("--update-baseline", action="store_true", help="write this run's deviations into --baseline FILE (merged, sorted) instead of comparing")
    out.add_argument("--debug", action="store_true", help="show tracebacks for errors")


def build_check_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="parity check", description=CHECK_DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", metavar="FILE", help="project file to read instead of ./parity.toml or ./pyproject.toml")
    parser.add_argument("--shard", metavar="K/N", help="run only this job's share: K of N (e.g. 2/4 in a CI matrix)")
    add_output_options(parser)
    return parser


def build_inspect_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="parity inspect", description=INSPECT_DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", metavar="MODEL", type=MODEL_VALUE, help="mapping name, hub id, local folder or file")
    parser.add_argument("--checkpoint", metavar="PATH_OR_ID", type=CHECKPOINT_VALUE, help="weights to use instead of the mapping's default")
    parser.add_argument("--layer", type=int, default=0, metavar="N", help="layer whose tensors to list (default 0)")
    parser.add_argument("--target", metavar="pkg.module:Class", type=TARGET_VALUE, help="target to name instead of the mapping's")
    parser.add_argument("--mapping", metavar="FILE.toml", type=MAPPING_VALUE, help="mapping file to use instead of the built-in one")
    parser.add_argument("--revision", metavar="REV", type=REVISION_VALUE, help="hub revision (branch, tag or commit)")
    parser.add_argument("--json", action="store_true", help="print the inspection as JSON")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    return parser


def run_inspect(args: argparse.Namespace) -> int:
    from .inspect_cmd import inspect_model, inspection_json, render_inspection

    info = inspect_model(args.model, checkpoint=args.checkpoint, mapping=args.mapping, revision=args.revision,
                         target=args.target, layer=args.layer)
    print(inspection_json(info) if args.json else render_inspection(info))
    return EXIT_PASS


def run_project(args: argparse.Namespace) -> int:
    from .project import load_project, parse_shard

    project = load_project(args.config)
    shard = parse_shard(args.shard) if args.shard else None  # validated before any model is resolved
    for folder in (str(project.path.parent.resolve()), os.getcwd()):
        if folder not in sys.path:
            sys.path.insert(0, folder)  # targets of the project being checked
    for key in ("baseline", "junit", "baseline_factor", "baseline_slack"):
        if getattr(args, key) is None:
            setattr(args, key, getattr(project, key))
    args.key_root = project.path.parent  # baseline keys name local paths relative to the project
    return run_specs(project.checks, args, single=False, shard=shard)


def run_specs(specs, args: argparse.Namespace, single: bool, shard=None) -> int:
    """Plan, run and report checks: tables, progress, baseline, JUnit, JSON; returns the exit code."""
    from .baseline import load_baseline, load_for_update
    from .progress import Progress, bar_wanted, silence_downloads
    from .report import diagnosis_lines, header_lines, layer_line, logits_lines, summary_line, table_header
    from .suite import exit_code, execute, plan

    json_stdout = args.json == "-"
    out = sys.stderr if json_stdout else sys.stdout
    if args.update_baseline and not args.baseline:
        raise UsageError("--update-baseline needs --baseline FILE (or 'baseline' in the project file)")
    if args.quiet or json_stdout:  # download bars would interleave with the table / JSON consumers' stderr
        silence_downloads()
    entries = load_baseline(args.baseline) if args.baseline and not args.update_baseline else None
    if args.update_baseline:
        load_for_update(args.baseline)  # refuse a file that is not a baseline before computing anything
    runs = plan(specs, shard, raise_errors=single)
    progress = Progress(sum(len(run.layers) for run in runs), bar_wanted(args.quiet, json_stdout))
    shown: list = []

    def say(text: str = "") -> None:
        if not args.quiet:
            progress.say(text, out)

    def on_layer(run, report, result) -> None:
        if run not in shown:
            if shown:
                say()
            for line in [*header_lines(report), "", table_header(result)]:
                say(line)
            shown.append(run)
        say(layer_line(result))
        progress.step(f"{run.label} layer {result.layer}")

    def on_check(run) -> None:
        if run.report is not None:
            say()
            for line in [*diagnosis_lines(run.report), *logits_lines(run.report)]:
                say(line)
            if not single:
                say(summary_line(run.report))

    try:
        execute(runs, on_layer, raise_errors=single, on_check=on_check)
    finally:
        progress.close()
    reports = [run.report for run in runs if run.report is not None]
    comparison = compare_with_baseline(reports, entries, args) if entries is not None else None
    regressions = comparison.regressions if comparison is not None else []
    for run in runs:
        if run.error is not None:
            print(f"parity: error: {run.error}", file=sys.stderr)
    for line in baseline_lines(args.baseline, comparison):
        print(line, file=out)
    code = exit_code(runs, len(regressions))
    problem = baseline_problem(args.baseline, comparison, entries)
    if problem is not None:
        code = max(code, EXIT_BAD_INPUT)  # a baseline that does not describe this run proves nothing
    if single:
        summary = summary_line(runs[0].report)
        if regressions:
            summary += f" BASELINE: {len(regressions)} layer(s) regressed against {args.baseline}."
        print(summary, file=out)
    else:
        print(suite_summary(runs, code, len(regressions) if entries is not None else None, shard), file=out)
    if args.update_baseline:
        update_baseline(args, reports, out)
    elif comparison is not None and not args.quiet:
        print(f"baseline: {comparison.compared} layer(s) compared with {args.baseline}, {len(regressions)} regressed",
              file=out)
    if problem is not None:
        print(f"parity: error: {problem}", file=sys.stderr)
    write_outputs(args, runs, single, shard, comparison, problem, code)
    return code


def key_roots(args: argparse.Namespace) -> tuple:
    """Folders a local path in a baseline key is relative to: the project file's (`parity check`),
    then the working directory; never an absolute path, which differs on every CI runner."""
    from pathlib import Path

    root = getattr(args, "key_root", None)
    return tuple(dict.fromkeys(p.resolve() for p in ([Path(root)] if root is not None else []) + [Path.cwd()]))


def compare_with_baseline(reports, entries: dict, args: argparse.Namespace):
    from .baseline import DEFAULT_FACTOR, DEFAULT_SLACK, compare_baseline

    factor = args.baseline_factor if args.baseline_factor is not None else DEFAULT_FACTOR
    slack = args.baseline_slack if args.baseline_slack is not None else DEFAULT_SLACK
    return compare_baseline(reports, entries, factor, slack, key_roots(args))


def baseline_lines(path, comparison) -> list[str]:
    """Regressions, entries made from other weights, and what was left out: printed even with
    --quiet, since each says the baseline result is not what the exit code alone suggests."""
    from .baseline import note_lines

    if comparison is None:
        return []
    return [*(f"baseline: {r.key}: {r.message}" for r in comparison.regressions + comparison.other_weights),
            *(f"baseline: {line}" for line in note_lines(path, comparison))]


def baseline_problem(path, comparison, entries) -> str | None:
    from .baseline import problem_message

    return None if comparison is None else problem_message(path, comparison, entries)


def update_baseline(args: argparse.Namespace, reports, out) -> None:
    from .baseline import BASELINE_VERSION, write_baseline

    written, dropped = write_baseline(args.baseline, reports, key_roots(args))
    print(f"baseline: wrote {written} layer entr{'y' if written == 1 else 'ies'} to {args.baseline}", file=out)
    if dropped:
        print(f"baseline: dropped {dropped} entr{'y' if dropped == 1 else 'ies'} of the old format (no weight "
              f"fingerprint, keys that may hold absolute paths); the file is now format {BASELINE_VERSION}", file=out)


def write_outputs(args: argparse.Namespace, runs, single: bool, shard, comparison, problem: str | None,
                  code: int) -> None:
    """--junit and --json, each written atomically (parity.atomic): a CI step never reads half a file."""
    from .atomic import write_text_atomic

    regressions = comparison.regressions if comparison is not None else []
    if args.junit:
        from .junit import write_junit

        write_junit(args.junit, runs, {id(r.layer): r.message for r in regressions},
                    {id(r.layer): r.message for r in (comparison.other_weights if comparison is not None else [])},
                    problem)
    if args.json:
        text = json.dumps(json_document(runs, single, shard, args, comparison, problem, code), indent=2)
        if args.json == "-":
            print(text)
        else:
            write_text_atomic(args.json, text + "\n", "--json", create_folder=False)


def suite_summary(runs, code: int, regressed: int | None, shard) -> str:
    layers = sum(len(run.report.layers) for run in runs if run.report is not None)
    results = [layer for run in runs if run.report is not None for layer in run.report.layers]
    failed = sum(not layer.passed and layer.unverifiable is None for layer in results)
    unverifiable = sum(layer.unverifiable is not None for layer in results)
    errors = sum(run.error is not None for run in runs)
    where = f" in shard {shard[0]}/{shard[1]}" if shard else ""
    verdict = {0: "PASS", 1: "FAIL", 2: "ERROR"}[code]
    against = "" if regressed is None else f"{regressed} regressed against the baseline, "
    line = (f"{verdict}: {len(runs)} check(s), {layers} layer(s) checked{where}; {failed} deviate, "
            f"{unverifiable} could not be verified, {against}{errors} could not run.")
    if not results and not errors:
        line += " Nothing was compared, so this is not a pass."
    synthetic = [run.label for run in runs if run.report is not None and run.report.synthetic]
    if synthetic:
        line += f" SYNTHETIC weights (no real checkpoint weight read) in: {', '.join(synthetic)}."
    return line


def json_document(runs, single: bool, shard, args, comparison, problem: str | None, code: int) -> dict:
    """Single check: the report (schema_version 1, unchanged).  `parity check`: a suite of reports."""
    from .report import SCHEMA_VERSION

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


class UsageError(ParityError):
    """Options that do not go together."""


def list_mappings() -> int:
    from .mapping import builtin_mapping_dir, builtin_mappings

    mappings = builtin_mappings()
    width = max(map(len, mappings), default=4)
    print(f"Built-in mappings ({builtin_mapping_dir()}):")
    for name, mapping in mappings.items():
        print(f"  {name:<{width}}  {mapping.description}")
        print(f"  {'':<{width}}  model_type: {', '.join(mapping.model_types)}; default: {mapping.default_checkpoint}")
    return EXIT_PASS


def run_check(args: argparse.Namespace) -> int:
    from .project import CheckSpec

    layers = args.layer if args.layer is not None else args.layers
    spec = CheckSpec(model=args.model, checkpoint=args.checkpoint, layers=layers, target=args.target,
                     mapping=args.mapping, revision=args.revision, seed=args.seed, atol=args.atol, logits=args.logits,
                     allow_pickle=args.allow_pickle, experts=args.experts, require_real=args.require_real)
    return run_specs([spec], args, single=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["list"]:
        args, run = argparse.Namespace(debug="--debug" in argv), lambda _args: list_mappings()
    elif argv[:1] in (["check"], ["inspect"]):
        build, run = {"check": (build_check_parser, run_project), "inspect": (build_inspect_parser, run_inspect)}[argv[0]]
        args = build().parse_args(argv[1:])
    else:
        args, run = build_parser().parse_args(argv), run_check
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # a target class (--target or a mapping's target.class) from the project checked
    try:
        return run(args)
    except ParityError as exc:
        if args.debug:
            raise
        print(f"parity: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("parity: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug in parity (or in a library it calls): one line, not a traceback
        if args.debug:
            raise
        print(f"parity: internal error ({type(exc).__name__}: {' '.join(str(exc).split())}); please report it, "
              "and rerun with --debug to see the traceback", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
