"""Tensors read by byte range from a hub commit, kept on disk.

huggingface_hub caches whole files only; a check that read three tensors of a 5 GB shard
would fetch them again on every run.  A commit is immutable, so each tensor read from one
is written once under ``$PARITY_CACHE/ranges/<repo>/<commit>/`` and read from there (and
offline) afterwards.  Only pinned commits are cached: a branch name may move.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Callable

from parity.sources.cache import parity_cache

COMMIT = re.compile(r"[0-9a-f]{40}")


def ranges_root() -> Path:
    return parity_cache("ranges")


class TensorCache:
    """One file per tensor: ``<file name>/<sha256 of the tensor name>.safetensors``."""

    def __init__(self, repo_id: str, commit: str | None):
        self.folder = ranges_root() / repo_id.replace("/", "--") / commit if commit and COMMIT.fullmatch(commit) else None

    def _path(self, file_name: str, name: str) -> Path:
        return self.folder / file_name / f"{hashlib.sha256(name.encode()).hexdigest()[:32]}.safetensors"

    def read_through(self, file_name: str, names: list[str], read: Callable[[str, list[str]], dict]) -> dict:
        """Cached tensors from disk, the others through ``read`` (then stored)."""
        if self.folder is None:
            return read(file_name, names)
        from safetensors.torch import load_file, save_file

        out, missing = {}, []
        for name in names:
            path = self._path(file_name, name)
            try:
                out[name] = load_file(str(path))[name]
            except Exception:  # absent, or a torn write: fetch again
                missing.append(name)
        if missing:
            fetched = read(file_name, missing)
            for name, tensor in fetched.items():
                path = self._path(file_name, name)
                try:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    tmp = path.with_suffix(f".{os.getpid()}.tmp")
                    save_file({name: tensor.contiguous()}, str(tmp), metadata={"source": file_name})
                    os.replace(tmp, path)
                except OSError:  # a read-only or full cache only costs the next run a fetch
                    pass
            out.update(fetched)
        return out
