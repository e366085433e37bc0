"""Checkpoint access: where each tensor lives, and reading only the tensors asked for.

A ``Checkpoint`` knows its config.json and a map tensor-name -> file.  Files are obtained
through ``fetch`` only when a tensor in them is read: a local folder returns its own
files, the synthetic default writes it.  Reading goes through ``safe_open``, so only the
requested tensors are ever materialised; a hub checkpoint with network instead reads the
byte ranges of those tensors of shards it has not cached (``reader``).
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .errors import CheckpointError, MissingTensorError, PickleRefusedError, UnknownModelError

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
PICKLE_PATTERNS = ("pytorch_model*.bin", "consolidated*.pth", "*.pt", "*.ckpt")


@dataclass
class Checkpoint:
    location: str  # what the reports show: a path, or hub id@revision
    config_dir: Path | None  # folder holding config.json; None: build the config from raw_config (GGUF, Meta)
    raw_config: dict
    weight_map: dict[str, str]  # tensor name -> file name
    fetch: Callable[[str], Path]  # file name -> local path, obtained on first use
    weights: str = "real"  # "real" | "synthetic"
    weights_note: str | None = None
    repo_id: str | None = None  # set for hub checkpoints
    revision: str | None = None
    notes: list[str] = field(default_factory=list)  # how the checkpoint was interpreted (GGUF, Meta), for the report
    # (file name, tensor names in it) -> tensors; None: safe_open on fetch(file name).  The hub
    # sets one that reads byte ranges of shards it has not cached (parity.ranges).
    reader: Callable[[str, list[str]], dict] | None = None

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def closest(self, name: str, n: int = 3) -> list[str]:
        return difflib.get_close_matches(name, list(self.weight_map), n=n, cutoff=0.5)

    def missing_hint(self, names: list[str]) -> str:
        """'name (closest present: a, b)' for each of ``names`` not in the checkpoint."""
        return "; ".join(f"{m} (closest present: {', '.join(self.closest(m)) or 'none'})"
                         for m in names if not self.has(m))

    def require(self, names: list[str]) -> None:
        if not all(self.has(n) for n in names):
            raise MissingTensorError(f"{self.location}: missing tensors: {self.missing_hint(names)}")

    def describe(self, names: list[str]) -> dict[str, tuple[list[int], str]] | None:
        """Shape and stored type of these tensors without reading them, where the format's own
        index holds both (GGUF); None: read them from the safetensors headers instead."""
        return None

    def files_for(self, names: list[str]) -> list[str]:
        return sorted({self.weight_map[n] for n in names})

    def read(self, names: list[str]):
        """Read exactly these tensors (dtype as stored) -> {name: tensor}."""
        self.require(names)
        out = {}
        for file_name in self.files_for(names):
            in_file = [name for name in names if self.weight_map[name] == file_name]
            if self.reader is not None:
                out.update(self.reader(file_name, in_file))
            else:
                out.update(read_safetensors(self.fetch(file_name), in_file))
        return out


def read_safetensors(path: Path, names: list[str]) -> dict:
    """These tensors of one local safetensors file; the file is closed (unmapped) on return."""
    from safetensors import safe_open

    require_regular_file(path)
    try:
        handle = safe_open(str(path), framework="pt")
    except Exception as exc:
        raise unreadable(path, exc) from None
    out = {}
    with handle:
        for name in names:
            try:
                out[name] = handle.get_tensor(name)
            except Exception as exc:
                raise CheckpointError(f"{path}: cannot read tensor '{name}': {exc}") from None
    return out


def read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: {what} not found") from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path}: {what} is not valid JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: {what} must hold a JSON object")
    return data


def weight_map_from_index(index_path: Path) -> dict[str, str]:
    index = read_json(index_path, "safetensors index")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index_path}: has no valid 'weight_map' (tensor name -> shard file)")
    outside = sorted({v for v in weight_map.values() if Path(v).is_absolute() or ".." in Path(v).parts or not v})
    if outside:  # a shard must live in the checkpoint's own folder
        raise CheckpointError(f"{index_path}: 'weight_map' names shard files outside the checkpoint folder: "
                              f"{', '.join(outside[:3])}")
    return weight_map


def weight_map_from_files(files: list[Path]) -> dict[str, str]:
    """Tensor names from safetensors headers (reads only the header of each file).

    Without an index nothing says which of two files holding the same tensor is the
    checkpoint (transformers would load model.safetensors alone): refuse rather than let
    the later file, often a stale copy, silently win.
    """
    from safetensors import safe_open

    weight_map: dict[str, str] = {}
    clashes: dict[tuple[str, str], list[str]] = {}
    for path in files:
        require_regular_file(path)
        try:
            with safe_open(str(path), framework="pt") as handle:
                names = list(handle.keys())
        except Exception as exc:
            raise unreadable(path, exc) from None
        for name in names:
            if name in weight_map:
                clashes.setdefault((weight_map[name], path.name), []).append(name)
            else:
                weight_map[name] = path.name
    if clashes:
        (first, second), names = next(iter(clashes.items()))
        folder = files[0].parent
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        others = f" (and {len(clashes) - 1} other pair(s) of files)" if len(clashes) > 1 else ""
        raise CheckpointError(
            f"{folder}: {first} and {second} both hold tensor(s) {shown}{others}, and there is no {INDEX} to say "
            f"which file is the checkpoint. Remove (or move away) the stray file, add a {INDEX} mapping each "
            f"tensor to its file, or pass the one file to check ({folder / first})"
        )
    return weight_map


def require_regular_file(path: Path) -> None:
    """A FIFO or device named *.safetensors would block the reader forever: refuse it up front."""
    if not path.is_file():
        raise CheckpointError(f"{path}: not a regular file; expected a safetensors file")


def unreadable(path: Path, exc: Exception) -> CheckpointError:
    """The error for a safetensors file that does not open: what exactly is wrong, when we can tell."""
    reason = safetensors_defect(path) or str(exc)
    return CheckpointError(f"{path}: not a readable safetensors file: {reason}; re-download or re-save it")


_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
                "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}


def safetensors_defect(path: Path) -> str | None:
    """Explain a broken safetensors file in words (truncated, garbage header, offsets past the end).

    safetensors' own messages ("incomplete metadata, file not fully covered") do not say
    that the usual cause is an interrupted download.  Reads only the header.
    """
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                return f"the file is {size} bytes, too short for a safetensors header (empty or cut off)"
            length = int.from_bytes(prefix, "little")
            if length > size - 8:
                return (f"the header claims {length} bytes but the file has only {size - 8} after the length field: "
                        "truncated, or not a safetensors file")
            raw = handle.read(length)
    except OSError as exc:
        return f"cannot read it: {exc.strerror or exc}"
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return "its header is not valid JSON (overwritten or corrupted)"
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    data_size = size - 8 - length
    covered = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            start, end = (int(v) for v in info["data_offsets"])
            shape = [int(d) for d in info["shape"]]
            dtype = str(info["dtype"])
        except (TypeError, KeyError, ValueError, OverflowError):
            return f"header entry for tensor '{name}' lacks valid dtype / shape / data_offsets"
        if end > data_size:
            return (f"tensor '{name}' lies at bytes {start}-{end} of the data section, but the file holds only "
                    f"{data_size} data bytes: truncated (an interrupted download?)")
        width = _DTYPE_BYTES.get(dtype)
        if width is not None and end - start != width * _product(shape):
            return (f"tensor '{name}': shape {shape} of {dtype} needs {width * _product(shape)} bytes, "
                    f"but its data_offsets span {end - start}")
        covered = max(covered, end)
    if covered < data_size:
        return f"{data_size - covered} bytes after the last tensor's data belong to no tensor (corrupted or appended to)"
    return None


def _product(shape: list[int]) -> int:
    out = 1
    for dim in shape:
        out *= dim
    return out


def refuse_pickle(folder: Path, pickles: list[str] | None = None) -> None:
    pickles = pickles or [p.name for pattern in PICKLE_PATTERNS for p in sorted(folder.glob(pattern))]
    if pickles:
        raise PickleRefusedError(
            f"{folder}: holds only pickle-based weights ({', '.join(pickles)}). Unpickling can run arbitrary code, "
            "so parity does not open them by default. If you trust the file, pass --allow-pickle "
            "(allow_pickle=True in Python; it is then read with torch.load(weights_only=True)), or convert the "
            "checkpoint to safetensors (model.save_pretrained(..., safe_serialization=True))."
        )


def open_local(path: Path, allow_pickle: bool = False) -> Checkpoint:
    """A local HF folder (config.json + model.safetensors or a sharded index), or one .safetensors file in it.

    A .gguf file, and pickle-based folders/files when ``allow_pickle``, go to their own modules."""
    path = path.expanduser()
    if not path.exists():
        raise UnknownModelError(f"{path}: no such file or folder")
    folder = path if path.is_dir() else path.parent
    if path.is_file() and path.suffix == ".gguf":
        from .gguf_source import open_gguf

        return open_gguf(path)
    if path.is_file() and path.suffix != ".safetensors":
        if path.suffix in (".bin", ".pth", ".pt", ".ckpt"):
            return _open_pickle(path, allow_pickle)
        raise CheckpointError(f"{path}: unsupported file type '{path.suffix}'; expected a .safetensors file or an HF folder")
    config_path = folder / CONFIG
    if not config_path.is_file() and path.is_dir() and not any(folder.glob("*.safetensors")):
        ggufs = sorted(folder.glob("*.gguf"))
        if len(ggufs) == 1:
            return open_local(ggufs[0])
        if any(next(folder.glob(pattern), None) is not None for pattern in PICKLE_PATTERNS):  # a glob is always truthy
            return _open_pickle(folder, allow_pickle)
    if not config_path.is_file():
        raise CheckpointError(f"{folder}: no config.json; parity needs the checkpoint's HF config next to its weights")
    raw_config = read_json(config_path, "config.json")
    if path.is_file():
        weight_map = weight_map_from_files([path])
    elif (folder / INDEX).is_file():
        weight_map = weight_map_from_index(folder / INDEX)
    else:
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            if any(p for pattern in PICKLE_PATTERNS for p in folder.glob(pattern)):
                return _open_pickle(folder, allow_pickle)
            raise CheckpointError(f"{folder}: no *.safetensors weights found")
        weight_map = weight_map_from_files(files)

    def fetch(file_name: str) -> Path:
        file_path = folder / file_name
        if not file_path.is_file():
            raise CheckpointError(f"{file_path}: listed in {INDEX} but missing on disk")
        return file_path

    return Checkpoint(str(path), folder, raw_config, weight_map, fetch)


def _open_pickle(path: Path, allow_pickle: bool) -> Checkpoint:
    folder = path if path.is_dir() else path.parent
    if not allow_pickle:
        refuse_pickle(folder, [path.name] if path.is_file() else None)
    from .pickle_source import open_pickle

    return open_pickle(path)
