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
import math
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

from parity.definitions.mapping import ConfigValue, Mapping
from parity.errors import CheckpointError
from parity.sources.cache import parity_cache
from parity.sources.checkpoint import Checkpoint
from parity.sources.config_check import check_activation, check_config_values, int_problem, short
from parity.sources.safetensors_files import CONFIG, INDEX, describe_defect, local_reader

FORMAT_VERSION = 1  # bump when the generated values or layout change
MAX_LAYERS = 1024  # a stand-in's layer count (the largest models have under 200)
SHARD_BUDGET_BYTES = 8 * 2**30  # one layer's FFN weights (Mixtral 8x7B: 2.8 GB in bf16)


def _seed_for(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def synthetic_checkpoint(mapping: Mapping, reason: str) -> Checkpoint:
    """A synthetic checkpoint in ``mapping``'s family format, under the parity cache folder."""
    from parity.sources.skeleton import ModelSkeleton

    if mapping.synthetic_config is None:
        raise CheckpointError(f"{mapping.path}: has no [synthetic.config] table to build a stand-in from")
    raw = dict(mapping.synthetic_config)
    where = f"{mapping.path}: [synthetic.config]"
    check_config_values(raw, where, MAX_LAYERS)
    check_activation(raw, where)
    digest = hashlib.sha256(json.dumps([raw, FORMAT_VERSION], sort_keys=True).encode()).hexdigest()[:12]
    folder = parity_cache("synthetic") / f"{re.sub(r'[^A-Za-z0-9._-]', '_', mapping.name)}-{digest}"
    with _writable(folder):
        folder.mkdir(parents=True, exist_ok=True)
        _write_atomic(folder / CONFIG, json.dumps(raw, indent=2))
    config = _config(folder, where)
    reference = ModelSkeleton(config)
    num_layers = ConfigValue(config, mapping.path)(mapping.num_layers, "num_layers")
    why = int_problem(num_layers, 1, MAX_LAYERS)
    if why is not None:
        raise CheckpointError(f"{where}: gives num_layers = {short(num_layers)}: {why}")
    prefix = mapping.key_prefixes[0]
    shards: dict[str, dict[str, tuple[int, ...]]] = {}
    for layer in range(num_layers):
        shapes = reference.tensor_shapes(mapping.reference_path(layer))
        file_name = f"model-{layer + 1:05d}-of-{num_layers:05d}.safetensors"
        shards[file_name] = {f"{prefix}{mapping.layer_prefix(layer)}.{n}": s for n, s in shapes.items()}
    weight_map = {key: file_name for file_name, keys in shards.items() for key in keys}
    with _writable(folder):
        _write_atomic(folder / INDEX, json.dumps({"metadata": {"parity_synthetic": True}, "weight_map": weight_map},
                                                 indent=2))
    write = _shard_writer(folder, shards, _dtype(raw, where), float(raw.get("initializer_range", 0.02)))
    return Checkpoint(str(folder), folder, raw, weight_map, write, weights="synthetic", weights_note=reason,
                      reader=local_reader(write))


def _config(folder: Path, where: str):
    from transformers import AutoConfig

    from parity.sources.skeleton import quiet_transformers

    quiet_transformers()
    try:
        return AutoConfig.from_pretrained(str(folder))
    except Exception as exc:  # transformers raises many types for unusable configs
        raise CheckpointError(f"{where}: transformers cannot load it: {type(exc).__name__}: {exc}") from None


def _dtype(raw: dict, where: str):
    import torch

    name = raw.get("torch_dtype", "float32")
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise CheckpointError(f"{where}: torch_dtype = {short(name)} is not a torch float dtype "
                              "(\"bfloat16\", \"float16\", \"float32\")")
    return dtype


def _shard_writer(folder: Path, shards: dict[str, dict[str, tuple[int, ...]]], dtype, std: float):
    """``fetch`` for the synthetic checkpoint: a shard is written the first time it is read, atomically (a
    temporary file renamed into place, removed if anything interrupts the write), and a shard found
    damaged (by a disk that filled up, or a hand) is written again rather than trusted."""
    import torch

    def fetch(file_name: str) -> Path:
        from safetensors.torch import save_file

        path = folder / file_name
        if path.is_file() and describe_defect(path) is None:
            return path
        budget = sum(math.prod(shape) for shape in shards[file_name].values()) * dtype.itemsize
        if budget > SHARD_BUDGET_BYTES:
            raise CheckpointError(f"{folder}: the synthetic shard {file_name} would hold {budget} bytes, more than "
                                  f"{SHARD_BUDGET_BYTES}; pass --checkpoint to check real weights")
        tensors = {}
        for key, shape in shards[file_name].items():
            generator = torch.Generator().manual_seed(_seed_for(key))
            tensors[key] = (torch.randn(shape, generator=generator) * std).to(dtype)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # per process: CI jobs may share the cache
        try:
            with _writable(folder):
                save_file(tensors, str(tmp), metadata={"format": "pt"})
                os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return path

    return fetch


@contextlib.contextmanager
def _writable(folder: Path) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        raise CheckpointError(f"{folder}: cannot write the synthetic stand-in checkpoint ({exc.strerror or exc}); "
                              "set PARITY_CACHE to a writable folder, or pass --checkpoint") from None


def _write_atomic(path: Path, text: str) -> None:
    """The whole text or nothing: written to a temporary file beside ``path``, then renamed over it."""
    handle = tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp", encoding="utf-8")
    try:
        with handle:
            handle.write(text)
        os.replace(handle.name, path)
    finally:
        Path(handle.name).unlink(missing_ok=True)
