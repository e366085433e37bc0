"""Every install command a page shows names only what this project owns or declares.

The name ``parity`` on the public package index is a placeholder held by someone else: a page that said
``pip install parity`` would, the day it gets an upload, install their code into every CI that copied it.  So an
install command may name this source tree (a path: ``.``, ``./.parity``, ``'.[mlx]'``), this project's own
distribution by a direct reference (``ffn-parity @ git+...``), or a package pyproject.toml itself requires (the
frameworks an extra stands for, named by their own projects' names).  Nothing else.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import InvalidRequirement, Requirement

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
OWN = PROJECT["name"]
# pip's options that take a value (the value is a file or an index, not a package to install)
VALUE_OPTIONS = {"-c", "--constraint", "-r", "--requirement", "-i", "--index-url", "--extra-index-url",
                 "-f", "--find-links", "-t", "--target", "--prefix", "--root"}


def declared() -> set[str]:
    """Every distribution pyproject.toml requires, core or extra, by its normalised name."""
    lines = PROJECT["dependencies"] + [r for extra in PROJECT["optional-dependencies"].values() for r in extra]
    return {normalise(Requirement(line).name) for line in lines} - {normalise(OWN)}


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def install_commands(text: str) -> list[str]:
    """Each ``pip install ...`` (also ``uv pip install``, ``pipx install``) in a page, up to its shell's end."""
    found = []
    for match in re.finditer(r"(?:pip|pipx)\s+install\s+([^\n`|;&#]*)", text):
        found.append(match.group(1).strip())
    return found


def named_packages(arguments: str) -> list[str]:
    """The words of one install command that name something to install (options and their values left out)."""
    words = shlex.split(arguments)
    names, skip = [], False
    for word in words:
        if skip:
            skip = False
            continue
        if word in VALUE_OPTIONS:
            skip = True
            continue
        if word in ("-e", "--editable") or word.startswith("-"):
            continue
        names.append(word)
    return names


def refusal(word: str, allowed: set[str]) -> str | None:
    """Why ``word`` may not be installed from a page, or None when it may."""
    if word.startswith((".", "/", "~", "$")):  # this source tree, a checkout of it, a variable holding one
        return None
    try:
        requirement = Requirement(word)
    except InvalidRequirement:
        return f"{word!r} is neither a path nor a requirement"
    name = normalise(requirement.name)
    if name == normalise(OWN):
        return None if requirement.url else f"{word!r}: {OWN} has no release; install it by path or direct reference"
    if name in allowed:
        return None
    return f"{word!r} names {requirement.name}, which this project neither owns nor requires"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_install_command_names_only_what_the_project_owns(page):
    allowed = declared()
    problems = [f"{page.name}: pip install {command}: {why}"
                for command in install_commands(page.read_text())
                for word in named_packages(command)
                if (why := refusal(word, allowed))]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("command, bad", [
    ("parity", True), ("'parity[mlx]'", True), ("ffn-parity", True), ("requests", True),
    ("-c constraints.txt -e .", False), ("-e '.[mlx]'", False), ("./.parity", False),
    ("'mlx[cpu]>=0.25'", False), ("'ffn-parity @ git+https://example.invalid/parity.git'", False),
])
def test_the_rule_refuses_the_squatted_name_and_keeps_the_checkout(command, bad):
    """The check itself can fail: the name on the index (with or without an extra), and a package nobody
    declared, are refused; paths, the direct reference and declared frameworks are not."""
    allowed = declared()
    assert any(refusal(word, allowed) for word in named_packages(command)) is bad
