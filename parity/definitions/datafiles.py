"""Where parity's data files are: the built-in mappings and the alias table beside them (no imports of parity)."""

from __future__ import annotations

from pathlib import Path

ALIASES_FILE = "aliases.toml"  # parameter names by role (parity.definitions.aliases); not a mapping
NOT_MAPPINGS = (ALIASES_FILE,)  # data files in the mappings folder that are not mappings


def builtin_mapping_dir() -> Path:
    """Where the built-in mappings live: inside the wheel, or ``mappings/`` of a source checkout."""
    packaged = Path(__file__).resolve().parent.parent / "mappings"  # parity/mappings in a wheel
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parent.parent.parent / "mappings"  # the repository's, in a checkout
