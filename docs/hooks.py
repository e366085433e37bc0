"""MkDocs hook: the pages' generated tables, from the sources that define them.

* ``<!-- generated: json-fields -->`` (docs/json.md) becomes the JSON report's field tables, read from the
  descriptions in ``parity/schema/report.schema.json``: a field is documented where its schema is.
* ``<!-- generated: diagnoses -->`` (docs/diagnoses.md) becomes the diagnosis table, read from the mistake
  catalogue (``MISTAKES``: id, message, fix) and ``PRODUCED_BY`` (which replay or finding names each id).

mkdocs.yml names this file under ``hooks:``; ``mkdocs build --strict`` runs it (tests/test_docs.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

SCHEMA_FILE = Path(__file__).resolve().parent.parent / "parity" / "schema" / "report.schema.json"
JSON_FIELDS = "<!-- generated: json-fields -->"
DIAGNOSES = "<!-- generated: diagnoses -->"
EXPECTED = {"json.md": JSON_FIELDS, "diagnoses.md": DIAGNOSES}  # a page that lost its placeholder fails the build

# (heading, path of the object's schema in $defs): the documents --json writes, and the objects inside them
SECTIONS = [
    ("A check's report (`parity MODEL --json`; each `report` of a suite)", ("report",)),
    ("Each layer (`layers[]`)", ("layer",)),
    ("A layer's diagnosis (`layers[].diagnosis`)", ("diagnosis",)),
    ("A layer against the baseline (`layers[].baseline`)", ("layer_baseline",)),
    ("A suite (`parity check --json`)", ("suite",)),
    ("Each check of a suite (`checks[]`)", ("suite", "properties", "checks", "items")),
    ("A check that could not run (`kind: \"error\"`)", ("error",)),
]


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    expected = EXPECTED.get(Path(page.file.src_path).name)
    if expected is not None and expected not in markdown:
        raise ValueError(f"{page.file.src_path}: the placeholder {expected} is missing; the generated table needs it")
    if JSON_FIELDS in markdown:
        markdown = markdown.replace(JSON_FIELDS, json_fields(json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))))
    if DIAGNOSES in markdown:
        markdown = markdown.replace(DIAGNOSES, diagnoses_table())
    return markdown


# -- the JSON report's fields ------------------------------------------------------------------------------------

def json_fields(schema: dict) -> str:
    """One table per object: field, type (from the schema), required or not, and the field's description."""
    parts = []
    for heading, path in SECTIONS:
        node = schema["$defs"]
        for key in path:
            node = node[key]
        required = set(node.get("required", []))
        rows = ["| field | type | required | meaning |", "| --- | --- | --- | --- |"]
        for name, rule in node["properties"].items():
            if "description" not in rule:
                raise ValueError(f"{SCHEMA_FILE.name}: {'/'.join(path)}/{name} has no description")
            rows.append(f"| `{name}` | {cell(type_of(rule, schema))} | {'yes' if name in required else ''} "
                        f"| {cell(rule['description'])} |")
        parts.append(f"### {heading}\n\n" + "\n".join(rows))
    return "\n\n".join(parts)


def type_of(rule: dict, schema: dict) -> str:
    """The schema's type of one property, as a reader says it: `number` or `null`, `"pass"` | `"fail"` ..."""
    if "$ref" in rule:
        name = rule["$ref"].rsplit("/", 1)[-1]
        target = schema["$defs"][name]
        if name in ("number_or_null", "string_or_null", "status", "weights"):
            return type_of(target, schema)
        kinds = target.get("type", "object")
        nullable = isinstance(kinds, list) and "null" in kinds
        return f"`{name}` object" + (" or `null`" if nullable else "")
    if "oneOf" in rule:
        return " or ".join(type_of(choice, schema) for choice in rule["oneOf"])
    if "const" in rule:
        return f"`{json.dumps(rule['const'])}`"
    if "enum" in rule:
        return " \\| ".join(f"`{json.dumps(value)}`" for value in rule["enum"])
    kinds = rule.get("type")
    if kinds is None:
        return "any"
    kinds = [kinds] if isinstance(kinds, str) else kinds
    said = []
    for kind in kinds:
        if kind == "array" and isinstance(rule.get("items"), dict):
            said.append(f"array of {type_of(rule['items'], schema)}")
        else:
            said.append(f"`{kind}`")
    return " or ".join(said)


def cell(text: str) -> str:
    """Text for one table cell: a pipe outside a code span is escaped (pipes inside code spans do not split
    cells in Python-Markdown's tables)."""
    pieces = re.split(r"(`[^`]*`)", text.replace("\n", " "))
    return "".join(piece if piece.startswith("`") else piece.replace("|", "\\|") for piece in pieces)


# -- the diagnosis catalogue -------------------------------------------------------------------------------------

def catalogue() -> tuple[dict, dict]:
    """MISTAKES and PRODUCED_BY: the catalogue of parity/definitions/mistakes.py."""
    from parity.definitions.mistakes import MISTAKES, PRODUCED_BY

    return MISTAKES, PRODUCED_BY


def diagnoses_table() -> str:
    mistakes, produced_by = catalogue()
    rows = ["| id | the mistake | fix | named by |", "| --- | --- | --- | --- |"]
    for mistake_id, mistake in mistakes.items():
        rows.append(f"| `{mistake_id}` | {plain(mistake.message)} | {plain(mistake.fix)} "
                    f"| {plain(produced_by.get(mistake_id, ''))} |")
    return "\n".join(rows)


def plain(text: str) -> str:
    """Catalogue text (plain, not Markdown) in a table cell: Markdown's special characters escaped."""
    escaped = re.sub(r"([\\`*_{}\[\]>|#])", r"\\\1", text.replace("\n", " "))
    return escaped.replace("<", "&lt;")
