"""The built-in mappings ship inside the wheel, and an installed wheel finds them."""

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow  # builds a wheel with pip, installs it, runs a fresh interpreter on it


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    pytest.importorskip("hatchling")
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(ROOT)], check=True, capture_output=True, timeout=300)
    (built,) = out.glob("ffn_parity-*.whl")  # the distribution ffn-parity; the import name stays parity
    return built


def test_wheel_carries_every_mapping(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for toml in (ROOT / "mappings").glob("*.toml"):  # aliases.toml, the parameter names by role, too
        assert f"parity/mappings/{toml.name}" in names
    assert "parity/mappings/aliases.toml" in names
    assert "parity/schema/report.schema.json" in names  # the JSON Schema of --json
    assert any(n.endswith("entry_points.txt") for n in names)


def test_installed_wheel_lists_builtin_mappings(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    code = ("import json, parity.definitions.registry as m, parity.definitions.aliases as a; "
            "import parity.engine.results as r; "
            "print(m.builtin_mapping_dir()); print(json.dumps(sorted(m.builtin_mappings()))); "
            "print(a.load_aliases().path); print(r.SCHEMA_FILE.is_file())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.returncode == 0, out.stderr
    folder, names, aliases, schema = out.stdout.splitlines()
    assert folder == str(target / "parity" / "mappings")
    assert aliases == str(target / "parity" / "mappings" / "aliases.toml") and schema == "True"
    assert {"gpt2", "llama", "gemma", "mistral", "qwen2", "openai-gpt"} <= set(json.loads(names))


def test_the_distribution_name_is_the_one_messages_use():
    """pyproject's [project].name and the name parity asks importlib.metadata about are one."""
    import tomllib

    from parity.definitions.distribution import DISTRIBUTION

    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"] == DISTRIBUTION
