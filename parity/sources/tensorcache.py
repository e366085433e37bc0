"""Tensors read by byte range from a hub commit, kept on disk.

huggingface_hub caches whole files only; a check that read three tensors of a 5 GB shard
would fetch them again on every run.  A commit is immutable, so each tensor read from one
is written once under ``$PARITY_CACHE/ranges/<repo>/<commit>/`` and read from there (and
offline) afterwards.  Only pinned commits are cached: a branch name may move.

An entry is trusted only whole and intact: it is written under a temporary name and renamed
into place (an interrupted or failed write leaves nothing under the entry's name, and its
temporary file is removed), and it carries the SHA-256 of the tensor's bytes, checked on
every read.  An entry that does not open, names another tensor or fails the hash is deleted
and the tensor read again.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import time
from collections.abc import Callable
from pathlib import Path

from parity.sources.cache import parity_cache

COMMIT = re.compile(r"[0-9a-f]{40}")
ENTRY_FORMAT = "parity-range-1"  # metadata "parity": what wrote the entry (a changed layout gets a new value)
STALE_TMP_S = 3600  # temporary files older than this are leftovers of a killed run


def ranges_root() -> Path:
    return parity_cache("ranges")


def digest(tensor) -> str:
    """SHA-256 of a tensor's bytes as stored (row-major)."""
    import torch

    flat = tensor.detach().contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy() if flat.numel() else b""
    return hashlib.sha256(memoryview(data)).hexdigest()


class TensorCache:
    """One file per tensor: ``<file name>/<sha256 of the tensor name>.safetensors``."""

    def __init__(self, repo_id: str, commit: str | None):
        self.folder = (ranges_root() / repo_id.replace("/", "--") / commit
                       if commit and COMMIT.fullmatch(commit) else None)

    def _path(self, file_name: str, name: str) -> Path:
        return self.folder / file_name / f"{hashlib.sha256(name.encode()).hexdigest()[:32]}.safetensors"

    def load(self, file_name: str, name: str):
        """The cached tensor, or None (absent; a damaged entry is deleted)."""
        path = self._path(file_name, name)
        if not path.exists():
            return None
        tensor = _verified(path, file_name, name) if path.is_file() else None  # never a FIFO or a folder
        if tensor is None:
            try:
                path.unlink()
            except OSError:
                pass
        return tensor

    def store(self, file_name: str, name: str, tensor) -> None:
        """Write an entry atomically; a read-only or full cache only costs the next run a fetch."""
        from safetensors.torch import save_file

        path = self._path(file_name, name)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tensor = tensor.detach().contiguous()
            save_file({name: tensor}, str(tmp),
                      metadata={"parity": ENTRY_FORMAT, "source": file_name, "sha256": digest(tensor)})
            with open(tmp, "rb") as handle:  # on disk before it gets the entry's name
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except Exception:  # OSError, or safetensors' own error for a failed write
            pass
        finally:  # also on KeyboardInterrupt: no temporary file is left behind
            _remove(tmp)
        _sweep(path.parent)

    def read_through(self, file_name: str, names: list[str], read: Callable[[str, list[str]], dict]) -> dict:
        """Cached tensors from disk, the others through ``read`` (then stored)."""
        if self.folder is None:
            return read(file_name, names)
        out = {}
        for name in dict.fromkeys(names):
            tensor = self.load(file_name, name)
            if tensor is not None:
                out[name] = tensor
        missing = [name for name in dict.fromkeys(names) if name not in out]
        if missing:
            fetched = read(file_name, missing)
            for name in missing:
                self.store(file_name, name, fetched[name])
            out.update(fetched)
        return out


def _verified(path: Path, file_name: str, name: str):
    """The entry's tensor if the entry is whole, is this tensor's, and its bytes hash as recorded; else None."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata() or {}
            if (list(handle.keys()) != [name] or meta.get("parity") != ENTRY_FORMAT
                    or meta.get("source") != file_name):
                return None
            tensor = handle.get_tensor(name)
    except Exception:  # truncated, overwritten, unreadable
        return None
    return tensor if meta.get("sha256") == digest(tensor) else None


def _remove(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


def _sweep(folder: Path) -> None:
    """Remove temporary files a killed run left (never read: only entries' own names are)."""
    try:
        old = time.time() - STALE_TMP_S
        for leftover in folder.glob(".*.tmp"):
            if leftover.stat().st_mtime < old:
                _remove(leftover)
    except OSError:
        pass
