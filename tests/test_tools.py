"""parity inspect, assert_parity and its pytest fixture, the progress bar."""

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from parity import cli
from parity.definitions.families import dff_rule
from parity.engine.check.inspect import inspect_model, render_inspection
from parity.outputs.progress import Progress, bar_wanted
from parity.testing import ParityAssertionError, assert_parity

ROOT = Path(__file__).resolve().parent.parent


# -- inspect ---------------------------------------------------------------------------------------

def test_dff_rules():
    assert dff_rule("llama", 4096, 11008)["follows"] is True
    assert dff_rule("llama", 4096, 10752)["follows"] is False  # rounded down: the classic bug
    assert dff_rule("llama", 288, 768)["follows"] is True  # llama2.c stories15M
    assert "multiple_of=32" in dff_rule("llama", 100, 288)["rule"]  # 266 rounded up to 32, not 256
    assert dff_rule("gpt2", 768, 3072)["follows"] is True and dff_rule("gpt2", 768, 2048)["follows"] is False
    assert dff_rule("mistral", 4096, 14336)["follows"] is True
    assert dff_rule("gemma", 2048, 16384)["follows"] is True
    assert dff_rule("qwen2", 32, 72) == {"rule": None, "expected": None, "follows": None, "ratio": 2.25}


def test_inspect_reads_headers_only(tiny, monkeypatch):
    from parity.sources.checkpoint import Checkpoint

    def no_reading(*_args, **_kwargs):
        raise AssertionError("inspect must not load tensors")

    monkeypatch.setattr(Checkpoint, "read", no_reading)
    monkeypatch.setattr("torch.nn.Module.__call__", no_reading)
    info = inspect_model(str(tiny["gpt2"]), layer=2)
    assert info["family"] == "gpt2" and info["mapping_file"].endswith("gpt2.toml")
    assert (info["hidden_size"], info["intermediate_size"], info["intermediate_rule"]["follows"]) == (32, 128, True)
    assert info["activation"]["transformers_runs"] == "gelu_new" and info["biases"] == ["c_fc.bias", "c_proj.bias"]
    tensors = {t["name"]: t for t in info["tensors"]}
    assert tensors["transformer.h.2.mlp.c_fc.weight"]["shape"] == [32, 128]  # Conv1D [in, out], as stored
    assert ({t["dtype"] for t in tensors.values()} == {"F32"}
            and {t["file"] for t in tensors.values()} == {"model.safetensors"})
    text = render_inspection(info)
    assert "follows 4d (GPT) = 128" in text and "transformer.h.2.mlp.c_proj.bias" in text


def test_inspect_gemma1_override_and_sharded_files(tiny, llama_sharded, capsys):
    assert cli.main(["inspect", str(tiny["gemma"]), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["activation"]["config"] == {"hidden_act": "gelu"}
    assert info["activation"]["transformers_runs"] == "gelu_pytorch_tanh"
    assert any("overrides it to 'gelu_pytorch_tanh'" in n for n in info["activation"]["overrides"])
    assert info["intermediate_rule"]["rule"] == "8d (Gemma 1)" and info["intermediate_rule"]["follows"] is True
    assert cli.main(["inspect", str(llama_sharded), "--layer", "2"]) == 0
    out = capsys.readouterr().out
    index = json.loads((llama_sharded / "model.safetensors.index.json").read_text())["weight_map"]
    shard = index["model.layers.2.mlp.down_proj.weight"]
    assert f"model.layers.2.mlp.down_proj.weight  [32, 88]  F32  {shard}" in out
    assert "does NOT follow llama_intermediate_size(32)" in out


def test_inspect_bad_layer_exit_2(tiny, capsys):
    assert cli.main(["inspect", str(tiny["llama"]), "--layer", "9"]) == 2
    assert "out of range" in capsys.readouterr().err


def test_inspect_synthetic_default_writes_no_shard(tmp_path, monkeypatch):
    monkeypatch.setenv("PARITY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty"))
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty" / "hub"))
    info = inspect_model("llama", layer=21)
    assert info["weights"] == "synthetic" and info["intermediate_rule"]["follows"] is True  # 2048 -> 5632
    assert {t["shape"][0] for t in info["tensors"] if "gate" in t["name"]} == {5632}
    assert not list((tmp_path / "cache").rglob("model-*.safetensors"))


# -- assert_parity -----------------------------------------------------------------------------------

def test_assert_parity_passes_and_fails_readably(tiny):
    from tests.mutants import SwappedSwiGLU

    report = assert_parity(str(tiny["llama"]), layers=[0, 2])
    assert report.passed and [r.layer for r in report.layers] == [0, 2]
    with pytest.raises(AssertionError) as info:
        assert_parity(str(tiny["llama"]), target=SwappedSwiGLU, layers=[1])
    message = str(info.value)
    assert "max|Δ|" in message and "MISMATCH" in message and "FAIL: 1 of 1" in message
    assert isinstance(info.value, ParityAssertionError) and not info.value.report.passed


def test_assert_parity_can_require_real_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty"))
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty" / "hub"))
    with pytest.raises(AssertionError, match="real weights are required"):
        assert_parity("gpt2", layers=[0], require_real=True)


@pytest.mark.slow  # a user's own pytest run, in its own process, with the plugin loaded as its users load it
def test_pytest_fixture_in_a_users_suite(tiny, tmp_path):
    (tmp_path / "test_user.py").write_text(f'''
from tests.mutants import SwappedSwiGLU

def test_good(parity_check):
    parity_check({str(tiny["llama"])!r}, layers=[0])

def test_bad(parity_check):
    parity_check({str(tiny["llama"])!r}, target=SwappedSwiGLU, layers=[0])
''')
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:parity", "-p", "parity.pytest_plugin",
                          "-p", "no:cacheprovider", str(tmp_path / "test_user.py")],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert "1 failed, 1 passed" in out.stdout, out.stdout + out.stderr
    assert "ParityAssertionError" in out.stdout and "MISMATCH" in out.stdout


# -- progress -----------------------------------------------------------------------------------------

class Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_only_on_a_terminal_and_not_when_quiet():
    assert bar_wanted(False, False, Tty()) is True
    assert bar_wanted(False, False, io.StringIO()) is False  # CI log
    assert bar_wanted(True, False, Tty()) is False  # --quiet
    assert bar_wanted(False, True, Tty()) is False  # --json -


def test_progress_bar_draws_on_stderr_and_lets_lines_through(capsys):
    progress = Progress(3, enabled=True)
    progress.say("a table line")
    for layer in range(3):
        progress.step(f"gpt2 layer {layer}")
    progress.close()
    out, err = capsys.readouterr()
    assert out == "a table line\n" and "3/3" in err
    single = Progress(1, enabled=True)  # one layer: no bar
    assert single.bar is None
