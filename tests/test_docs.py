"""The documentation: the MkDocs site builds strictly, every report field is described in the JSON Schema (the
docs' field tables are generated from it), the README stays a five-minute read, and every command it shows runs
from a plain install (example modules from parity.examples, never the test suite's mutants)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SETUP_COMMANDS = [
    "pip install -c constraints.txt -e . && parity gpt2",
    'pip install -c constraints.txt -e ".[test]" && ruff check . && python -m pytest -q',
]
MAX_README_LINES = 260


@pytest.mark.slow
def test_the_docs_build_strictly(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed (it comes with the test extra: pip install -e '.[test]')")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    fields = (tmp_path / "site" / "json" / "index.html").read_text(encoding="utf-8")
    assert "<code>max_abs_diff</code>" in fields and "generated: json-fields" not in fields
    diagnoses = (tmp_path / "site" / "diagnoses" / "index.html").read_text(encoding="utf-8")
    assert "<code>gate_up_swapped</code>" in diagnoses and "generated: diagnoses" not in diagnoses


def _described(schema: dict, definition: str) -> set[str]:
    properties = schema["$defs"][definition]["properties"]
    return {name for name, rule in properties.items() if rule.get("description")}


def test_every_report_field_has_a_description_in_the_schema(tiny):
    """A new field of the JSON report needs a description in report.schema.json (docs/json.md is generated)."""
    import parity
    from parity.engine.results import SCHEMA_FILE

    schema = json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))
    data = parity.check(str(tiny["gpt2"]), layers=[0]).to_dict()
    assert set(data) - _described(schema, "report") == set()
    assert set(data["layers"][0]) - _described(schema, "layer") == set()
    for definition in ("report", "layer", "suite", "error", "layer_baseline"):
        undescribed = set(schema["$defs"][definition]["properties"]) - _described(schema, definition)
        assert not undescribed, f"{definition}: {sorted(undescribed)} have no description"


def test_the_readme_is_short_and_keeps_the_two_set_up_commands():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= MAX_README_LINES
    for command in SETUP_COMMANDS:
        assert f"```bash\n{command}\n```" in text, command
    assert "<!-- json-fields -->" not in text  # the field table lives in the schema and docs/json.md now


def test_documented_commands_use_shipped_examples():
    """A pip-installed user has parity.examples, not the repository's tests/mutants.py."""
    import parity.examples

    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        text = page.read_text(encoding="utf-8")
        assert "tests.mutants:" not in text, f"{page.name} shows a command with a test-suite mutant"
        for name in re.findall(r"parity\.examples:(\w+)", text):
            assert hasattr(parity.examples, name), f"{page.name}: parity.examples has no {name}"
