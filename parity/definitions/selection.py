"""Which layers (or experts) a check runs: 'all' | N | 'N,M,...' | 'N-M' | [N, M].

Pure data, no torch: the CLI, project files and the API share this one parser.  Ranges are
checked against the model before they are expanded (a typo like 0-149999999 must not
allocate a list of 150 million indices), and an empty selection is an error: a check of
nothing is not a pass.
"""

from __future__ import annotations

from collections.abc import Iterable

from parity.errors import LayerRangeError

Selection = str | int | Iterable[int] | None


def _ranges(selection: Selection, what: str) -> list[tuple[int, int]]:
    """The selection as inclusive (lo, hi) ranges, in the order given; unvalidated."""
    if isinstance(selection, bool):
        raise LayerRangeError(f"--{what}s {selection!r}: expected 'all', N, 'N,M,...' or 'N-M'")
    if isinstance(selection, int):
        return [(selection, selection)]
    if isinstance(selection, str):
        ranges = []
        for part in selection.split(","):
            part = part.strip()
            sign, body = ("-", part[1:]) if part.startswith("-") else ("", part)
            lo, dash, hi = body.partition("-")
            try:
                ranges.append((int(sign + lo), int(hi)) if dash else (int(part), int(part)))
            except ValueError:
                raise LayerRangeError(f"--{what}s {selection!r}: expected 'all', N, 'N,M,...' or 'N-M'") from None
        return ranges
    values = list(selection)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise LayerRangeError(f"{what}s {values!r}: expected integers")
    return [(v, v) for v in values]


def parse_selection(selection: Selection, count: int, what: str = "layer") -> list[int]:
    """Validated, de-duplicated indices in the order given; default (None or 'all'): all ``count``."""
    if count <= 0:
        raise LayerRangeError(f"the model has {count} {what}s: there is nothing to check")
    if selection is None or selection == "all":
        return list(range(count))
    ranges = _ranges(selection, what)
    per = " per layer" if what == "expert" else ""
    for lo, hi in ranges:
        for index in (lo, hi):
            if not 0 <= index < count:
                raise LayerRangeError(f"{what} {index} is out of range: this model has {count} {what}s{per} "
                                      f"(valid: 0-{count - 1})")
        if hi < lo:
            raise LayerRangeError(f"--{what}s {lo}-{hi}: an empty range (the end is before the start); write {hi}-{lo}")
    chosen = list(dict.fromkeys(index for lo, hi in ranges for index in range(lo, hi + 1)))
    if not chosen:
        raise LayerRangeError(f"--{what}s {selection!r} selects no {what}: give at least one (or 'all')")
    return chosen
