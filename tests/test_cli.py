"""The `parity` command: exit codes, table, JSON.  In this process (parity.cli.main), except where the
process is the point: --help and --version stay light (what a fresh interpreter imports)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .support import offline_home, run_main, run_parity


@pytest.mark.slow  # a fresh interpreter: what --version, --help and `list` import
def test_version_and_help_are_light():
    out = run_parity("--version")
    assert out.returncode == 0 and out.stdout.startswith("parity ")
    assert run_parity("--help").returncode == 0
    code = ("import sys, parity.cli; parity.cli.main(['list']); "
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert probe.stdout.strip().endswith("False False")  # how long they take: scripts/bench.py, never a test


def test_list_shows_every_family(capsys):
    code, out, _ = run_main(capsys, "list")
    assert code == 0
    for name in ("gpt2", "openai-gpt", "llama", "mistral", "qwen2", "gemma"):
        assert f"  {name} " in out


def test_pass_exit_0_with_table_and_json(tiny, tmp_path, capsys):
    report_path = tmp_path / "r.json"
    code, out, err = run_main(capsys, tiny["llama"], "--layers", "0,2", "--json", report_path)
    assert code == 0, err
    assert "PASS" in out and "max|Δ|" in out
    data = json.loads(report_path.read_text())
    assert data["passed"] is True and data["weights"] == "real"
    assert data["reference_activation"] == "silu" and data["target"] == "parity.ffn:SwiGLU"
    assert set(data["versions"]) >= {"transformers", "torch"}
    assert [layer["layer"] for layer in data["layers"]] == [0, 2]
    for layer in data["layers"]:
        assert set(layer) >= {"layer", "passed", "max_abs_diff", "max_rel_diff", "noise_floor", "tolerance"}
    for key in ("model", "checkpoint", "target"):
        assert isinstance(data[key], str)


def test_mismatch_exit_1_json_to_stdout(tiny, capsys):
    code, out, err = run_main(capsys, tiny["llama"], "--layer", "1", "--target", "tests.mutants:SwappedSwiGLU",
                              "--json", "-")
    assert code == 1, err
    data = json.loads(out)
    assert data["passed"] is False and data["layers"][0]["passed"] is False
    assert "MISMATCH" in err


def test_exact_gelu_gpt2_exit_1(tiny, capsys):
    code, out, _ = run_main(capsys, tiny["gpt2"], "--target", "tests.mutants:gpt2_exact_gelu")
    assert code == 1 and "MISMATCH" in out


def test_atol_override(tiny, capsys):
    code, out, _ = run_main(capsys, tiny["gpt2"], "--layer", "0", "--target", "tests.mutants:gpt2_exact_gelu",
                            "--atol", "1", "--json", "-")
    assert code == 0
    assert json.loads(out)["layers"][0]["tolerance"] == 1.0


@pytest.mark.parametrize("args, message", [
    (["/no/such/folder"], "no such file or folder"),
    (["not-a-mapping-name"], "not a mapping name"),
    (["someone/some-model"], "not in the local Hugging Face cache"),
    (["{llama}", "--layer", "7"], "out of range"),
    (["{llama}", "--target", "nowhere.mod:X"], "cannot import"),
    (["{llama}", "--mapping", "/no/such.toml"], "mapping file not found"),
])
def test_bad_input_exit_2_without_traceback(tiny, args, message, capsys):
    args = [a.replace("{llama}", str(tiny["llama"])) for a in args]
    code, out, err = run_main(capsys, *args)
    assert code == 2, (out, err)
    assert message in err
    assert "Traceback" not in err


def test_gpt2_offline_falls_back_to_synthetic_gpt2_small(tmp_path, monkeypatch, capsys):
    empty = offline_home(monkeypatch, tmp_path)  # HF_HOME empty, PARITY_CACHE tmp_path/cache
    code, out, err = run_main(capsys, "gpt2", "--json", tmp_path / "r.json")
    assert code == 0, err
    assert "SYNTHETIC" in out and "openai-community/gpt2" in out
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["weights"] == "synthetic" and len(data["layers"]) == 12
    # written in GPT-2's real on-disk format: HF names, Conv1D [in, out] layout, safetensors
    from safetensors import safe_open

    folder = Path(data["checkpoint"])
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(folder / index["h.0.mlp.c_fc.weight"]), framework="pt") as f:
        assert f.get_slice("h.0.mlp.c_fc.weight").get_shape() == [768, 3072]
    assert not any(path.name.startswith(".") for path in empty.glob("*")) if empty.exists() else True


def test_hub_id_from_offline_cache_via_cli(hf_cache, capsys):  # hf_cache: HF_HOME, as a process would get it
    code, out, err = run_main(capsys, "tiny-org/gpt2", "--layers", "1-2")
    assert code == 0, err
    assert "tiny-org/gpt2 (real weights)" in out
