"""docs/cli.md's usage block and each command's --help list the same options: an option added to a parser and
not to the page (or the page's that no parser takes) fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from parity.cli.options import build_check_parser, build_compare_parser, build_inspect_parser, build_parser

ROOT = Path(__file__).resolve().parent.parent
PARSERS = {"MODEL": build_parser, "compare": build_compare_parser, "check": build_check_parser,
           "inspect": build_inspect_parser}
OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*|-k)\b")


def usage_block() -> str:
    text = (ROOT / "docs" / "cli.md").read_text()
    start = text.index("## Usage\n\n```\n") + len("## Usage\n\n```\n")
    return text[start:text.index("```", start)]


def documented() -> dict[str, set[str]]:
    """command -> the options its usage lines name ('[CI outputs]' expanded; `parity --version` is MODEL's)."""
    block = usage_block()
    ci_outputs = set(OPTION.findall(block[block.index("CI outputs:"):]))
    found: dict[str, set[str]] = {}
    command = None
    for line in block[:block.index("CI outputs:")].splitlines():
        line = line.split("#")[0]
        if line.startswith("parity "):
            word = line.split()[1]
            command = word if word in PARSERS else "MODEL"
        if command is None:
            continue
        found.setdefault(command, set()).update(OPTION.findall(line))
        if "[CI outputs]" in line:
            found[command] |= ci_outputs
    return found


def taken(build) -> set[str]:
    parser = build()
    return {o for a in parser._actions for o in a.option_strings if o.startswith("--") or o == "-k"} - {"--help"}


@pytest.mark.parametrize("command", PARSERS)
def test_the_page_lists_every_option_the_command_takes(command):
    assert documented()[command] == taken(PARSERS[command])


@pytest.mark.parametrize("command", PARSERS)
def test_help_names_every_option_the_page_lists(command):
    helptext = PARSERS[command]().format_help()
    missing = [option for option in documented()[command] if option not in helptext]
    assert not missing, f"`parity {command} --help` does not name {missing}"
