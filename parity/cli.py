"""The `parity` command.  Light commands (--help, --version, list) import neither torch
nor transformers; exit codes: 0 all layers match, 1 some layer deviates, 2 bad input."""

from __future__ import annotations

import argparse
import os
import sys

from . import __version__
from .errors import ParityError

EXIT_PASS, EXIT_MISMATCH, EXIT_BAD_INPUT = 0, 1, 2

DESCRIPTION = """\
Check that a feed-forward module computes what transformers computes on the same
checkpoint weights, one layer at a time.

MODEL is a mapping name (gpt2, llama, gemma, ...; see `parity list`), a hub id
(owner/name), a local folder with config.json + *.safetensors, or a .safetensors file.

exit codes: 0 every checked layer matches, 1 some layer deviates, 2 bad input or
unusable checkpoint."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="parity", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"parity {__version__}")
    parser.add_argument("model", metavar="MODEL", help="mapping name, hub id, local folder or file; or 'list'")
    parser.add_argument("--checkpoint", metavar="PATH_OR_ID", help="weights to use instead of the mapping's default")
    layers = parser.add_mutually_exclusive_group()
    layers.add_argument("--layer", type=int, metavar="N", help="check one layer")
    layers.add_argument("--layers", metavar="SPEC", help="all | 0,3,5 | 2-7 (default: all; for large synthetic stand-ins first, middle, last)")
    parser.add_argument("--target", metavar="pkg.module:Class", help="module (class or factory) to check instead of the mapping's")
    parser.add_argument("--mapping", metavar="FILE.toml", help="mapping file to use instead of the built-in one")
    parser.add_argument("--revision", metavar="REV", help="hub revision (branch, tag or commit)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated inputs (default 0)")
    parser.add_argument("--atol", type=float, metavar="X", help="absolute tolerance instead of the noise-floor-derived one")
    parser.add_argument("--json", metavar="FILE|-", help="write the JSON report to FILE, or to stdout with '-'")
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="no download progress bars and no per-layer table (the summary line and errors still print)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    return parser


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
    from .report import HEADER, header_lines, layer_line, summary_line
    from .runner import check

    to_stdout = args.json == "-"
    say = (lambda text: print(text, file=sys.stderr)) if to_stdout else print
    started = []
    if args.quiet or to_stdout:  # progress bars would interleave with the table / JSON consumers' stderr
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()

    def on_layer(report, result):
        if args.quiet:
            return
        if not started:
            for line in [*header_lines(report), "", HEADER]:
                say(line)
            started.append(True)
        say(layer_line(result))

    layers = args.layer if args.layer is not None else args.layers
    report = check(args.model, layers=layers, target=args.target, checkpoint=args.checkpoint, mapping=args.mapping,
                   revision=args.revision, seed=args.seed, atol=args.atol, on_layer=on_layer)
    if not args.quiet:
        say("")
    say(summary_line(report))
    if args.json:
        if to_stdout:
            print(report.to_json())
        else:
            with open(args.json, "w", encoding="utf-8") as handle:
                handle.write(report.to_json() + "\n")
    return EXIT_PASS if report.passed else EXIT_MISMATCH


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["list"]:
        return list_mappings()
    args = build_parser().parse_args(argv)
    if args.target and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # `--target mymodule:MLP` from the project being checked
    try:
        return run_check(args)
    except ParityError as exc:
        if args.debug:
            raise
        print(f"parity: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("parity: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
