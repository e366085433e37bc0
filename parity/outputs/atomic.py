"""Writing CI outputs (baseline, --json, --junit) so that no reader ever sees half a file.

A CI job killed mid-write, or a full disk, must leave the previous baseline intact: a
truncated baseline would fail the next run for the wrong reason, or pass it.  The text is
written to a temporary file in the same folder (same file system) and renamed over the
target in one step.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from parity.errors import ParityError


def write_text_atomic(path: str | Path, text: str, what: str, create_folder: bool = True) -> None:
    """Replace ``path`` by ``text`` (UTF-8) in one rename; on any failure the old file is untouched
    and no temporary file is left.  ``what`` names the option or key in the error ('--junit');
    ``create_folder``: make missing parent folders (--json does not: a typo'd folder is an error)."""
    path = Path(path)
    if path.is_symlink():  # write where the link points, keep the link
        path = path.resolve()
    try:
        if create_folder:
            path.parent.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise _unwritable(what, path, _blocked(path) or exc.strerror or str(exc)) from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temp, _mode_for(path))  # mkstemp makes 0600; keep the file as readable as a plain write would
        os.replace(temp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        if isinstance(exc, OSError):
            raise _unwritable(what, path, exc.strerror or str(exc)) from None
        raise


def _mode_for(path: Path) -> int:
    """The existing file's permissions, else what open() would give a new file under the umask."""
    try:
        return path.stat().st_mode & 0o777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _blocked(path: Path) -> str | None:
    """'x is a file, not a folder' when a regular file stands where a parent folder should be
    (the OS says only 'File exists' or 'Not a directory')."""
    for parent in path.parents:
        if parent.exists():
            return None if parent.is_dir() else f"{parent} is a file, not a folder"
    return None


def _unwritable(what: str, path: Path, reason: str) -> ParityError:
    return ParityError(f"{what} {path}: cannot write the file ({reason}); choose a path in a folder you can write to")
