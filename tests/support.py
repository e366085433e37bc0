"""What many test modules share: how to run the `parity` command, in this process or as a real one.

Almost every CLI test runs ``parity.cli.main`` in this process (``run_main``, ``run_json``): the same code
without the interpreter start and the torch/transformers import.  A real process (``run_parity``) only where
the process is the point: signals, stdout that is a pipe or a full disk, light imports, interpreter exit; those
tests are marked ``slow``.

A real process goes through ``sys.executable -m parity``, never ``PATH``: the suite must pass when run as
``venv/bin/python -m pytest`` without the venv's ``bin`` on ``PATH``.  A child that a signal test
interrupts gets SIGINT back at its default (``preexec_fn=default_sigint``): a background job or
``nohup`` starts the test process with SIGINT ignored, and a child would inherit that.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

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


def _main(args) -> int:
    """``parity.cli.main(ARGS)``, leaving this process's import state as it found it.

    The command puts the working directory on ``sys.path`` (a target class is imported from the project
    checked, as in a shell).  In a real process that ends with the process; here it would stay for every
    later test, and so would the modules imported from there: a later test's module of the same name in
    another folder would get this one.  Both are undone when the command returns (or raises)."""
    from parity import cli

    path, modules = list(sys.path), set(sys.modules)
    try:
        return cli.main([str(a) for a in args])
    finally:
        added = [os.path.join(p, "") for p in sys.path if p not in path and p]
        sys.path[:] = path
        for name in set(sys.modules) - modules:
            file = getattr(sys.modules.get(name), "__file__", None) or ""
            if added and file.startswith(tuple(added)):
                del sys.modules[name]


def run_main(capsys, *args) -> tuple[int, str, str]:
    """`parity ARGS...` in this process (``parity.cli.main``): (exit code, stdout, stderr).  Almost every CLI
    test runs this way; a real process only where the process is the point (signals, devices, stdout).
    A usage error (argparse) raises SystemExit, as ``parity.cli.main`` does: catch it with pytest.raises and
    read capsys."""
    code = _main(args)
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *args) -> tuple[int, dict | None, str]:
    """`parity ARGS... --json -` in this process: (exit code, the JSON report or None if none, stderr)."""
    code, out, err = run_main(capsys, *args, "--json", "-")
    return code, json.loads(out) if out.strip() else None, err


def compare_json(capsys, a, b) -> tuple[int, dict]:
    """``parity compare A B --json -`` in this process: the exit code and the report, validated against the shipped
    schema."""
    from parity.engine.results import SCHEMA_FILE

    code, out, err = run_main(capsys, "compare", a, b, "--json", "-")
    assert out.strip(), err
    report = json.loads(out)
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(report, json.loads(SCHEMA_FILE.read_text(encoding="utf-8")))
    return code, report


def run_captured(*args) -> tuple[int, str, str]:
    """`parity ARGS...` in this process, without capsys (a module- or session-scoped fixture, which capsys
    cannot serve): (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = _main(args)
    return code, out.getvalue(), err.getvalue()


def cache_repo(home: Path, repo: str, source: Path, commit: str = "0123456789abcdef0123456789abcdef01234567") -> None:
    """``source``'s files laid out in the Hugging Face cache under ``home`` as the hub lays out ``repo`` (owner/name):
    blobs, a snapshot of symlinks to them, refs/main naming the commit."""
    repo_dir = home / "hub" / ("models--" + repo.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    (repo_dir / "blobs").mkdir()
    for file in source.iterdir():
        blob = repo_dir / "blobs" / f"{file.name}.blob"
        shutil.copy(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))


def use_hf_home(monkeypatch, home: Path) -> Path:
    """Point HF_HOME (and HF_HUB_CACHE under it) at ``home`` for this test, in the environment and in
    huggingface_hub's constants, which it reads at import: what a real process started with that environment
    would see.  Every constant under the old HF_HOME moves with it (hub cache, token, xet and assets paths)."""
    from huggingface_hub import constants

    old = os.path.join(constants.HF_HOME, "")
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(home / "hub"))
    for name, value in vars(constants).copy().items():
        if name.isupper() and isinstance(value, str) and value.startswith(old):
            monkeypatch.setattr(constants, name, os.path.join(str(home), value[len(old):]))
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    return home


def offline_home(monkeypatch, tmp_path: Path) -> Path:
    """An empty Hugging Face home and a private synthetic-weights cache (PARITY_CACHE) for this test: nothing
    cached, no network (HF_HUB_OFFLINE=1, the suite's default)."""
    monkeypatch.setenv("PARITY_CACHE", str(tmp_path / "cache"))
    return use_hf_home(monkeypatch, tmp_path / "empty_hf_home")
