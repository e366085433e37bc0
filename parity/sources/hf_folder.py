"""The Hugging Face layout: config.json next to model.safetensors, or shards listed in
model.safetensors.index.json (what ``save_pretrained`` writes), or one .safetensors file of
such a folder.  Tensors are read with ``safe_open``: only the ones asked for."""

from __future__ import annotations

from pathlib import Path

from parity.definitions.files import shown
from parity.errors import CheckpointError
from parity.sources.checkpoint import Checkpoint
from parity.sources.quantized import dequantizing
from parity.sources.safetensors_files import (
    CONFIG,
    INDEX,
    check_shards,
    local_reader,
    read_json,
    weight_map_from_files,
    weight_map_from_index,
)


def claims(path: Path) -> bool:
    return path.is_dir() or (path.is_file() and path.suffix == ".safetensors")


def open_path(path: Path, allow_pickle: bool = False) -> Checkpoint:
    folder = path if path.is_dir() else path.parent
    config_path = folder / CONFIG
    if path.is_dir() and not any(folder.iterdir()):
        raise CheckpointError(f"{shown(folder)}: the folder is empty; expected a checkpoint: config.json next to "
                              "model.safetensors (or its shards and model.safetensors.index.json), or a .gguf file")
    if not config_path.exists() and not config_path.is_symlink():
        raise CheckpointError(f"{shown(folder)}: no config.json; parity needs the checkpoint's HF config next to its "
                              "weights")
    raw_config = read_json(config_path, "config.json")  # refuses a FIFO, a folder or a device named config.json
    if not path.is_dir():
        weight_map = weight_map_from_files([path])
    elif (folder / INDEX).exists() or (folder / INDEX).is_symlink():
        weight_map = weight_map_from_index(folder / INDEX)
        check_shards(folder / INDEX, weight_map)
    else:
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{shown(folder)}: no *.safetensors weights found (and no {INDEX})")
        weight_map = weight_map_from_files(files)

    def fetch(file_name: str) -> Path:
        file_path = folder / file_name
        if not file_path.is_file():
            raise CheckpointError(f"{shown(file_path)}: listed in {INDEX} but missing on disk")
        return file_path

    checkpoint = Checkpoint(str(path), folder, raw_config, weight_map, fetch, reader=local_reader(fetch))
    return dequantizing(checkpoint, folder)  # quantized weights: dequantized on read
