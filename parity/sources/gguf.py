"""GGUF files (llama.cpp): a Checkpoint whose ``read`` dequantizes only the tensors asked for.

gguf's ``GGUFReader`` builds numpy views of every array item when it opens a file: about
10 s for a 262k-token vocabulary, to check a layer that needs three tensors.  parity needs a
dozen metadata scalars and the tensor directory, so it walks the header itself, skipping
array payloads by their lengths (strings are never decoded), then reads a tensor's bytes
from its offset and dequantizes them with ``gguf.quants.dequantize`` (rows come out in
HF's ``[out, in]`` layout).

GGUF names no activation and no transformers class: both follow from
``general.architecture``, which ARCHITECTURES translates into a transformers config.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parity.errors import CheckpointError
from parity.sources.checkpoint import Checkpoint
from parity.sources.config_check import MAX_EXPERTS, MAX_LENGTH, MAX_WIDTH, float_problem, int_problem
from parity.sources.config_check import short as _short
from parity.spec.files import not_regular, shown

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
SMALL_ARRAY = 4096  # numeric arrays up to this length are kept (per-layer sizes); longer ones only counted
MAX_ARRAY_DEPTH = 8  # arrays of arrays nested deeper than this are refused (llama.cpp writes at most 2)
MAX_DIMS = 4  # GGML_MAX_DIMS

# GGUFValueType -> struct format of one scalar (8 = string, 9 = array are handled apart)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9

# HF-style config keys, shared by the LLaMA-like families
_HF_KEYS = {
    "embedding_length": "hidden_size", "feed_forward_length": "intermediate_size",
    "block_count": "num_hidden_layers", "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads", "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "context_length": "max_position_embeddings", "attention.key_length": "head_dim",
    "attention.sliding_window": "sliding_window", "expert_count": "num_local_experts",
    "expert_used_count": "num_experts_per_tok",
}
_GPT2_KEYS = {
    "embedding_length": "n_embd", "feed_forward_length": "n_inner", "block_count": "n_layer",
    "attention.head_count": "n_head", "context_length": "n_positions",
    "attention.layer_norm_epsilon": "layer_norm_epsilon",
}


@dataclass(frozen=True)
class Architecture:
    model_type: str  # transformers model_type of the equivalent HF checkpoint
    activation_key: str  # the config attribute that names the activation
    activation: str  # what llama.cpp runs for this architecture (GGUF stores no activation name)
    keys: dict[str, str]  # GGUF "{arch}.KEY" -> transformers config attribute
    moe_model_type: str | None = None  # model_type when the file has experts (expert_count > 0)


ARCHITECTURES = {
    "llama": Architecture("llama", "hidden_act", "silu", _HF_KEYS, moe_model_type="mixtral"),  # also Mistral
    "qwen2": Architecture("qwen2", "hidden_act", "silu", _HF_KEYS),
    "gemma": Architecture("gemma", "hidden_act", "gelu_pytorch_tanh", _HF_KEYS),
    "gemma2": Architecture("gemma2", "hidden_activation", "gelu_pytorch_tanh", _HF_KEYS),
    "gemma3": Architecture("gemma3_text", "hidden_activation", "gelu_pytorch_tanh", _HF_KEYS),
    "gpt2": Architecture("gpt2", "activation_function", "gelu_new", _GPT2_KEYS),
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order: dims[0] is the row length (the fastest-varying axis)
    qtype: int  # GGMLQuantizationType value
    offset: int  # absolute offset in the file

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy/torch shape: GGUF's dims reversed ([out, in] for a weight matrix)."""
        return tuple(reversed(self.dims))

    def nbytes(self) -> int:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(self.qtype)]
        return math.prod(self.dims) // block * size


@dataclass(frozen=True)
class ArrayInfo:
    """A long array in the metadata, of which only the length is kept (e.g. the token list)."""

    item_type: int
    count: int


@dataclass
class GGUFHeader:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo] = field(default_factory=dict)


class _Cursor:
    """Reads the header; every length or count the file claims is checked against the bytes it holds
    before anything is skipped, allocated or looped over."""

    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def fail(self, what: str) -> CheckpointError:
        return CheckpointError(f"{shown(self.path)}: {what}; the file is corrupt or not a GGUF file a llama.cpp "
                               "converter wrote: re-download or re-convert it")

    def take(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        except struct.error:
            raise CheckpointError(f"{shown(self.path)}: truncated GGUF header (at byte {self.pos}); "
                                  "re-download the file") from None
        self.pos += struct.calcsize(fmt)
        return value

    def skip(self, length: int, what: str) -> int:
        """Move past ``length`` bytes the file says follow; returns where they start."""
        start = self.pos
        if length > len(self.buf) - start:
            raise CheckpointError(f"{shown(self.path)}: truncated GGUF header ({what} at byte {start} claims {length} "
                                  f"bytes, the file has {len(self.buf) - start} left); re-download the file")
        self.pos += length
        return start

    def count(self, claimed: int, item_bytes: int, what: str) -> int:
        """A number of items the file claims, each at least ``item_bytes`` long: no more than the file can hold."""
        if claimed * item_bytes > len(self.buf) - self.pos:
            raise self.fail(f"{what} claims {claimed} items at byte {self.pos}, more than the "
                            f"{len(self.buf) - self.pos} bytes left can hold")
        return claimed

    def string(self, decode: bool = True) -> str | None:
        start = self.skip(self.take("Q"), "a string")
        return bytes(self.buf[start:self.pos]).decode("utf-8", errors="replace") if decode else None

    def value(self, vtype: int, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            return self.array(depth)
        raise self.fail(f"unknown GGUF value type {vtype} at byte {self.pos}")

    def array(self, depth: int) -> Any:
        if depth >= MAX_ARRAY_DEPTH:
            raise self.fail(f"metadata arrays nested more than {MAX_ARRAY_DEPTH} deep (at byte {self.pos})")
        item_type = self.take("I")
        if item_type == _STRING:  # skipped by length, never decoded: the 262k-token vocabulary
            count = self.count(self.take("Q"), 8, "a string array")
            for _ in range(count):
                self.skip(self.take("Q"), "a string in an array")
            return ArrayInfo(item_type, count)
        if item_type in _SCALARS:
            size = struct.calcsize(_SCALARS[item_type])
            count = self.count(self.take("Q"), size, "an array")
            if count > SMALL_ARRAY:
                self.skip(size * count, "an array")
                return ArrayInfo(item_type, count)
            return [self.take(_SCALARS[item_type]) for _ in range(count)]
        if item_type == _ARRAY:  # arrays of arrays: rare and small
            count = self.count(self.take("Q"), 12, "an array of arrays")
            return [self.array(depth + 1) for _ in range(count)]
        raise self.fail(f"unknown GGUF array item type {item_type} at byte {self.pos}")


def read_header(path: Path) -> GGUFHeader:
    """Metadata and tensor directory of a GGUF file, without touching the tensor data."""
    why = not_regular(path)
    if why is not None:
        raise CheckpointError(f"{shown(path)}: {why}; expected a .gguf file")
    try:
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(buf, path)
    except (OSError, ValueError) as exc:  # mmap of an empty file raises ValueError
        raise CheckpointError(f"{shown(path)}: cannot read GGUF file: {exc}") from None


def _parse(buf, path: Path) -> GGUFHeader:
    if bytes(buf[:4]) != MAGIC:
        raise CheckpointError(f"{shown(path)}: not a GGUF file (magic {bytes(buf[:4])!r}, expected b'GGUF')")
    cursor = _Cursor(buf, path)
    cursor.pos = 4
    version = cursor.take("I")
    if version & 0xFFFF == 0 and version:
        raise CheckpointError(f"{shown(path)}: big-endian GGUF files are not supported; convert it on a "
                              "little-endian machine")
    if version not in (2, 3):
        raise CheckpointError(f"{shown(path)}: GGUF version {version} is not supported (2 and 3 are); "
                              "re-convert it with a current llama.cpp")
    n_tensors, n_kv = cursor.take("Q"), cursor.take("Q")
    metadata = {}
    for _ in range(cursor.count(n_kv, 13, "the metadata count")):  # key length, type, one byte at least
        key = cursor.string()
        metadata[key] = cursor.value(cursor.take("I"))
    infos = []
    for _ in range(cursor.count(n_tensors, 32, "the tensor count")):  # name length, n_dims, a dim, type, offset
        name = cursor.string()
        n_dims = cursor.take("I")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cursor.fail(f"tensor '{name}' claims {n_dims} dimensions (GGUF tensors have 1 to {MAX_DIMS})")
        dims = tuple(cursor.take("Q") for _ in range(n_dims))
        infos.append((name, dims, cursor.take("I"), cursor.take("Q")))
    alignment = _alignment(metadata, path)
    data_start = (cursor.pos + alignment - 1) // alignment * alignment
    header = GGUFHeader(path, version, metadata)
    for name, dims, qtype, offset in infos:
        header.tensors[name] = _tensor(path, name, dims, qtype, offset, data_start, len(buf))
    return header


def _alignment(metadata: dict[str, Any], path: Path) -> int:
    """general.alignment: a power of two (llama.cpp's own rule); 0 would divide by zero."""
    value = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1) or value > 2**16:
        raise CheckpointError(f"{shown(path)}: GGUF metadata 'general.alignment' = {_short(value)} is not a power of "
                              f"two between 1 and {2**16}; the file is corrupt: re-download or re-convert it")
    return value


def _tensor(path: Path, name: str, dims: tuple[int, ...], qtype: int, offset: int, data_start: int,
            size: int) -> TensorInfo:
    """A tensor directory entry whose dims, block size and bytes fit in the file (checked before any read)."""
    info = TensorInfo(name, dims, qtype, data_start + offset)
    if any(d < 1 for d in dims):
        raise CheckpointError(f"{shown(path)}: GGUF tensor '{name}' has dims {list(dims)}; every dimension must be "
                              "at least 1: the file is corrupt, re-download or re-convert it")
    block = _block(qtype)
    if block is None:
        return info  # a type gguf does not know: refused if it is ever read (dequantize)
    if dims[0] % block[0]:
        raise CheckpointError(f"{shown(path)}: GGUF tensor '{name}' is {_qtype_name(qtype)} with rows of {dims[0]} "
                              f"values, not a multiple of its block size {block[0]}: the file is corrupt, "
                              "re-download or re-convert it")
    end = info.offset + info.nbytes()
    if end > size:
        raise CheckpointError(f"{shown(path)}: GGUF tensor '{name}' ({_qtype_name(qtype)}, dims {list(dims)}) claims "
                              f"bytes {info.offset}-{end}, but the file has only {size} bytes: truncated or corrupt; "
                              "re-download the file")
    return info


def _block(qtype: int) -> tuple[int, int] | None:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    except (ValueError, KeyError):
        return None


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
    _tensor(path, info.name, info.dims, info.qtype, info.offset, 0, 2**64)  # dims and block size, as at open
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
                              f"{_gguf_version()} cannot dequantize; use a file quantized to another type") from None
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
        return {n: (list(self.header.tensors[n].shape), _qtype_name(self.header.tensors[n].qtype)) for n in names}

    def read(self, names: list[str]):
        self.require(names)
        return {name: dequantize(self.header.path, self.header.tensors[name]) for name in names}


def config_from_metadata(header: GGUFHeader) -> tuple[dict, list[str]]:
    """The equivalent transformers config.json (as a dict) and notes on how it was derived."""
    meta = header.metadata
    arch_name = meta.get("general.architecture")
    if not isinstance(arch_name, str):
        raise CheckpointError(f"{shown(header.path)}: GGUF metadata has no 'general.architecture' string; is it a "
                              "model file?")
    arch = ARCHITECTURES.get(arch_name)
    if arch is None:
        raise CheckpointError(
            f"{shown(header.path)}: GGUF architecture {_short(arch_name)} is not supported; supported: "
            f"{', '.join(ARCHITECTURES)}. Convert the original Hugging Face checkpoint instead (parity FOLDER)."
        )
    for required in ("block_count", "embedding_length", "feed_forward_length"):
        if f"{arch_name}.{required}" not in meta:
            raise CheckpointError(f"{shown(header.path)}: GGUF metadata lacks '{arch_name}.{required}', "
                                  "needed to build the reference")
    raw: dict[str, Any] = {}
    for key, attr in arch.keys.items():
        value = meta.get(f"{arch_name}.{key}")
        if value is not None:
            raw[attr] = _metadata_value(header, f"{arch_name}.{key}", value)
    model_type = arch.model_type
    if raw.get("num_local_experts", 0) > 0:
        if arch.moe_model_type is None:
            raise CheckpointError(f"{shown(header.path)}: GGUF architecture '{arch_name}' with experts is not "
                                  "supported")
        model_type = arch.moe_model_type
    else:
        raw.pop("num_local_experts", None)
        raw.pop("num_experts_per_tok", None)
    rope_base = meta.get(f"{arch_name}.rope.freq_base")
    if rope_base is not None and arch.keys is _HF_KEYS:
        raw["rope_theta"] = _metadata_value(header, f"{arch_name}.rope.freq_base", rope_base)
    raw["vocab_size"] = _vocab_size(header, arch_name)
    raw[arch.activation_key] = arch.activation
    raw["model_type"] = model_type
    types = Counter(_qtype_name(info.qtype) for name, info in header.tensors.items() if ".ffn_" in name)
    notes = [
        f"GGUF architecture '{arch_name}' checked as transformers model_type '{model_type}' with "
        f"{arch.activation_key}='{arch.activation}' (GGUF stores no activation name; llama.cpp runs this one for it)",
        "GGUF FFN tensor types: " + ", ".join(f"{t} ({n})" for t, n in types.most_common())
        + "; target and reference both get the same dequantized float32 weights",
    ]
    return raw, notes


def _metadata_value(header: GGUFHeader, key: str, value: Any) -> int | float:
    """One metadata number, checked: per-layer arrays must agree; sizes are positive integers (the layer
    count at most the number of tensors the file holds), epsilons and rope bases finite and positive."""
    def fail(why: str) -> CheckpointError:
        return CheckpointError(f"{shown(header.path)}: GGUF metadata '{key}' = {_short(value)}: {why}; the file is "
                               "corrupt or was not written by a llama.cpp converter")

    if isinstance(value, ArrayInfo):
        raise fail(f"an array of {value.count} values where one number (or one per layer) was expected")
    if isinstance(value, list):  # per-layer sizes: fine when they agree
        if not value or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            raise fail("expected a number, or a non-empty array of numbers (one per layer)")
        if len(set(value)) != 1:
            raise fail("differs between layers; per-layer FFN sizes are not supported")
        value = value[0]
    if key.endswith(("epsilon", "freq_base")):
        why = float_problem(value, 0.0 if key.endswith("epsilon") else 1e-300)
    elif key.endswith("block_count"):
        why = int_problem(value, 1, MAX_WIDTH) or (
            f"more layers than the file's {len(header.tensors)} tensors could hold (each layer has tensors of its own)"
            if value > len(header.tensors) else None)
    elif key.endswith(("expert_count", "expert_used_count", "sliding_window")):
        why = int_problem(value, 0, MAX_EXPERTS if "expert" in key else MAX_LENGTH)
    else:
        why = int_problem(value, 1, MAX_LENGTH if key.endswith("context_length") else MAX_WIDTH)
    if why is not None:
        raise fail(why)
    return value


def _vocab_size(header: GGUFHeader, arch_name: str) -> int:
    value = header.metadata.get(f"{arch_name}.vocab_size")
    if value is not None:
        why = int_problem(value, 1, MAX_LENGTH)
        if why is not None:
            raise CheckpointError(f"{shown(header.path)}: GGUF metadata '{arch_name}.vocab_size' = {_short(value)}: "
                                  f"{why}; the file is corrupt")
        return value
    embedding = header.tensors.get("token_embd.weight")
    if embedding is not None and len(embedding.dims) == 2:
        return int(embedding.dims[1])
    tokens = header.metadata.get("tokenizer.ggml.tokens")
    if isinstance(tokens, ArrayInfo):
        return tokens.count
    return len(tokens) if isinstance(tokens, list) else 32000  # the MLP does not depend on it


def _qtype_name(qtype: int) -> str:
    from gguf.constants import GGMLQuantizationType

    try:
        return GGMLQuantizationType(qtype).name
    except ValueError:
        return f"type {qtype}"


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return "?"


def open_gguf(path: Path) -> GGUFCheckpoint:
    """A .gguf file as a checkpoint: config from its metadata, tensors dequantized on read."""
    path = path.expanduser()
    header = read_header(path)
    split = header.metadata.get("split.count")
    if isinstance(split, int) and split > 1:
        raise CheckpointError(f"{shown(path)}: is one of {split} split GGUF files; merge them first "
                              "(llama-gguf-split --merge FIRST.gguf merged.gguf)")
    raw_config, notes = config_from_metadata(header)
    return GGUFCheckpoint(header, raw_config, notes)


def claims(path: Path) -> bool:
    """A .gguf file, or a folder holding exactly one .gguf and no HF checkpoint."""
    if path.is_file():
        return path.suffix == ".gguf"
    return (path.is_dir() and not (path / "config.json").is_file() and not any(path.glob("*.safetensors"))
            and len(list(path.glob("*.gguf"))) == 1)


def open_path(path: Path, allow_pickle: bool = False) -> GGUFCheckpoint:
    return open_gguf(path if path.is_file() else next(path.glob("*.gguf")))
