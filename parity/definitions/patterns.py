"""Patterns a checkpoint's own loader matches as regular expressions (transformers' skip lists, compressed-tensors'
``re:`` targets and ignore entries), checked before anything runs: one ``re`` cannot compile would stop that loader,
and a compare mid-run.  Raises ValueError; the caller names the file and field.  Imports nothing of parity's, so
every config reader may use it without lengthening its import chain."""

from __future__ import annotations

import re


def regex_value(value: str) -> str:
    """A pattern a checkpoint's loader matches as a regular expression (a skip list's entry, a ``re:`` target):
    one ``re`` cannot compile would stop that loader, and a compare mid-run."""
    try:
        re.compile(value)
    except re.error as exc:
        raise ValueError(f"holds {value!r}, which is no regular expression ({exc}); its loader matches each entry "
                         "as one") from None
    return value
