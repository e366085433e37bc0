"""Hostile checkpoint files, built field by field: a minimal GGUF (de)serialiser that can write what
no honest writer would (alignment 0, a string claiming 10^12 bytes, arrays nested 5000 deep, a
tensor offset of 2^63), and safetensors headers rewritten in place.  Used by tests/test_errors.py
and tests/test_fuzz_structured.py."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# GGUF value types
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
_FORMATS = {UINT8: "B", INT8: "b", UINT16: "H", INT16: "h", UINT32: "I", INT32: "i", FLOAT32: "f", BOOL: "?",
            UINT64: "Q", INT64: "q", FLOAT64: "d"}


@dataclass
class Value:
    """A metadata value with its GGUF type; for ARRAY, ``item`` is the element type and ``value`` a list
    (of Value for arrays of arrays).  ``claimed_length`` overrides a string's stored length."""

    vtype: int
    value: Any
    item: int | None = None
    claimed_length: int | None = None
    claimed_count: int | None = None
    raw: bytes | None = None  # the encoded value as is (after the type field)


@dataclass
class TensorEntry:
    name: str
    dims: list[int]
    qtype: int
    offset: int


@dataclass
class GGUF:
    metadata: dict[str, Value]
    tensors: list[TensorEntry]
    data: bytes
    version: int = 3
    alignment: int = 32
    claimed_tensors: int | None = None
    claimed_kv: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _string(text: str, claimed: int | None = None) -> bytes:
    raw = text.encode("utf-8", errors="surrogatepass")
    return struct.pack("<Q", len(raw) if claimed is None else claimed) + raw


def _value(value: Value) -> bytes:
    if value.raw is not None:
        return value.raw
    if value.vtype == STRING:
        return _string(value.value, value.claimed_length)
    if value.vtype == ARRAY:
        items = value.value
        count = len(items) if value.claimed_count is None else value.claimed_count
        out = struct.pack("<IQ", value.item, count)
        for item in items:
            out += _value(item if isinstance(item, Value) else Value(value.item, item))
        return out
    return struct.pack("<" + _FORMATS[value.vtype], value.value)


def gguf_bytes(gguf: GGUF) -> bytes:
    out = b"GGUF" + struct.pack("<I", gguf.version)
    out += struct.pack("<QQ", len(gguf.tensors) if gguf.claimed_tensors is None else gguf.claimed_tensors,
                       len(gguf.metadata) if gguf.claimed_kv is None else gguf.claimed_kv)
    for key, value in gguf.metadata.items():
        out += _string(key) + struct.pack("<I", value.vtype) + _value(value)
    for tensor in gguf.tensors:
        out += _string(tensor.name) + struct.pack("<I", len(tensor.dims))
        out += b"".join(struct.pack("<Q", d) for d in tensor.dims) + struct.pack("<IQ", tensor.qtype, tensor.offset)
    alignment = gguf.alignment if gguf.alignment > 0 else 32
    out += b"\0" * (-len(out) % alignment)
    return out + gguf.data


def read_gguf(path: Path) -> GGUF:
    """A GGUF file written by GGUFWriter, as editable structure (metadata values keep their types)."""
    buf = path.read_bytes()
    pos = 4
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, pos)
    pos += 20

    def string() -> str:
        nonlocal pos
        (length,) = struct.unpack_from("<Q", buf, pos)
        pos += 8 + length
        return buf[pos - length:pos].decode("utf-8")

    def value(vtype: int) -> Value:
        nonlocal pos
        if vtype == STRING:
            return Value(STRING, string())
        if vtype == ARRAY:
            item, count = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            items = [value(item) for _ in range(count)]
            return Value(ARRAY, [i if item == ARRAY else i.value for i in items], item=item)
        fmt = "<" + _FORMATS[vtype]
        (scalar,) = struct.unpack_from(fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return Value(vtype, scalar)

    metadata = {}
    for _ in range(n_kv):
        key = string()
        (vtype,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        metadata[key] = value(vtype)
    tensors = []
    for _ in range(n_tensors):
        name = string()
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        dims = list(struct.unpack_from(f"<{n_dims}Q", buf, pos + 4))
        pos += 4 + 8 * n_dims
        qtype, offset = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        tensors.append(TensorEntry(name, dims, qtype, offset))
    alignment = metadata["general.alignment"].value if "general.alignment" in metadata else 32
    pos += -pos % alignment
    return GGUF(metadata, tensors, buf[pos:], version=version, alignment=alignment)


# -- safetensors ----------------------------------------------------------------------------------

def st_header(path: Path) -> tuple[dict, bytes]:
    """(header, data section) of a safetensors file."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + length]), raw[8 + length:]


def st_write(path: Path, header: dict | str, data: bytes) -> None:
    text = (header if isinstance(header, str) else json.dumps(header)).encode("utf-8", errors="surrogatepass")
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def nested_arrays(depth: int) -> Value:
    """An array of arrays ``depth`` deep around one uint8 (written iteratively: no recursion here)."""
    raw = struct.pack("<IQ", UINT8, 1) + b"\x01"
    for _ in range(depth):
        raw = struct.pack("<IQ", ARRAY, 1) + raw
    return Value(ARRAY, None, raw=raw)


def nested(depth: int, leaf: Any = 1) -> str:
    """JSON text nested ``depth`` arrays deep (json.dumps itself would recurse too deeply)."""
    return "[" * depth + json.dumps(leaf) + "]" * depth
