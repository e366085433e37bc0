"""The `parity` command.  Light commands (--help, --version, list) import neither torch
nor transformers; exit codes: 0 all layers match, 1 some layer deviates, 2 bad input or
nothing verified, 130 interrupted."""

from __future__ import annotations

import argparse
import os
import sys

from parity.cli.commands import EXIT_BAD_INPUT, list_mappings, run_check, run_inspect, run_project
from parity.cli.options import build_check_parser, build_inspect_parser, build_parser
from parity.errors import ParityError


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

