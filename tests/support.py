"""What many test modules share: how to run the `parity` command as a real process.

Through ``sys.executable -m parity``, never ``PATH``: the suite must pass when run as
``venv/bin/python -m pytest`` without the venv's ``bin`` on ``PATH``.  A child that a signal test
interrupts gets SIGINT back at its default (``preexec_fn=default_sigint``): a background job or
``nohup`` starts the test process with SIGINT ignored, and a child would inherit that.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARITY = [sys.executable, "-m", "parity"]  # the command, as argv; tests never look it up on PATH
OFFLINE = {"HF_HUB_OFFLINE": "1"}


def default_sigint() -> None:
    """preexec_fn of a child that a test sends SIGINT: Python installs its KeyboardInterrupt handler only when
    SIGINT is at its default at start-up, and a background job's children inherit it ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_parity(*args, env: dict | None = None, cwd: Path | str = ROOT, offline: bool = True,
               timeout: float = 600, **options) -> subprocess.CompletedProcess:
    """`parity ARGS...` as a real process (text output captured); offline unless ``offline=False``."""
    full_env = {**os.environ, **(OFFLINE if offline else {}), **(env or {})}
    return subprocess.run([*PARITY, *map(str, args)], capture_output=True, text=True, env=full_env, cwd=cwd,
                          timeout=timeout, **options)


def run_main(capsys, *args) -> tuple[int, str, str]:
    """`parity ARGS...` in this process (``parity.cli.main``): (exit code, stdout, stderr).  Almost every CLI
    test runs this way; a real process only where the process is the point (signals, devices, stdout)."""
    from parity import cli

    code = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err
