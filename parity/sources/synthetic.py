"""The embedded default: a checkpoint with the family's real shapes and on-disk format,
built when the default hub checkpoint cannot be reached.

Layout is what ``save_pretrained`` writes for a sharded model (config.json,
model.safetensors.index.json, one shard per layer) so it is read through the very same
path as a downloaded checkpoint.  Only the FFN tensors exist, and a shard is written the
first time it is read: checking one layer of a 7B shape writes one layer.  Values are
seeded per tensor name, so no two tensors (gate and up in particular) hold the same values.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Iterator

from parity.sources.cache import parity_cache
from parity.sources.checkpoint import Checkpoint
from parity.sources.safetensors_files import CONFIG, INDEX, local_reader
from parity.errors import CheckpointError
from parity.spec.mapping import ConfigValue, Mapping

FORMAT_VERSION = 1  # bump when the generated values or layout change


def _seed_for(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def synthetic_checkpoint(mapping: Mapping, reason: str) -> Checkpoint:
    """A synthetic checkpoint in ``mapping``'s family format, under the parity cache folder."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from parity.sources.skeleton import ModelSkeleton, quiet_transformers

    if mapping.synthetic_config is None:
        raise ValueError(f"{mapping.path}: has no [synthetic.config] table")
    raw = dict(mapping.synthetic_config)
    digest = hashlib.sha256(json.dumps([raw, FORMAT_VERSION], sort_keys=True).encode()).hexdigest()[:12]
    folder = parity_cache("synthetic") / f"{mapping.name}-{digest}"
    with _writable(folder):
        folder.mkdir(parents=True, exist_ok=True)
        _write_atomic(folder / CONFIG, json.dumps(raw, indent=2))

    quiet_transformers()
    config = AutoConfig.from_pretrained(str(folder))
    reference = ModelSkeleton(config)
    num_layers = int(ConfigValue(config, mapping.path)(mapping.num_layers, "num_layers"))
    prefix = mapping.key_prefixes[0]
    dtype = getattr(torch, str(raw.get("torch_dtype", "float32")))
    std = float(raw.get("initializer_range", 0.02))

    shards: dict[str, dict[str, tuple[int, ...]]] = {}
    for layer in range(num_layers):
        shapes = reference.tensor_shapes(mapping.reference_path(layer))
        file_name = f"model-{layer + 1:05d}-of-{num_layers:05d}.safetensors"
        shards[file_name] = {f"{prefix}{mapping.layer_prefix(layer)}.{n}": s for n, s in shapes.items()}
    weight_map = {key: file_name for file_name, keys in shards.items() for key in keys}
    with _writable(folder):
        _write_atomic(folder / INDEX, json.dumps({"metadata": {"parity_synthetic": True}, "weight_map": weight_map},
                                                 indent=2))

    def fetch(file_name: str) -> Path:
        path = folder / file_name
        if not path.is_file():
            tensors = {}
            for key, shape in shards[file_name].items():
                generator = torch.Generator().manual_seed(_seed_for(key))
                tensors[key] = (torch.randn(shape, generator=generator) * std).to(dtype)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")  # per process: CI jobs may share the cache
            with _writable(folder):
                save_file(tensors, str(tmp), metadata={"format": "pt"})
                os.replace(tmp, path)
        return path

    return Checkpoint(str(folder), folder, raw, weight_map, fetch, weights="synthetic", weights_note=reason,
                      reader=local_reader(fetch))


@contextlib.contextmanager
def _writable(folder: Path) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        raise CheckpointError(f"{folder}: cannot write the synthetic stand-in checkpoint ({exc.strerror or exc}); "
                              "set PARITY_CACHE to a writable folder, or pass --checkpoint") from None


def _write_atomic(path: Path, text: str) -> None:
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as handle:
        handle.write(text)
    os.replace(handle.name, path)
