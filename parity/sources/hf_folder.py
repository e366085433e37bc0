"""The Hugging Face layout: config.json next to model.safetensors, or shards listed in
model.safetensors.index.json (what ``save_pretrained`` writes), or one .safetensors file of
such a folder.  Tensors are read with ``safe_open``: only the ones asked for."""

from __future__ import annotations

from pathlib import Path

from parity.errors import CheckpointError
from parity.sources.checkpoint import Checkpoint
from parity.sources.safetensors_files import CONFIG, INDEX, local_reader, read_json, weight_map_from_files, weight_map_from_index


def claims(path: Path) -> bool:
    return path.is_dir() or (path.is_file() and path.suffix == ".safetensors")


def open_path(path: Path, allow_pickle: bool = False) -> Checkpoint:
    folder = path if path.is_dir() else path.parent
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
            raise CheckpointError(f"{folder}: no *.safetensors weights found")
        weight_map = weight_map_from_files(files)

    def fetch(file_name: str) -> Path:
        file_path = folder / file_name
        if not file_path.is_file():
            raise CheckpointError(f"{file_path}: listed in {INDEX} but missing on disk")
        return file_path

    return Checkpoint(str(path), folder, raw_config, weight_map, fetch, reader=local_reader(fetch))
