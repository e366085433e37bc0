"""Where a run's outputs go, checked before anything is computed: never onto one of the run's own inputs (its
checkpoint, mapping, project file, the baseline it compares with), never two outputs onto one file, and only
into a folder that can be written.

A `--json m.toml` typed for `--mapping m.toml`, or `--html model.safetensors`, would replace the user's file
with a report; two outputs on one path would leave only the last one; and a folder that cannot be written is
found out after minutes of computing, when the other reports already claim the run.  No torch here.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from parity.definitions.files import shown
from parity.errors import DestinationError
from parity.outputs.atomic import in_place


def check_destinations(outputs: dict[str, str | None], inputs: Iterable[tuple[str, str | None]]) -> None:
    """``outputs``: option -> path (None: not given; '-': stdout); ``inputs``: (what, path) of every file or folder
    the run reads.  Raises DestinationError (exit 2) naming both sides."""
    given = {option: Path(path) for option, path in outputs.items() if path and path != "-"}
    files = {option: path for option, path in given.items() if not in_place(path)}  # devices, FIFOs: written in place
    seen: dict[str, str] = {}
    for option, path in files.items():
        key = os.path.realpath(path)
        if key in seen:
            raise DestinationError(f"{seen[key]} and {option} both name {shown(path)}: one would overwrite the other; "
                                   "give each output its own file")
        seen[key] = option
    for what, source in inputs:
        if not source:
            continue
        source_path = Path(source).expanduser()
        if not source_path.exists():
            continue
        real = os.path.realpath(source_path)
        for option, path in files.items():
            target = os.path.realpath(path)
            inside = source_path.is_dir() and (target + os.sep).startswith(real.rstrip(os.sep) + os.sep)
            same = target == real or (path.exists() and os.path.samefile(path, source_path))  # a hard link too
            if same or inside:
                where = "is" if same else "is inside"
                raise DestinationError(f"{option} {shown(path)} {where} the run's {what} ({shown(source)}): writing "
                                       "the report there would destroy it; write reports elsewhere")
    for option, path in files.items():
        problem = unwritable(path, create_folder=option not in ("--json", "--save-mapping"))
        if problem:
            raise DestinationError(f"{option} {shown(path)}: {problem}; choose a path in a folder you can write to "
                                   "(checked before computing anything)")


def unwritable(path: Path, *, create_folder: bool) -> str | None:
    """Why a report could not be written at ``path`` (None: it can be, as far as the file system says now)."""
    if path.is_dir():
        return "is a folder; give a file name inside it"
    folder = path.parent
    if not folder.exists():
        if not create_folder:
            return f"the folder {shown(folder)} does not exist"
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
    if not folder.is_dir():
        return f"{shown(folder)} is a file, not a folder"
    if not os.access(folder, os.W_OK | os.X_OK):  # a regular file is replaced by a rename: the folder decides
        return f"the folder {shown(folder)} cannot be written"
    return None
