"""GGUF files (llama.cpp) as a checkpoint format: a Checkpoint whose ``read`` dequantizes only the tensors
asked for (``gguf.quants.dequantize``; rows come out in HF's ``[out, in]`` layout), and the transformers config
the metadata stands for.

GGUF names no activation and no transformers class: both follow from ``general.architecture``, which
``gguf_config`` translates into a transformers config.  The header itself is read by ``gguf_header``; the names of a
layer's FFN tensors come from gguf's own name map (``engine.layout.gguf``) or a mapping file.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

from parity.definitions.files import shown
from parity.errors import CheckpointError
from parity.sources.checkpoint import Checkpoint
from parity.sources.gguf_config import config_from_metadata
from parity.sources.gguf_header import (
    GGUFHeader,
    TensorInfo,
    gguf_version,
    qtype_name,
    read_header,
    tensor_info,
)


def dequantize(path: Path, info: TensorInfo):
    """One tensor as float32 torch, read from its offset and dequantized by gguf."""
    import numpy as np
    import torch
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize
    from gguf.quants import quant_shape_to_byte_shape

    try:
        qtype = GGMLQuantizationType(info.qtype)
    except ValueError:
        raise CheckpointError(f"{path}: tensor '{info.name}' has GGML type {info.qtype}, unknown to gguf "
                              "(upgrade the gguf package)") from None
    tensor_info(path, info.name, info.dims, info.qtype, info.offset, 0, 2**64)  # dims and block size, as at open
    with open(path, "rb") as handle:
        if info.offset + info.nbytes() > os.fstat(handle.fileno()).st_size:  # checked before allocating
            raise CheckpointError(f"{shown(path)}: tensor '{info.name}' runs past the end of the file; re-download it")
        data = bytearray(info.nbytes())
        handle.seek(info.offset)
        if handle.readinto(data) != len(data):
            raise CheckpointError(f"{shown(path)}: tensor '{info.name}' runs past the end of the file; re-download it")
    raw = np.frombuffer(data, dtype=np.uint8).reshape(quant_shape_to_byte_shape(info.shape, qtype))
    try:
        values = gguf_dequantize(raw, qtype)
    except NotImplementedError:
        raise CheckpointError(f"{path}: tensor '{info.name}' is stored as {qtype.name}, which gguf "
                              f"{gguf_version()} cannot dequantize; use a file quantized to another type") from None
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(info.shape)


class GGUFCheckpoint(Checkpoint):
    """Same interface as Checkpoint (has/read/closest/weight_map/raw_config); ``read`` dequantizes."""

    def __init__(self, header: GGUFHeader, raw_config: dict, notes: list[str]):
        path = header.path
        super().__init__(str(path), None, raw_config, {name: path.name for name in header.tensors}, lambda _: path)
        self.header = header
        self.notes = notes

    def describe(self, names: list[str]) -> dict[str, tuple[list[int], str]]:
        self.require(names)
        return {n: (list(self.header.tensors[n].shape), qtype_name(self.header.tensors[n].qtype)) for n in names}

    def read(self, names: list[str]):
        self.require(names)
        return {name: dequantize(self.header.path, self.header.tensors[name]) for name in names}


def open_gguf(path: Path) -> GGUFCheckpoint:
    """A .gguf file as a checkpoint: config from its metadata, tensors dequantized on read."""
    path = path.expanduser()
    header = read_header(path)
    split = header.metadata.get("split.count")
    if isinstance(split, int) and split > 1:
        raise CheckpointError(f"{shown(path)}: is one of {split} split GGUF files; merge them first "
                              "(llama-gguf-split --merge FIRST.gguf merged.gguf)")
    raw_config, notes = config_from_metadata(header)
    types = Counter(qtype_name(info.qtype) for name, info in header.tensors.items() if ".ffn_" in name)
    notes.append("GGUF FFN tensor types: " + ", ".join(f"{t} ({n})" for t, n in types.most_common())
                 + "; target and reference both get the same dequantized float32 weights")
    weighted = importance_matrix(header.metadata)
    if weighted is not None:
        notes.append(f"GGUF quantized with an importance matrix ({weighted}): llama.cpp's importance-weighted "
                     "quantizer moves values of little importance several steps and refits each block's scale, so "
                     "a compare holds the tensors of the types it weights (not Q8_0) to wider per-value and grid "
                     "bounds, B's least-squares scale on A near 1, and its layer's function")
    return GGUFCheckpoint(header, raw_config, notes)


def importance_matrix(metadata: dict) -> str | None:
    """What B's metadata says of the importance matrix it was quantized with, in words, or None when it names none.
    llama-quantize records ``quantize.imatrix.file`` (with ``.dataset``, ``.chunks_count``, ``.entries_count``) when
    given ``--imatrix``; its quantizers then weigh each value's error by that matrix (llama.cpp's ggml-quants.c)."""
    keys = {key.removeprefix("quantize.imatrix."): value for key, value in metadata.items()
            if key.startswith("quantize.imatrix.")}
    if not keys:
        return None
    said = [f"{name} {keys[name]!r}" for name in ("file", "dataset") if isinstance(keys.get(name), str)]
    if isinstance(keys.get("chunks_count"), int):
        said.append(f"{keys['chunks_count']} chunks")
    return "quantize.imatrix: " + (", ".join(said) or ", ".join(sorted(keys)))


def claims(path: Path) -> bool:
    """A .gguf file, or a folder holding exactly one .gguf and no HF checkpoint."""
    if path.is_file():
        return path.suffix == ".gguf"
    return (path.is_dir() and not (path / "config.json").is_file() and not any(path.glob("*.safetensors"))
            and len(list(path.glob("*.gguf"))) == 1)


def open_path(path: Path, allow_pickle: bool = False) -> GGUFCheckpoint:
    return open_gguf(path if path.is_file() else next(path.glob("*.gguf")))
