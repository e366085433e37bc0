"""The `parity` command.  Light commands (--help, --version, list) import neither torch
nor transformers; exit codes: 0 all layers match, 1 some layer deviates, 2 bad input or
nothing verified, 130 interrupted."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from parity.cli.commands import list_mappings, run_check, run_compare, run_inspect, run_project
from parity.cli.options import build_check_parser, build_compare_parser, build_inspect_parser, build_parser
from parity.cli.reports import EXIT_BAD_INPUT
from parity.definitions.files import one_line
from parity.errors import ParityError


def main(argv: list[str] | None = None) -> int:
    restore = [_lenient(stream) for stream in (sys.stdout, sys.stderr)]
    try:
        return _main(sys.argv[1:] if argv is None else argv)
    finally:
        for undo in restore:
            undo()


def _main(argv: list[str]) -> int:
    try:
        args, run = _parse(argv)
    except SystemExit:  # --help, --version, a usage error: their text must reach a full disk's error too
        _flush_stdout(0)
        raise
    if os.getcwd() not in sys.path:
        # a target class (--target or a mapping's target.class) from the project checked
        sys.path.insert(0, os.getcwd())
    _log_to_stderr()
    previous = _interrupt_once()
    stdout, sys.stdout = sys.stdout, _Guarded(sys.stdout)
    try:
        code = _run(run, args)
    finally:
        sys.stdout = stdout
        if previous is not None and not _SIGNALLED:  # after a real Ctrl-C, later ones stay ignored until exit
            signal.signal(signal.SIGINT, previous)
    return _flush_stdout(code)


def _lenient(stream):
    """Let ``stream`` write what its encoding cannot hold as an escape (errors="backslashreplace") instead of
    failing the run: a file or folder name that is not UTF-8 reaches Python as lone surrogates (``ck\\udcff``),
    which a strict UTF-8 stdout (PYTHONIOENCODING=utf-8:strict, pytest's capture) refuses, and an ASCII one
    refuses the table's own characters.  Changed in place, so every holder of the stream (the progress line,
    _Guarded) gets it; returns the function that puts the old setting back."""
    errors = getattr(stream, "errors", None)
    reconfigure = getattr(stream, "reconfigure", None)
    if reconfigure is None or errors in (None, "backslashreplace"):
        return lambda: None
    try:
        reconfigure(errors="backslashreplace")
    except (OSError, ValueError, TypeError, AttributeError):  # closed, detached, or not a TextIOWrapper after all
        return lambda: None

    def undo() -> None:
        try:
            reconfigure(errors=errors)
        except (OSError, ValueError, TypeError, AttributeError):
            pass

    return undo


def _parse(argv: list[str]):
    if argv[:1] == ["list"]:
        return argparse.Namespace(debug="--debug" in argv), lambda _args: list_mappings()
    if argv[:1] in (["check"], ["inspect"], ["compare"]):
        build, run = {"check": (build_check_parser, run_project),
                      "inspect": (build_inspect_parser, run_inspect),
                      "compare": (build_compare_parser, run_compare)}[argv[0]]
        return build().parse_args(argv[1:]), run
    return build_parser().parse_args(argv), run_check


def _run(run, args: argparse.Namespace) -> int:
    """The command, with every way it can end turned into an exit code and at most one line on stderr."""
    try:
        return run(args)
    except ParityError as exc:
        if args.debug:
            raise
        print(f"parity: error: {one_line(str(exc))}", file=sys.stderr)
        return exc.exit_code
    except StdoutError as exc:
        return _stdout_failed(exc.__cause__ or exc, EXIT_BAD_INPUT)
    except KeyboardInterrupt:  # from Ctrl-C, later ones are ignored (_interrupt_once): no traceback at exit
        print("parity: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug in parity (or in a library it calls): one line, not a traceback
        if args.debug:
            raise
        print(f"parity: internal error ({type(exc).__name__}: {one_line(' '.join(str(exc).split()))}); please "
              "report it, and rerun with --debug to see the traceback", file=sys.stderr)
        return EXIT_BAD_INPUT


_SIGNALLED = False


class _StderrLines(logging.Handler):
    """parity's log records (``logging.getLogger("parity")``: a fallback taken, a file re-downloaded) as lines on
    whatever sys.stderr is when they come: the sources layer never prints."""

    def emit(self, record: logging.LogRecord) -> None:
        print(self.format(record), file=sys.stderr)


def _log_to_stderr() -> None:
    logger = logging.getLogger("parity")
    if not any(isinstance(handler, _StderrLines) for handler in logger.handlers):
        logger.addHandler(_StderrLines())
    logger.setLevel(logging.INFO)


def _interrupt_once():
    """Turn the first SIGINT into KeyboardInterrupt and ignore any that follow: a second Ctrl-C (``timeout``
    and process managers send more than one) would otherwise interrupt the exit itself and print an
    "Exception ignored in atexit callback" traceback.  Returns the previous handler, to restore; None where
    signals cannot be set (not the main thread, or a handler someone else installed)."""
    def first(_signum, _frame):
        global _SIGNALLED
        _SIGNALLED = True
        _ignore_interrupts()
        raise KeyboardInterrupt

    try:
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return None
        return signal.signal(signal.SIGINT, first)
    except ValueError:
        return None


def _ignore_interrupts() -> None:
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread
        pass


class StdoutError(Exception):
    """Writing to stdout failed (a full disk, a closed pipe): the run cannot report, which is not a parity bug."""


class _Guarded:
    """sys.stdout while a command runs: a failed write raises StdoutError (told apart from any other OSError)."""

    def __init__(self, inner):
        self._inner = inner

    def write(self, text: str) -> int:
        try:
            return self._inner.write(text)
        except OSError as exc:
            raise StdoutError(str(exc)) from exc

    def flush(self) -> None:
        try:
            self._inner.flush()
        except OSError as exc:
            raise StdoutError(str(exc)) from exc

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


def _flush_stdout(code: int) -> int:
    """Flush stdout now, while an error can still be reported: at exit, a full disk (``parity list > /dev/full``)
    or a closed pipe would print a traceback."""
    try:
        sys.stdout.flush()
        return code
    except OSError as exc:
        return _stdout_failed(exc, code or EXIT_BAD_INPUT)


def _stdout_failed(exc: BaseException, code: int) -> int:
    """Say so on stderr, and point stdout at /dev/null so the interpreter's own flush at exit succeeds."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no file descriptor (an in-process capture)
        pass
    reason = getattr(exc, "strerror", None) or str(exc)
    print(f"parity: error: cannot write to standard output: {reason}", file=sys.stderr)
    return code
