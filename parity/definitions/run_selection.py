"""Which of a project's entries and units a run takes: `parity check -k EXPR` (a selection expression, as
pytest's -k) and `--shard K/N` (a CI matrix's share of the units).  Pure data work, no torch.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from parity.definitions.files import short
from parity.errors import ShardError, UsageError

if TYPE_CHECKING:
    from parity.definitions.project import CheckSpec


def select_checks(checks: list[CheckSpec], expression: str) -> list[CheckSpec]:
    """`parity check -k EXPR`: the checks whose label matches, as pytest's -k matches test names: each word a
    case-insensitive substring of the label, combined with and / or / not and parentheses."""
    matcher = _parse_selection(expression)
    chosen = [check for check in checks if matcher(check.label.lower())]
    if not chosen:
        raise UsageError(f"-k {expression!r} selects none of the {len(checks)} check(s): "
                         f"{', '.join(repr(c.label) for c in checks)}")
    return chosen


MAX_SELECTION_DEPTH = 100  # levels of `not` and parentheses in `-k`; pytest's own -k has no use for more


def _parse_selection(expression: str):
    """A small recursive-descent parser: or < and < not < (group) | word."""
    tokens = re.findall(r"\(|\)|[^\s()]+", expression)
    if not tokens:
        raise UsageError("-k needs an expression: a part of a check's name, or words with and / or / not")
    position, depth = [0], [0]

    def deeper() -> None:  # each `not` and `(` nests one level: 5000 of them would end Python's stack
        depth[0] += 1
        if depth[0] > MAX_SELECTION_DEPTH:
            raise UsageError(f"-k {short(expression)}: the expression nests too deeply (more than "
                             f"{MAX_SELECTION_DEPTH} levels of 'not' or parentheses)")

    def peek() -> str | None:
        return tokens[position[0]] if position[0] < len(tokens) else None

    def take() -> str:
        position[0] += 1
        return tokens[position[0] - 1]

    def either():
        parts = [both()]
        while peek() == "or":
            take()
            parts.append(both())
        return parts[0] if len(parts) == 1 else lambda label: any(p(label) for p in parts)

    def both():
        parts = [negated()]
        while peek() == "and":
            take()
            parts.append(negated())
        return parts[0] if len(parts) == 1 else lambda label: all(p(label) for p in parts)

    def negated():
        if peek() == "not":
            take()
            deeper()
            inner = negated()
            depth[0] -= 1
            return lambda label: not inner(label)
        token = take() if peek() is not None else None
        if token == "(":
            deeper()
            inner = either()
            if peek() != ")":
                raise UsageError(f"-k {expression!r}: a '(' is not closed")
            take()
            depth[0] -= 1
            return inner
        if token in (None, ")", "and", "or"):
            raise UsageError(f"-k {expression!r}: expected a word where {token or 'the end'!r} stands")
        word = token.lower()
        return lambda label: word in label

    matcher = either()
    if peek() is not None:
        raise UsageError(f"-k {expression!r}: unexpected {peek()!r}")
    return matcher


def parse_shard(text: str) -> tuple[int, int]:
    """'2/4' -> (2, 4): this job runs the second of four shares."""
    try:
        k, n = (int(part) for part in text.split("/"))
    except ValueError:
        raise ShardError(f"--shard {text!r}: expected K/N, e.g. 1/4 (this job's number K of N jobs)") from None
    if not 1 <= k <= n:
        raise ShardError(f"--shard {text!r}: need 1 <= K <= N")
    return k, n


def shard_units(units: list, shard: tuple[int, int] | None) -> list:
    """Round-robin: unit i belongs to shard (i mod N) + 1.

    Units are (check, layer) pairs in file order and layer order, so the split is stable
    across jobs and runs, and one large check is spread over every job, not given to one.
    """
    if shard is None:
        return list(units)
    k, n = shard
    return [unit for i, unit in enumerate(units) if i % n == k - 1]
