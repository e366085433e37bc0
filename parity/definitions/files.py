"""Reading a file a user or a checkpoint names: only a regular file, and only as much as such a file
can sensibly hold.  A FIFO blocks a reader forever, ``/dev/zero`` never ends, a folder is not a
file: each is refused with a message naming the path and what it is.  The file is opened without
blocking and checked on the open descriptor (no window between the check and the read).

Every error is ``error(message)`` of the caller's choosing (MappingError, ProjectConfigError,
CheckpointError, ...), so each front door keeps its own exit code and wording.  No torch here.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

MAX_TEXT_BYTES = 64 * 2**20  # config.json, an index, a mapping or project file: far smaller in practice


def describe_kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def shown(path: str | os.PathLike, limit: int = 4096) -> str:
    """A path as one line of an error message: control characters (a newline in a folder name) escaped, and
    cut at ``limit`` characters (no path is longer than 4096; a longer text is not one)."""
    text = os.fspath(path)
    if len(text) > limit:
        return f"{shown(text[:limit])}... ({len(text)} characters)"
    if text.isprintable():
        return text
    return repr(text)[1:-1]


def one_line(text: str) -> str:
    """A message (or a line of a written file's header) as exactly one printable line: a newline, an ESC or a DEL
    in a path, a lone surrogate of a non-UTF-8 name, each shown as its Python escape."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def short(value: object, limit: int = 60) -> str:
    """A value as a message shows it: its repr, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 3]}... ({len(text)} characters)"


def not_regular(path: Path) -> str | None:
    """Why ``path`` cannot be read as a file (None: it is a regular file, or a symlink to one)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "does not exist"
    except PermissionError:
        return "cannot be accessed (permission denied)"
    except OSError as exc:
        return f"cannot be accessed ({exc.strerror or exc})"
    if stat.S_ISREG(mode):
        return None
    return f"is {describe_kind(mode)}, not a regular file"


def read_bytes(path: Path, what: str, error: Callable[[str], Exception], limit: int = MAX_TEXT_BYTES) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes; anything else raises ``error(message)``."""
    def fail(why: str) -> Exception:
        return error(f"{shown(path)}: {what} {why}")

    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise fail("not found") from None
    except PermissionError:
        raise fail("cannot be read: permission denied (check the file's permissions)") from None
    except OSError as exc:
        raise fail(f"cannot be opened: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise fail(f"is {describe_kind(info.st_mode)}, not a regular file; parity reads only regular files")
        if info.st_size > limit:
            raise fail(f"is {info.st_size} bytes, more than the {limit} such a file can sensibly hold")
        chunks, total = [], 0
        while total <= limit:
            chunk = os.read(fd, min(2**20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > limit:
            raise fail(f"grew past {limit} bytes while being read")
        return b"".join(chunks)
    except OSError as exc:
        raise fail(f"cannot be read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def read_text(path: Path, what: str, error: Callable[[str], Exception], limit: int = MAX_TEXT_BYTES) -> str:
    """``read_bytes`` decoded as UTF-8; undecodable bytes raise ``error`` too."""
    data = read_bytes(path, what, error, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{shown(path)}: {what} is not UTF-8 text (byte {exc.start}: {data[exc.start:exc.start + 1]!r})"
                    ) from None
