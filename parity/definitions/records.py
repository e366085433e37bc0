"""The records a report carries about a failing layer's known mistake: the replays tried (``Candidate``), the mistake
that explains it (``Diagnosis``), and whether a run can tell a mistake from a correct module at all
(``Separability``).  The catalogue that says what each mistake means is ``mistakes``; these are what a run found, kept
apart so that the catalogue stays the list of mistakes.  Pure data (no torch), for reports, JUnit and baselines.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any


class _Readable(Mapping):
    """Reading a record by key too (``d["id"]``, ``d.get("fix")``, ``set(d)``): what reports held before they were
    typed, so code written against the dicts keeps working."""

    def __getitem__(self, key: str) -> Any:
        if key not in self._names():
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    def _names(self) -> tuple[str, ...]:
        return tuple(f.name for f in fields(self))


@dataclass
class Candidate(_Readable):
    """One mistake replayed for a failing layer, and how far the module's output is from that replay."""

    id: str
    detail: str
    distance: float


@dataclass
class Diagnosis(_Readable):
    """The known mistake that explains a failing layer (``LayerResult.diagnosis``), with the evidence."""

    id: str  # a MistakeId value
    message: str
    fix: str = ""
    distance: float | None = None  # the module's distance from the mistake's replay (None: a finding, no replay)
    reference_distance: float | None = None  # the module's distance from transformers
    candidates: list[Candidate] = field(default_factory=list)  # every replay tried; [] for findings


@dataclass
class Separability(_Readable):
    """Whether a run at its dtype and tolerance can tell one known mistake from a correct module on a layer."""

    id: str
    detail: str
    distance: float  # how far the mistake moves the output
    checked: bool  # the mistake is sure to fail at this dtype and tolerance
    message: str | None  # when not checked: why, and what to run instead
