"""The distribution parity is installed as, and how a message tells a user to install one of its extras.

The name ``parity`` on the public package index is a placeholder held by someone else: a message that said
``pip install 'parity[mlx]'`` would one day install their upload.  So no message names that distribution.  What
an extra installs is read from the installed distribution's own metadata (pyproject.toml's
``[project.optional-dependencies]``, as pip recorded it), and the message names those packages themselves,
the ones the framework's own project publishes.
"""

from __future__ import annotations

import importlib.metadata

DISTRIBUTION = "ffn-parity"  # pyproject.toml's [project].name (tests/test_packaging.py holds them equal)


def extra_requirements(extra: str) -> list[str]:
    """The requirements ``extra`` adds on this platform, as ``name[extras]>=version`` strings, from the installed
    metadata; an empty list when parity is not installed as a distribution (a bare source tree on PYTHONPATH)."""
    from packaging.requirements import Requirement  # transformers' own dependency: always there

    try:
        declared = importlib.metadata.requires(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        return []
    found = []
    for line in declared:
        requirement = Requirement(line)
        if requirement.marker is None or not requirement.marker.evaluate({"extra": extra}):
            continue
        if requirement.marker.evaluate({"extra": ""}):
            continue  # a core requirement, true for every extra
        requirement.marker = None
        found.append(str(requirement))
    return found


def install_command(extra: str, *, fallback: str) -> str:
    """``pip install 'mlx[cpu]>=0.25'``: the packages the extra ``extra`` stands for; ``pip install FALLBACK``
    (the framework's own distribution) when the metadata is not there to ask."""
    requirements = extra_requirements(extra)
    if not requirements:
        return f"pip install {fallback}"
    return "pip install " + " ".join(f"'{r}'" for r in requirements)
