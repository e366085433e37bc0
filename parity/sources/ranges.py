"""Read single tensors out of safetensors files through a byte-range fetcher.

A safetensors file is an 8-byte little-endian header length, a JSON header giving each
tensor's dtype, shape and [begin, end) offsets into the data that follows, then the data.
So one layer of a remote checkpoint costs two small requests per shard for the header and
one request per run of adjacent tensors, instead of whole multi-GB shards.  The fetcher
is any ``(file name, start, end) -> chunks`` callable: HTTP ranges on the hub, a local
file in the tests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from parity.errors import CheckpointError, MissingTensorError
from parity.sources.safetensors_files import DTYPES, Span, header_length, parse_header

Fetch = Callable[[str, int, int], Iterator[bytes]]  # (file, start, end) -> chunks totalling end - start bytes

def plan(spans: dict[str, Span], names: Iterable[str], max_gap: int = 0) -> list[tuple[int, int, list[Span]]]:
    """The byte ranges to fetch for ``names``: sorted, adjacent tensors (or gaps up to
    ``max_gap`` bytes) merged into one range -> [(start, end, spans in that range)]."""
    wanted = sorted((spans[n] for n in dict.fromkeys(names)), key=lambda s: s.start)
    ranges: list[tuple[int, int, list[Span]]] = []
    for span in wanted:
        if ranges and span.start - ranges[-1][1] <= max_gap:
            start, end, members = ranges[-1]
            ranges[-1] = (start, max(end, span.end), [*members, span])
        else:
            ranges.append((span.start, span.end, [span]))
    return ranges


def layer_ranges(weight_map: dict[str, str], headers: dict[str, dict[str, Span]], names: Iterable[str],
                 max_gap: int = 0) -> dict[str, list[tuple[int, int]]]:
    """Which files and which byte ranges of them hold ``names`` -> {file: [(start, end)]}."""
    names = list(names)
    missing = [n for n in names if n not in weight_map]
    if missing:
        raise MissingTensorError(f"not in the checkpoint's weight map: {', '.join(missing)}")
    by_file: dict[str, list[str]] = {}
    for name in names:
        by_file.setdefault(weight_map[name], []).append(name)
    return {file: [(s, e) for s, e, _ in plan(headers[file], members, max_gap)]
            for file, members in sorted(by_file.items())}


class RangedReader:
    """Tensors from safetensors files read through ``fetch``; headers are read once per file."""

    def __init__(self, fetch: Fetch, progress: Callable[[str, int], object] | None = None, max_gap: int = 1 << 20):
        self.fetch = fetch
        self.progress = progress  # (description, total bytes) -> a tqdm-like bar, or None for silence
        self.max_gap = max_gap  # fetching a small gap costs less than another request
        self._headers: dict[str, dict[str, Span]] = {}

    def header(self, file_name: str) -> dict[str, Span]:
        if file_name not in self._headers:
            length = header_length(self._get(file_name, 0, 8), file_name)
            self._headers[file_name] = parse_header(self._get(file_name, 8, 8 + length), file_name)
        return self._headers[file_name]

    def read(self, file_name: str, names: list[str]):
        """{name: tensor} (dtype and shape as stored) for ``names``, all in ``file_name``."""
        import torch

        spans = self.header(file_name)
        absent = [n for n in names if n not in spans]
        if absent:
            raise MissingTensorError(f"{file_name}: its header lists no tensor {', '.join(absent)}")
        out = {}
        for span in (spans[n] for n in names):
            if span.dtype not in DTYPES or not hasattr(torch, DTYPES[span.dtype][0]):
                raise CheckpointError(f"{file_name}: tensor '{span.name}' has dtype {span.dtype}, "
                                      "which parity cannot read")
            out[span.name] = torch.empty(span.shape, dtype=getattr(torch, DTYPES[span.dtype][0]))
            if out[span.name].numel() * out[span.name].element_size() != span.end - span.start:
                raise CheckpointError(f"{file_name}: tensor '{span.name}' {span.dtype}{list(span.shape)} does not fit "
                                      f"its {span.end - span.start} bytes; the file is corrupt")
        ranges = plan(spans, names, self.max_gap)
        total = sum(end - start for start, end, _ in ranges)
        bar = self.progress(f"{file_name} ({len(names)} tensors)", total) if self.progress else None
        try:
            for start, end, members in ranges:
                self._fill(file_name, start, end, [(s, _bytes_of(out[s.name])) for s in members], bar)
        finally:
            if bar is not None:
                bar.close()
        return out

    def _fill(self, file_name: str, start: int, end: int, targets, bar) -> None:
        """Stream [start, end) into the tensors whose spans lie in it (gap bytes are dropped)."""
        position = start
        for chunk in self.fetch(file_name, start, end):
            view = memoryview(chunk)
            for span, dest in targets:
                lo, hi = max(span.start, position), min(span.end, position + len(view))
                if lo < hi:
                    dest[lo - span.start:hi - span.start] = view[lo - position:hi - position]
            position += len(view)
            if bar is not None:
                bar.update(len(view))
        if position != end:
            raise CheckpointError(f"{file_name}: expected bytes {start}-{end}, got {position - start}; "
                                  "the download was cut short, try again")

    def _get(self, file_name: str, start: int, end: int) -> bytes:
        data = b"".join(self.fetch(file_name, start, end))
        if len(data) != end - start:
            raise CheckpointError(f"{file_name}: expected {end - start} bytes at offset {start}, got {len(data)}")
        return data


def _bytes_of(tensor) -> memoryview:
    """A writable byte view of a fresh contiguous tensor's storage."""
    import torch

    flat = tensor.reshape(-1).view(torch.uint8) if tensor.numel() else torch.empty(0, dtype=torch.uint8)
    return memoryview(flat.numpy()).cast("B")


def read_span(handle, start: int, end: int, chunk: int) -> Iterator[bytes]:
    """Bytes [start, end) of an open binary file-like object, ``chunk`` at a time; stops early at EOF."""
    handle.seek(start)
    while start < end:
        data = handle.read(min(chunk, end - start))
        if not data:
            return
        start += len(data)
        yield data


def local_fetcher(folder) -> Fetch:
    """Byte ranges of files in a local folder (tests, and a model for remote fetchers)."""
    from pathlib import Path

    folder = Path(folder)

    def fetch(file_name: str, start: int, end: int, chunk: int = 1 << 22) -> Iterator[bytes]:
        with open(folder / file_name, "rb") as handle:
            yield from read_span(handle, start, end, chunk)

    return fetch
