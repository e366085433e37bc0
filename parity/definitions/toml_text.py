"""TOML as text: where a key stands in a file (for errors that name the line), and mapping files written
back (``--save-mapping``, the templates printed when routes cannot be inferred).
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from parity.definitions.files import one_line


def mapping_text(extends: str, target_class: str, args: dict[str, Any] | None, tensors: dict[str, Any],
                 comments: dict[str, str] | None = None, header: str = "") -> str:
    """A mapping file that extends another and gives its own [target] and [tensors] (``--save-mapping``,
    and the mapping printed when routes cannot be read off names).  ``comments``: per tensor key."""
    comments = comments or {}
    # control characters (an ESC or DEL in a path) shown escaped: TOML refuses them even in a comment
    lines = [f"# {one_line(line)}" if line else "#" for line in header.splitlines()]
    lines += [f"extends = {toml_value(extends)}", "", "[target]", f"class = {toml_value(target_class)}"]
    if args is not None:
        lines.append(f"args = {toml_value(args)}")
    lines += ["", "[tensors]   # target parameter = checkpoint tensor (names relative to the layer)"]
    for key, spelled in tensors.items():
        comment = f"   # {comments[key]}" if comments.get(key) else ""
        lines.append(f"{toml_value(key)} = {toml_value(spelled)}{comment}")
    return "\n".join(lines) + "\n"


SAVED_MAPPING_MARK = "# Written by `parity "  # the first line of every mapping --save-mapping writes
SEAL = re.compile(r" \[sha256 ([0-9a-f]{64}) of the lines below\]$")  # the first line's end: what parity wrote


def sealed(text: str) -> str:
    """``text`` (a mapping whose first line is SAVED_MAPPING_MARK's) with the SHA-256 of its other lines appended
    to its first line: parity can later tell a file it wrote from one the user has edited since."""
    first, _, rest = text.partition("\n")
    return f"{first} [sha256 {hashlib.sha256(rest.encode('utf-8')).hexdigest()} of the lines below]\n{rest}"


def untouched_since_saved(text: str) -> bool:
    """Whether ``text`` is a mapping --save-mapping wrote, unchanged since: its mark, and a seal that matches the
    lines below it.  A file without a seal (an older parity's) cannot be told apart from an edited one: False."""
    first, _, rest = text.partition("\n")
    seal = SEAL.search(first)
    return (first.startswith(SAVED_MAPPING_MARK) and seal is not None
            and seal.group(1) == hashlib.sha256(rest.encode("utf-8")).hexdigest())


def toml_text(tables: dict[str, Any]) -> str:
    """Plain data as TOML: top-level values, then one [table] per dict (nested dicts as inline tables)."""
    lines = [f"{toml_key(k)} = {toml_value(v)}" for k, v in tables.items() if not isinstance(v, dict)]
    for name, table in tables.items():
        if isinstance(table, dict):
            lines += ["", f"[{toml_key(name)}]"]
            lines += [f"{toml_key(k)} = {toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def toml_key(key: str) -> str:
    """A key bare where TOML allows it (``args = { config = "config" }``), else quoted."""
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else toml_value(key)


def toml_value(value: Any) -> str:
    """One TOML value (strings and keys quoted; None as { none = true }, the spelling ConfigValue reads)."""
    if value is None:
        return "{ none = true }"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        items = ", ".join(f"{toml_key(str(k))} = {toml_value(v)}" for k, v in value.items())
        return f"{{ {items} }}" if items else "{}"
    raise TypeError(f"no TOML spelling for {type(value).__name__}")
