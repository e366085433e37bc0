"""Which format a checkpoint is in, and the module that opens it: the one place that knows
every format.  A format is a module in ``parity.sources`` offering ``claims(path)`` (does this
local file or folder hold my format?) and ``open_path(path, allow_pickle)`` (a Checkpoint);
adding one is a module and one row of ``FORMATS`` (CONTRIBUTING.md).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from parity.definitions.files import not_regular, shown
from parity.errors import CheckpointError, UnknownModelError
from parity.sources import gguf, hf_folder, pickled
from parity.sources.checkpoint import Checkpoint


@dataclass(frozen=True)
class Format:
    name: str
    claims: Callable[[Path], bool]
    open_path: Callable[[Path, bool], Checkpoint]  # (path, allow_pickle)


# Tried in order; the HF folder (config.json + safetensors) is the default and comes last.
FORMATS = [
    Format("gguf", gguf.claims, gguf.open_path),
    Format("pickle", pickled.claims, pickled.open_path),
    Format("safetensors", hf_folder.claims, hf_folder.open_path),
]


def open_local(path: Path, allow_pickle: bool = False) -> Checkpoint:
    """A local file or folder, in whichever format claims it."""
    path = path.expanduser()
    try:
        exists = path.exists()
    except OSError as exc:  # a parent folder without permission
        hint = "; check the permissions of its folders" if isinstance(exc, PermissionError) else ""
        raise CheckpointError(f"{shown(path)}: cannot be accessed ({exc.strerror or exc}){hint}") from None
    if not exists:
        raise UnknownModelError(f"{shown(path)}: no such file or folder")
    if not path.is_dir() and not_regular(path) is not None:  # a FIFO would block the reader forever
        raise CheckpointError(f"{shown(path)}: {not_regular(path)}; expected a checkpoint file or folder")
    if path.is_dir() and not os.access(path, os.R_OK | os.X_OK):
        raise CheckpointError(f"{shown(path)}: the folder cannot be read (permission denied); check its permissions")
    try:
        for form in FORMATS:
            if form.claims(path):
                return form.open_path(path, allow_pickle)
        if path.is_file():
            raise CheckpointError(f"{shown(path)}: unsupported file type '{path.suffix}'; expected a .safetensors, "
                                  ".gguf or (with --allow-pickle) .bin/.pth file, or an HF folder")
        return hf_folder.open_path(path, allow_pickle)  # says what the folder lacks
    except OSError as exc:  # permission denied, I/O error, ... on some file of the checkpoint
        where = exc.filename if exc.filename is not None else path
        raise CheckpointError(f"{shown(where)}: cannot read: {exc.strerror or exc}") from None
