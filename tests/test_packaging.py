"""The built-in mappings ship inside the wheel, and an installed wheel finds them."""

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    pytest.importorskip("hatchling")
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(ROOT)], check=True, capture_output=True, timeout=300)
    (built,) = out.glob("parity-*.whl")
    return built


def test_wheel_carries_every_mapping(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for toml in (ROOT / "mappings").glob("*.toml"):
        assert f"parity/mappings/{toml.name}" in names
    assert any(n.endswith("entry_points.txt") for n in names)


def test_installed_wheel_lists_builtin_mappings(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    code = "import json, parity.spec.mapping as m; print(m.builtin_mapping_dir()); print(json.dumps(sorted(m.builtin_mappings())))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.returncode == 0, out.stderr
    folder, names = out.stdout.splitlines()
    assert folder == str(target / "parity" / "mappings")
    assert {"gpt2", "llama", "gemma", "mistral", "qwen2", "openai-gpt"} <= set(json.loads(names))
