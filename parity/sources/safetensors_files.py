"""Safetensors files: the header, parsed in one place (an 8-byte little-endian length, a JSON
object giving each tensor's dtype, shape and [begin, end) offsets into the data that follows),
JSON files of the layout (config.json, the index), and reading the tensors asked for with ``safe_open``.

Used to read byte ranges of remote shards (``ranges.py``) and to say in words what is wrong
with a local file safetensors refuses (``describe_defect``): its own messages ("incomplete
metadata, file not fully covered") do not say that the usual cause is an interrupted download.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from parity.definitions.files import not_regular, read_text, short, shown
from parity.errors import CheckpointError

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit
DTYPES = {  # safetensors dtype -> (torch dtype name, bytes per element)
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1), "U8": ("uint8", 1),
    "BOOL": ("bool", 1), "U16": ("uint16", 2), "U32": ("uint32", 4), "U64": ("uint64", 8), "C64": ("complex64", 8),
    "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1),
}


@dataclass(frozen=True)
class Span:
    """Where one tensor's bytes are in its file (absolute offsets)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def header_length(prefix: bytes, file_name: str) -> int:
    """The JSON header's length from a file's first 8 bytes."""
    if len(prefix) != 8:
        raise CheckpointError(f"{file_name}: too short to be a safetensors file")
    (length,) = struct.unpack("<Q", prefix)
    if not 0 < length <= MAX_HEADER_BYTES:
        raise CheckpointError(f"{file_name}: not a safetensors file (header length {length})")
    return length


def parse_header(raw: bytes, file_name: str, sizes: bool = True) -> dict[str, Span]:
    """JSON header bytes -> {tensor name: Span}, offsets made absolute (8 + header length + ...).
    Every entry is checked: a known dtype's shape must need exactly the bytes its offsets span."""
    try:
        header = header_object(raw, file_name)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{file_name}: its header is not valid JSON, overwritten or corrupted ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file_name}: its safetensors header is not a JSON object")
    base = 8 + len(raw)
    spans = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        span = _span(name, info, base)
        if span is None:
            raise CheckpointError(f"{file_name}: header entry for tensor {short(name)} lacks valid dtype / shape / "
                                  "data_offsets")
        spans[name] = span
    if sizes:
        for span in spans.values():
            mismatch = size_mismatch(span)
            if mismatch is not None:
                raise CheckpointError(f"{file_name}: {mismatch}")
    return spans


def size_mismatch(span: Span) -> str | None:
    """Whether a tensor's offsets span the bytes its shape and dtype need (None: they do, or the dtype is unknown)."""
    width = DTYPES.get(span.dtype, (None, None))[1]
    if width is None or span.end - span.start == width * math.prod(span.shape):
        return None
    return (f"tensor {short(span.name)}: shape {list(span.shape)} of {span.dtype} needs "
            f"{width * math.prod(span.shape)} bytes, but its data_offsets span {span.end - span.start}")


def _span(name: str, info: object, base: int) -> Span | None:
    """One header entry as a Span, or None when a field is missing or of the wrong type or range."""
    if not isinstance(info, dict) or not isinstance(info.get("dtype"), str):
        return None
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or not isinstance(offsets, list) or len(offsets) != 2:
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in [*shape, *offsets]):
        return None
    if offsets[0] > offsets[1] or len(shape) > 16:
        return None
    return Span(name, info["dtype"], tuple(shape), base + offsets[0], base + offsets[1])


def describe_defect(path: Path) -> str | None:
    """What is wrong with a local safetensors file, in words (None: nothing this can see).  Reads only the header."""
    if not_regular(path) is not None:
        return not_regular(path)
    try:
        size = path.stat().st_size
        if size < 8:
            return f"the file is {size} bytes, too short for a safetensors header (empty or cut off)"
        with path.open("rb") as handle:
            length = header_length(handle.read(8), path.name)
            if length > size - 8:
                return (f"the header claims {length} bytes but the file has only {size - 8} after the length field: "
                        "truncated, or not a safetensors file")
            spans = parse_header(handle.read(length), path.name, sizes=False)
    except OSError as exc:
        return f"cannot read it: {exc.strerror or exc}"
    except CheckpointError as exc:
        return str(exc).split(": ", 1)[-1]
    base, data_end, covered = 8 + length, size, 8 + length
    for span in spans.values():
        if span.end > data_end:
            return (f"tensor '{span.name}' lies at bytes {span.start - base}-{span.end - base} of the data section, "
                    f"but the file holds only {data_end - base} data bytes: truncated (an interrupted download?)")
        if size_mismatch(span) is not None:
            return size_mismatch(span)
        covered = max(covered, span.end)
    if covered < data_end:
        return f"{data_end - covered} bytes after the last tensor's data belong to no tensor (corrupted or appended to)"
    return None


def _open(path: Path):
    """``safe_open`` on a local file.  safetensors takes a path as UTF-8 text only, and a Linux path need not be
    UTF-8 (a folder named in another encoding: Python holds its bytes as lone surrogates): such a file is opened
    by us and handed over as its descriptor's path (/proc/self/fd/N), so the file's name never matters."""
    from safetensors import safe_open

    if _utf8(str(path)) or not _FD_DIR.is_dir():
        return safe_open(str(path), framework="pt")
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:  # safe_open opens (and maps) the file itself: ours is closed once it has
        return safe_open(f"{_FD_DIR}/{fd}", framework="pt")
    finally:
        os.close(fd)


_FD_DIR = Path("/proc/self/fd")


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def header_object(raw: bytes, file_name: str) -> object:
    """A safetensors header's JSON; one that lists a tensor twice is a CheckpointError naming it (json, and
    safetensors itself, would keep the last copy silently)."""
    try:
        return json.loads(raw, object_pairs_hook=_pairs)
    except DuplicateKey as twice:
        raise CheckpointError(f"{file_name}: its safetensors header lists tensor {short(twice.key)} twice: which "
                              "copy is the model cannot be told; re-save the file") from None


def require_unique_names(path: Path) -> None:
    """A header that lists one tensor twice is refused before safe_open reads it; any other defect is left to the
    read, whose failure ``unreadable`` explains."""
    try:
        with path.open("rb") as handle:
            raw = handle.read(header_length(handle.read(8), path.name))
    except (OSError, CheckpointError):
        return
    with contextlib.suppress(UnicodeDecodeError, ValueError, RecursionError):
        header_object(raw, shown(path))


def read_safetensors(path: Path, names: list[str]) -> dict:
    """These tensors of one local safetensors file; the file is closed (unmapped) on return."""
    require_regular_file(path)
    require_unique_names(path)
    try:
        handle = _open(path)
    except Exception as exc:
        raise unreadable(path, exc) from None
    out = {}
    with handle:
        held = set(handle.keys())
        for name in names:
            if name not in held:
                raise CheckpointError(f"{shown(path)}: holds no tensor {short(name)}, though the checkpoint's index "
                                      f"places it in this file: the index and the shards disagree; re-download it")
            try:
                out[name] = handle.get_tensor(name)
            except Exception as exc:
                raise CheckpointError(f"{shown(path)}: cannot read tensor {short(name)}: {exc}") from None
    return out


def describe_local(path: Path, names: list[str]) -> dict[str, tuple[list[int], str]]:
    """Shape and dtype of these tensors of a local safetensors file, from its header alone, validated as a
    read would be (a regular file, a sound header, every tensor inside the file, each name present)."""
    require_regular_file(path)
    reason = describe_defect(path)
    if reason is not None:
        raise CheckpointError(f"{shown(path)}: not a readable safetensors file: {reason}; re-download or re-save it")
    with path.open("rb") as handle:
        spans = parse_header(handle.read(header_length(handle.read(8), path.name)), path.name)
    for name in names:
        if name not in spans:
            raise CheckpointError(f"{shown(path)}: holds no tensor {short(name)}, though the checkpoint's index "
                                  f"places it in this file: the index and the shards disagree; re-download it")
    return {name: (list(spans[name].shape), spans[name].dtype) for name in names}


def describe_files(fetch, wanted: dict[str, str]) -> dict[str, tuple[list[int], str]] | None:
    """``describe_local`` of each tensor of ``wanted`` (tensor name -> its file's name, a local path by ``fetch``),
    one header read per file; None where a header cannot be read (an inventory then says it cannot tell; the read
    that follows says why)."""
    found: dict[str, tuple[list[int], str]] = {}
    try:
        for file_name in sorted(set(wanted.values())):
            found.update(describe_local(fetch(file_name), [n for n, f in wanted.items() if f == file_name]))
    except CheckpointError:
        return None
    return found


class DuplicateKey(ValueError):
    """A JSON object naming one key twice: ``json.loads`` would silently keep the last value."""

    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _pairs(pairs: list[tuple[str, object]]) -> dict:
    """json's object_pairs_hook: the object, or DuplicateKey for a key it names twice (a tensor listed twice in a
    header or an index must be refused, not resolved to whichever copy comes last)."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(key)
        out[key] = value
    return out


@functools.lru_cache(maxsize=8)
def _header_spans(path: str, _mtime_ns: int, _size: int) -> dict[str, Span]:
    """A file's spans, parsed once per version of the file (a hint per expert would parse a 256-expert header,
    ~1.7 ms, each time)."""
    with open(path, "rb") as handle:
        return parse_header(handle.read(header_length(handle.read(8), Path(path).name)), Path(path).name, sizes=False)


def read_json(path: Path, what: str, *, unique: bool = False) -> dict:
    """A JSON object from a regular file (a FIFO or a device is refused, never read); with ``unique``, a key named
    twice in one object (a tensor an index lists twice) is refused.  config.json keeps json's own reading (the
    last value wins), as transformers reads it."""
    text = read_text(path, what, CheckpointError)
    try:
        data = json.loads(text, object_pairs_hook=_pairs if unique else None)
    except DuplicateKey as twice:
        raise CheckpointError(f"{shown(path)}: {what} names {short(twice.key)} twice in one JSON object (for a "
                              "tensor: two shard files, of which JSON keeps only the last); remove the stale "
                              "entry or re-download it") from None
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{shown(path)}: {what} is not valid JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{shown(path)}: {what} must hold a JSON object")
    return data


class LocalReader:
    """A Checkpoint reader for safetensors files obtained through ``fetch`` (file name -> local path): called with
    (file name, tensor names) it reads them; ``will_need`` tells the kernel which it will read next."""

    def __init__(self, fetch: Callable[[str], Path]):
        self.fetch = fetch

    def __call__(self, file_name: str, names: list[str]) -> dict:
        return read_safetensors(self.fetch(file_name), names)

    def will_need(self, file_name: str, names: list[str]) -> None:
        """``will_need`` on the file (see there); a file that cannot be had is left to the read to say so."""
        try:
            path = self.fetch(file_name)
        except (OSError, CheckpointError):
            return
        will_need(path, names)


def local_reader(fetch: Callable[[str], Path]) -> LocalReader:
    """A Checkpoint reader for safetensors files obtained through ``fetch`` (file name -> local path)."""
    return LocalReader(fetch)


def will_need(path: Path, names: list[str]) -> None:
    """Ask the kernel to read these tensors' bytes of a local safetensors file into the page cache now
    (posix_fadvise WILLNEED: it reads them in the background, no thread and no memory of this process's own), so a
    read of them moments later (a streamed block's next expert, while this one is computed) finds them there instead
    of waiting on the disk.  A hint only: names the header does not hold, a file that does not open, and systems
    without posix_fadvise are passed over (the read itself says what is wrong)."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    try:
        with path.open("rb") as handle:
            stat = os.fstat(handle.fileno())
            spans = _header_spans(str(path), stat.st_mtime_ns, stat.st_size)
            for name in names:
                if name in spans and spans[name].end > spans[name].start:
                    advise(handle.fileno(), spans[name].start, spans[name].end - spans[name].start,
                           os.POSIX_FADV_WILLNEED)
    except (OSError, CheckpointError):
        return


def weight_map_from_index(index_path: Path, what: str = "safetensors index") -> dict[str, str]:
    index = read_json(index_path, what, unique=True)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{shown(index_path)}: has no valid 'weight_map' (tensor name -> shard file)")
    if not weight_map:
        raise CheckpointError(f"{shown(index_path)}: 'weight_map' is empty: the index lists no tensors")
    outside = sorted({v for v in weight_map.values() if Path(v).is_absolute() or ".." in Path(v).parts or not v
                      or "\0" in v})
    if outside:  # a shard must live in the checkpoint's own folder
        raise CheckpointError(f"{shown(index_path)}: 'weight_map' names shard files outside the checkpoint folder: "
                              f"{', '.join(short(v) for v in outside[:3])}")
    return weight_map


def check_shards(index_path: Path, weight_map: dict[str, str]) -> None:
    """Every shard a local index names is a regular file next to it: a checkpoint missing one is incomplete
    (an interrupted download), whichever layer is asked for.  Refused when opened, by a check and by inspect."""
    folder = index_path.parent
    for file_name in sorted(set(weight_map.values())):
        why = not_regular(folder / file_name)
        if why is not None:
            names = [n for n, f in weight_map.items() if f == file_name]
            raise CheckpointError(
                f"{shown(folder / file_name)}: listed in {index_path.name} (for {short(names[0])}"
                f"{f' and {len(names) - 1} more tensors' if len(names) > 1 else ''}) but {why}: the checkpoint is "
                "incomplete; re-download it"
            )


def weight_map_from_files(files: list[Path]) -> dict[str, str]:
    """Tensor names from safetensors headers (reads only the header of each file).

    Without an index nothing says which of two files holding the same tensor is the
    checkpoint (transformers would load model.safetensors alone): refuse rather than let
    the later file, often a stale copy, silently win.
    """
    weight_map: dict[str, str] = {}
    clashes: dict[tuple[str, str], list[str]] = {}
    for path in files:
        require_regular_file(path)
        try:
            with _open(path) as handle:
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
    why = not_regular(path)
    if why is not None:
        raise CheckpointError(f"{shown(path)}: {why}; expected a safetensors file")


def unreadable(path: Path, exc: Exception) -> CheckpointError:
    """The error for a safetensors file that does not open: what exactly is wrong, when we can tell."""
    reason = describe_defect(path)
    if reason is None and not _utf8(str(path)):  # the name, not the file: do not send the user to re-download it
        return CheckpointError(f"{shown(path)}: safetensors cannot open this file, whose path is not valid UTF-8 "
                               f"({' '.join(str(exc).split())}); rename the folder or file to a UTF-8 name")
    return CheckpointError(f"{shown(path)}: not a readable safetensors file: {reason or str(exc)}; re-download or "
                           "re-save it")
