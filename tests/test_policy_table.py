"""The README's (and ci.md's) table "Synthetic weights at each entry point" is parity/definitions/policy.py's: a
row for every door, each saying what the door does by default."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from parity.definitions.policy import SYNTHETIC_DEFAULT

ROOT = Path(__file__).resolve().parent.parent
DOORS = {"parity MODEL": "parity MODEL", "parity compare A B": "parity compare",
         "parity.compare(...)": "parity.compare", "parity.check(...)": "parity.check", "parity check": "parity check",
         "assert_parity": "pytest"}
ACTIONS = {"checked": "check", "compared": "check", "refused": "refuse", "skipped": "skip"}


def table_rows(text: str) -> dict[str, str]:
    """door -> its default action, from the table whose header says 'synthetic weights by default'."""
    start = text.index("| entry point | synthetic weights by default |")
    rows = {}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        door_cell, default_cell = (cell.strip() for cell in line.strip("|").split("|")[:2])
        door = DOORS[re.match(r"`([^`]+)`", door_cell).group(1)]
        rows[door] = ACTIONS[re.match(r"\**(\w+)", default_cell).group(1)]
    return rows


@pytest.mark.parametrize("page", ["README.md", "docs/ci.md"])
def test_the_page_table_is_the_policy_table(page):
    assert table_rows((ROOT / page).read_text()) == SYNTHETIC_DEFAULT
