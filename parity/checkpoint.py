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
from dataclasses import dataclass
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
    # (file name, tensor names in it) -> tensors; None: safe_open on fetch(file name).  The hub
    # sets one that reads byte ranges of shards it has not cached (parity.ranges).
    reader: Callable[[str, list[str]], dict] | None = None

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def closest(self, name: str, n: int = 3) -> list[str]:
        return difflib.get_close_matches(name, list(self.weight_map), n=n, cutoff=0.5)

    def files_for(self, names: list[str]) -> list[str]:
        return sorted({self.weight_map[n] for n in names})

    def read(self, names: list[str]):
        """Read exactly these tensors (dtype as stored) -> {name: tensor}."""
        missing = [n for n in names if n not in self.weight_map]
        if missing:
            hints = "; ".join(f"{m} (closest present: {', '.join(self.closest(m)) or 'none'})" for m in missing)
            raise MissingTensorError(f"{self.location}: missing tensors: {hints}")
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

    try:
        handle = safe_open(str(path), framework="pt")
    except Exception as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc}); re-download or re-save it") from None
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
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: {what} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: {what} must hold a JSON object")
    return data


def weight_map_from_index(index_path: Path) -> dict[str, str]:
    index = read_json(index_path, "safetensors index")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index_path}: has no valid 'weight_map' (tensor name -> shard file)")
    return weight_map


def weight_map_from_files(files: list[Path]) -> dict[str, str]:
    """Tensor names from safetensors headers (reads only the header of each file)."""
    from safetensors import safe_open

    weight_map = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                for key in handle.keys():
                    weight_map[key] = path.name
        except Exception as exc:
            raise CheckpointError(f"{path}: not a readable safetensors file ({exc}); re-download or re-save it") from None
    return weight_map


def refuse_pickle(folder: Path) -> None:
    pickles = [p.name for pattern in PICKLE_PATTERNS for p in sorted(folder.glob(pattern))]
    if pickles:
        raise PickleRefusedError(
            f"{folder}: holds only pickle-based weights ({', '.join(pickles)}). Unpickling can run arbitrary code, "
            "so parity does not open them; convert the checkpoint to safetensors "
            "(model.save_pretrained(..., safe_serialization=True))."
        )


def open_local(path: Path) -> Checkpoint:
    """A local HF folder (config.json + model.safetensors or a sharded index), or one .safetensors file in it."""
    path = path.expanduser()
    if not path.exists():
        raise UnknownModelError(f"{path}: no such file or folder")
    folder = path if path.is_dir() else path.parent
    if path.is_file() and path.suffix != ".safetensors":
        if path.suffix in (".bin", ".pth", ".pt", ".ckpt"):
            refuse_pickle(folder)
        raise CheckpointError(f"{path}: unsupported file type '{path.suffix}'; expected a .safetensors file or an HF folder")
    config_path = folder / CONFIG
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
            refuse_pickle(folder)
            raise CheckpointError(f"{folder}: no *.safetensors weights found")
        weight_map = weight_map_from_files(files)

    def fetch(file_name: str) -> Path:
        file_path = folder / file_name
        if not file_path.is_file():
            raise CheckpointError(f"{file_path}: listed in {INDEX} but missing on disk")
        return file_path

    return Checkpoint(str(path), folder, raw_config, weight_map, fetch)
