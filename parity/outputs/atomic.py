"""Writing CI outputs (baseline, --json, --junit, --html, --save-mapping) into exactly what the user named.

Two kinds of destination, two ways of writing:

* A regular file, or a path that does not exist yet: the text goes to a temporary file in the
  same folder and is renamed over the path in one step, so a CI job killed mid-write, or a full
  disk, leaves the previous file intact and no reader ever sees half a file.
* Anything else (``/dev/null``, ``/dev/full``, a FIFO, ``/dev/stdout``, a ``/dev/fd/N`` or
  ``/proc/self/fd/N`` path of a process substitution): written in place, never replaced.  A rename
  over ``/dev/null`` run as root (as CI containers are) would turn the machine's null device into a
  regular file for every later process; a rename over a FIFO leaves its reader waiting forever; and
  ``/dev/stdout`` resolves to ``/proc/PID/fd/pipe:[N]``, which is no path at all.

Every failure (no space, a closed pipe, a read-only folder) is a ParityError naming the option and
the path: a report that could not be written is exit 2, never a silent pass.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import tempfile
from pathlib import Path

from parity.definitions.files import shown
from parity.errors import ParityError, UsageError

# Paths whose entries are descriptors or devices of the running process, whatever os.stat says of them:
# /dev/stdout redirected to a regular file stats as that file, but replacing it would detach the shell's
# redirection (the table printed to stdout would go to a deleted inode).
PROCESS_PATHS = ("/dev/", "/proc/")
STDOUT_PATHS = ("/dev/stdout", "/dev/fd/1", "/proc/self/fd/1")  # this process's stdout, by name


def write_output(path: str | os.PathLike, text: str, what: str, *, create_folder: bool = True) -> None:
    """Write ``text`` (UTF-8) to ``path``: atomically for a regular or new file, in place for a device,
    FIFO or process descriptor path.  ``what`` names the option in the error ('--junit');
    ``create_folder``: make missing parent folders (--json does not: a typo'd folder is an error)."""
    name = os.fspath(path)
    if not name.strip():
        raise UsageError(f"{what} is empty: give a file name (an unset variable in a CI script?)")
    if in_place(Path(name)):
        _write_in_place(Path(name), text, what)
    else:
        _write_atomic(Path(name), text, what, create_folder)


def in_place(path: Path) -> bool:
    """True for a destination that must be written, never replaced: a device, a FIFO, a socket, or a path of
    the process's own descriptors (/dev/stdout, /dev/fd/N, /proc/self/fd/N)."""
    text = os.path.abspath(path)
    if text.startswith(PROCESS_PATHS):
        return path.exists()  # a /dev path that does not exist is a plain (mistaken) new file: the error says so
    try:
        return not stat.S_ISREG(os.stat(path).st_mode)
    except OSError:  # does not exist (or cannot be looked at): a new file, written atomically
        return False


def _write_in_place(path: Path, text: str, what: str) -> None:
    if path.is_dir():
        raise ParityError(f"{what} {shown(path)}: is a folder; give a file name inside it")
    data = text.encode("utf-8", errors="backslashreplace")  # a non-UTF-8 file name in a report: escaped
    if os.path.abspath(path) in STDOUT_PATHS:
        with contextlib.suppress(Exception):  # what parity printed before must come first
            sys.stdout.flush()
    try:
        # append: /dev/stdout redirected to a regular file must keep what was printed before;
        # for devices and pipes it is the same as a plain write
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise _unwritable(what, path, exc.strerror or str(exc)) from None
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
    except OSError as exc:
        raise _unwritable(what, path, exc.strerror or str(exc)) from None
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


def _write_atomic(path: Path, text: str, what: str, create_folder: bool) -> None:
    """Replace ``path`` by ``text`` in one rename; on any failure the old file is untouched and no temporary
    file is left."""
    if path.is_symlink():  # write where the link points, keep the link
        path = path.resolve()
    try:
        if create_folder:
            path.parent.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise _unwritable(what, path, _blocked(path) or exc.strerror or str(exc)) from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8", errors="backslashreplace", newline="\n") as handle:
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
            return None if parent.is_dir() else f"{shown(parent)} is a file, not a folder"
    return None


def _unwritable(what: str, path: Path, reason: str) -> ParityError:
    return ParityError(f"{what} {shown(path)}: cannot write the file ({reason}); "
                       "choose a path in a folder you can write to")
