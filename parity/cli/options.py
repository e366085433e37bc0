"""The command line's options: one parser per command, and argparse types that apply the
project's one rule for each value (``parity.definitions.values``).  Imports no torch."""

from __future__ import annotations

import argparse
import functools

from parity import __version__
from parity.definitions.values import atol_value, baseline_number, device_value, dtype_value, nonempty, seed_value

DESCRIPTION = """\
Check that a feed-forward module computes what transformers computes on the same
checkpoint weights, one layer at a time.

MODEL is a mapping name (gpt2, llama, gemma, ...; see `parity list`), a hub id
(owner/name), a local folder with config.json + *.safetensors, a .safetensors file, a
.gguf file, or (with --allow-pickle) a pytorch_model.bin / Meta consolidated.00.pth folder.

commands:
  parity MODEL [options]   check one model (this page)
  parity check [options]   run every check listed in parity.toml or [tool.parity] in
                           pyproject.toml, here or in a parent folder (`parity check
                           --help`)
  parity inspect MODEL     show what would be checked, computing nothing
  parity compare A B       judge checkpoint B (a re-save, cast, GGUF export or quantization)
                           against checkpoint A, layer by layer (`parity compare --help`)
  parity list              the built-in mappings
A local folder literally named "compare", "check", "inspect" or "list" must be given as
./compare (./check, ...): as the first argument each word is a command.

exit codes: 0 every checked layer matches, 1 some layer deviates (or grew beyond the
baseline), 2 bad input or unusable checkpoint."""


def value_type(rule, convert=str, hint: str = ""):
    """argparse type from a parity.definitions.values rule: the same check as project files and the API."""
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {'a number' if convert is float else 'an integer'}") from None
        try:
            return rule(value)
        except ValueError as exc:
            said = f"the value {exc}" if str(exc).startswith("is ") else str(exc)
            raise argparse.ArgumentTypeError(f"{said}{': ' + hint if hint else ''}") from None

    parse.__name__ = getattr(rule, "__name__", "value")  # argparse names the type in some messages
    return parse


SEED = value_type(seed_value, int)
ATOL = value_type(atol_value, float)
MODEL_VALUE = value_type(nonempty, hint="give a mapping name (see `parity list`), a hub id or a local path")
CHECKPOINT_VALUE = value_type(nonempty, hint="give a local path or a hub id, "
                                             "or leave the option out to use the mapping's default")
TARGET_VALUE = value_type(nonempty, hint="give pkg.module:Class, or leave the option out to use the mapping's target")
MAPPING_VALUE = value_type(nonempty, hint="give a mapping file FILE.toml, "
                                          "or leave the option out to use the built-in one")
OUTPUT_FILE = value_type(nonempty, hint="give a file name (an unset variable in a CI script?), or leave the option out")
REVISION_VALUE = value_type(nonempty, hint="give a branch, tag or commit, or leave the option out")
FACTOR = value_type(functools.partial(baseline_number, "baseline_factor"), float)
SLACK = value_type(functools.partial(baseline_number, "baseline_slack"), float)
DEVICE = value_type(device_value)
DTYPE = value_type(dtype_value)


def selection_expression(text: str) -> str:
    """``-k``'s expression, as given.  An empty one is kept as a blank one: ``-k ''`` must be refused as
    ``-k ' '`` is (parity.definitions.run_selection.select_checks: an empty selection is a usage error, exit 2),
    not read as no ``-k`` at all, which would run every check."""
    return text or " "


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="parity", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"parity {__version__}")
    parser.add_argument("model", metavar="MODEL", type=MODEL_VALUE,
                        help="mapping name, hub id, local folder or file; or 'list'")
    parser.add_argument("--checkpoint", metavar="PATH_OR_ID", type=CHECKPOINT_VALUE,
                        help="weights to use instead of the mapping's default")
    layers = parser.add_mutually_exclusive_group()
    layers.add_argument("--layer", type=int, metavar="N", help="check one layer")
    layers.add_argument("--layers", metavar="SPEC",
                        help="all | 0,3,5 | 2-7 (default: all; for large synthetic stand-ins first, middle, last)")
    parser.add_argument("--target", metavar="pkg.module:Class", type=TARGET_VALUE,
                        help="module (class or factory) to check instead of the mapping's")
    parser.add_argument("--mapping", metavar="FILE.toml", type=MAPPING_VALUE,
                        help="mapping file to use instead of the built-in one")
    parser.add_argument("--save-mapping", metavar="FILE.toml", type=OUTPUT_FILE,
                        help="write the routes this run used (inferred from names, or the mapping's) as a mapping "
                             "file; `--mapping FILE.toml` then repeats the same run (an existing file is replaced "
                             "only when parity wrote it, or with --force)")
    parser.add_argument("--force", action="store_true",
                        help="let --save-mapping replace an existing file that parity did not write")
    parser.add_argument("--revision", metavar="REV", type=REVISION_VALUE, help="hub revision (branch, tag or commit)")
    parser.add_argument("--seed", type=SEED, default=0, help="seed of the generated inputs (default 0)")
    parser.add_argument("--atol", type=ATOL, metavar="X",
                        help="absolute tolerance instead of the noise-floor-derived one")
    parser.add_argument("--logits", action="store_true",
                        help="also substitute the module into the full model and compare its final logits")
    # checkpoint formats (issue 4): pickle-based files, mixture-of-experts layers
    parser.add_argument("--allow-pickle", action="store_true",
                        help="open pickle-based weights (pytorch_model*.bin, Meta consolidated.*.pth) with "
                             "torch.load(weights_only=True); only for files you trust")
    parser.add_argument("--experts", metavar="SPEC",
                        help="MoE models: all | 0,3 | 2-5 experts of each layer (default: all)")
    parser.add_argument("--block", action="store_true", default=None,
                        help="MoE models: check each layer's whole sparse block (router, top-k, experts, shared "
                             "experts) as one unit; the default when --target holds more than one expert")
    parser.add_argument("--require-real", action="store_true",
                        help="exit 2 instead of checking synthetic weights when the default checkpoint is unreachable "
                             "(`parity check` requires real weights by default)")
    # where and in what the target computes (issue 11); the truth stays float64 on the CPU
    parser.add_argument("--device", type=DEVICE, default="cpu", metavar="DEV",
                        help="run the target on cpu (default), cuda, cuda:N or mps")
    parser.add_argument("--dtype", type=DTYPE, default="float32", metavar="DTYPE",
                        help="the target's compute dtype: float32 (default), bfloat16 or float16; a low precision "
                             "is held to the reference's own error in that dtype (docs/precision.md)")
    add_output_options(parser)
    return parser


# -- CI outputs, baselines, project checks, inspect ------------------------------------------------

CHECK_DESCRIPTION = """Run every check listed in the project file: the nearest parity.toml, else pyproject.toml
with a [tool.parity] table, in the current folder or its parents (or --config FILE), with one
summary at the end.  -k EXPR runs the checks whose name matches (as pytest -k).

  [[tool.parity.checks]]
  model = "gpt2"                          # as `parity MODEL`
  layers = [0, 11]                        # or "all", "0,3", "2-7"; default all
  target = "mypkg.ffn:MLP"                # optional, as --target
  # checkpoint, mapping, revision, seed, atol (alias tolerance), logits, experts, allow_pickle, name,
  # device, dtype: optional

  [[tool.parity.compares]]                # `parity compare A B`, run after the checks
  name = "q8 export"                      # optional: label and baseline key
  a = "models/llama-hf"                   # the truth
  b = "models/llama-Q8_0.gguf"            # made from A; layers, revision, revision_b, seed, ...: optional

--shard K/N runs the K-th of N shares of the (check, layer) units, dealt round-robin in
file and layer order, so N CI jobs together run each unit exactly once.

exit codes: 0 all match, 1 some layer deviates or regressed against the baseline,
2 a bad project file or a check that cannot run (named by file and entry)."""

INSPECT_DESCRIPTION = """Show what `parity MODEL` would check, without computing anything: the family and its
mapping file, d and d_ff (and whether d_ff follows the family's rule), the activation the
config names and the one transformers runs, biases, the target as a check would build it
(constructor only) and the routes a check would fill it through (read off its parameter
names for --target without --mapping), and one layer's FFN tensors (names, shapes, dtypes,
shard files) read from safetensors headers. No tensor is loaded (a pickle-based checkpoint,
opened with --allow-pickle, has no headers: its layer is read) and nothing runs forward.

exit codes: 0 shown, 2 bad input, or a target a check could not build or fill."""


def add_output_options(parser: argparse.ArgumentParser) -> None:
    out = parser.add_argument_group("CI outputs")
    out.add_argument("--json", metavar="FILE|-", type=OUTPUT_FILE,
                     help="write the JSON report to FILE, or to stdout with '-' (written on every exit code: on exit 2 "
                          "it holds the error)")
    out.add_argument("--junit", metavar="FILE", type=OUTPUT_FILE,
                     help="write JUnit XML: one test case per layer (per expert), failures with the diagnosis")
    out.add_argument("--html", metavar="FILE", type=OUTPUT_FILE,
                     help="write one self-contained HTML page: context, a per-layer chart of max|Δ| against noise "
                          "floor and tolerance, the diagnoses' evidence drawn (viewable offline)")
    out.add_argument("--quiet", "-q", action="store_true",
                     help="print only the summary line, baseline findings and errors")
    out.add_argument("--baseline", metavar="FILE", type=OUTPUT_FILE,
                     help="fail (exit 1) when a layer's max|Δ| grew beyond the stored run's, or a passing layer now "
                          "fails; exit 2 when the file matches none of the run's layers or was made from other weights")
    out.add_argument("--baseline-factor", type=FACTOR, metavar="F",
                     help="allowed growth factor over the baseline, >= 1 (default 2.0)")
    out.add_argument("--baseline-slack", type=SLACK, metavar="X",
                     help="absolute growth always allowed, >= 0 (default 1e-8): noise, not drift")
    out.add_argument("--update-baseline", action="store_true",
                     help="write this run's deviations into --baseline FILE (merged, sorted) instead of comparing")
    out.add_argument("--debug", action="store_true", help="show tracebacks for errors")


def build_check_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="parity check", description=CHECK_DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", metavar="FILE",
                        help="project file to read instead of the nearest parity.toml or pyproject.toml")
    parser.add_argument("--shard", metavar="K/N", help="run only this job's share: K of N (e.g. 2/4 in a CI matrix)")
    parser.add_argument("-k", metavar="EXPR", dest="select", type=selection_expression,
                        help="run only the checks whose name matches: a substring (case-insensitive), or words "
                             "combined with and / or / not and parentheses, as pytest -k")
    add_output_options(parser)
    return parser


def build_inspect_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="parity inspect", description=INSPECT_DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", metavar="MODEL", type=MODEL_VALUE, help="mapping name, hub id, local folder or file")
    parser.add_argument("--checkpoint", metavar="PATH_OR_ID", type=CHECKPOINT_VALUE,
                        help="weights to use instead of the mapping's default")
    parser.add_argument("--layer", type=int, default=0, metavar="N", help="layer whose tensors to list (default 0)")
    parser.add_argument("--target", metavar="pkg.module:Class", type=TARGET_VALUE,
                        help="module (class or factory) a check would use instead of the mapping's: it is built "
                             "(constructor only) and the routes a check would fill it through are shown")
    parser.add_argument("--mapping", metavar="FILE.toml", type=MAPPING_VALUE,
                        help="mapping file to use instead of the built-in one")
    parser.add_argument("--revision", metavar="REV", type=REVISION_VALUE, help="hub revision (branch, tag or commit)")
    parser.add_argument("--allow-pickle", action="store_true",
                        help="open pickle-based weights (pytorch_model*.bin, Meta consolidated.*.pth) with "
                             "torch.load(weights_only=True); only for files you trust")
    parser.add_argument("--json", metavar="FILE|-", type=OUTPUT_FILE, nargs="?", const="-",
                        help="write the inspection as JSON to FILE, or to stdout with '-' (the default)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    return parser




COMPARE_DESCRIPTION = """Judge checkpoint B against checkpoint A, one FFN layer at a time, as functions: transformers'
MLP built from A's config, filled with A's layer (the truth) and with B's layer (read through B's
own format: GGUF dequantized and renamed, Conv1D transposed), run on the same seeded inputs in
float64.  B passes where it deviates no more than its storage can honestly explain: float32 noise
for the same dtype, the rounding of B's dtype for a cast, the block step of B's GGUF type for a
quantization (each measured, docs/compare.md).  A failing layer names the conversion mistake
(gate_up_exchanged, tensor_transposed, layer_shifted, tensor_scaled, zero_filled, cast_overflow, ...).

A and B: a local folder, a .gguf file, a hub id, or (with --allow-pickle) a Meta consolidated.00.pth folder.

--baseline FILE compares each layer's max|Δ| with a stored run (the file and rules of a check's
baselines; keyed `compare A | B | layer N`, or `compare NAME | layer N` in a project file's
[[compares]]); --update-baseline writes it.

exit codes: 0 every compared layer of B matches A's, 1 some layer differs (or regressed against
the baseline), 2 bad input or nothing compared."""


def build_compare_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="parity compare", description=COMPARE_DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", metavar="A", type=MODEL_VALUE, help="the reference checkpoint (the truth)")
    parser.add_argument("b", metavar="B", type=MODEL_VALUE, help="the candidate checkpoint, made from A")
    parser.add_argument("--layers", metavar="SPEC", help="all | 0,3,5 | 2-7 (default: every layer both hold)")
    parser.add_argument("--experts", metavar="SPEC", help="MoE: all | 0,3 | 2-5 (default: every expert)")
    parser.add_argument("--revision", metavar="REV", type=REVISION_VALUE, help="hub revision of A")
    parser.add_argument("--revision-b", metavar="REV", type=REVISION_VALUE, help="hub revision of B")
    parser.add_argument("--allow-pickle", action="store_true",
                        help="open pickle-based weights of either side with torch.load(weights_only=True); only for "
                             "files you trust")
    parser.add_argument("--seed", type=SEED, default=0, help="seed of the generated inputs (default 0)")
    parser.add_argument("--require-real", action="store_true",
                        help="exit 2 when either side has only the synthetic stand-in (random weights with the real "
                             "shapes), instead of comparing it with SYNTHETIC in every view")
    add_output_options(parser)  # --json, --junit, --html, --quiet, --baseline (keyed `compare A | B | layer N`), ...
    return parser
