"""The GGUF binary header, read without GGUFReader: metadata scalars, array lengths and the tensor directory.

gguf's ``GGUFReader`` builds numpy views of every array item when it opens a file: about 10 s for a 262k-token
vocabulary, to check a layer that needs three tensors.  parity needs a dozen metadata scalars and the tensor
directory, so this module walks the header itself, skipping array payloads by their lengths (strings are never
decoded), and checks every length and offset against the file before anything is read.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parity.definitions.files import not_regular, short, shown
from parity.errors import CheckpointError

MAGIC = b"GGUF"

DEFAULT_ALIGNMENT = 32

SMALL_ARRAY = 4096  # numeric arrays up to this length are kept (per-layer sizes); longer ones only counted

MAX_ARRAY_DEPTH = 8  # arrays of arrays nested deeper than this are refused (llama.cpp writes at most 2)

MAX_DIMS = 4  # GGML_MAX_DIMS

# GGUFValueType -> struct format of one scalar (8 = string, 9 = array are handled apart)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


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
        if name in header.tensors:  # gguf's reader raises "Found duplicated tensor"; llama.cpp refuses the file
            raise CheckpointError(f"{shown(path)}: GGUF tensor {short(name)} is listed twice in the tensor index: "
                                  "which copy is the model cannot be told (llama.cpp refuses such a file); "
                                  "re-convert it")
        header.tensors[name] = tensor_info(path, name, dims, qtype, offset, data_start, len(buf))
    return header


def _alignment(metadata: dict[str, Any], path: Path) -> int:
    """general.alignment: a power of two (llama.cpp's own rule); 0 would divide by zero."""
    value = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1) or value > 2**16:
        raise CheckpointError(f"{shown(path)}: GGUF metadata 'general.alignment' = {short(value)} is not a power of "
                              f"two between 1 and {2**16}; the file is corrupt: re-download or re-convert it")
    return value


def tensor_info(path: Path, name: str, dims: tuple[int, ...], qtype: int, offset: int, data_start: int,
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
        raise CheckpointError(f"{shown(path)}: GGUF tensor '{name}' is {qtype_name(qtype)} with rows of {dims[0]} "
                              f"values, not a multiple of its block size {block[0]}: the file is corrupt, "
                              "re-download or re-convert it")
    end = info.offset + info.nbytes()
    if end > size:
        raise CheckpointError(f"{shown(path)}: GGUF tensor '{name}' ({qtype_name(qtype)}, dims {list(dims)}) claims "
                              f"bytes {info.offset}-{end}, but the file has only {size} bytes: truncated or corrupt; "
                              "re-download the file")
    return info


def _block(qtype: int) -> tuple[int, int] | None:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    except (ValueError, KeyError):
        return None


def qtype_name(qtype: int) -> str:
    from gguf.constants import GGMLQuantizationType

    try:
        return GGMLQuantizationType(qtype).name
    except ValueError:
        return f"type {qtype}"


def gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return "?"
