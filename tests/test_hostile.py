"""Hostile files and faults that the broken-input table (tests/test_errors.py) cannot express: a full
disk on stdout, Ctrl-C delivered twice, unreadable files, targets that are not module builders,
weights stored in several dtypes, interrupted writes into the synthetic cache, and the memory a
run over a few-KB file may take whatever its header claims."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import parity
from parity.definitions.datafiles import builtin_mapping_dir
from parity.definitions.files import read_text
from parity.definitions.mapping_parser import load_mapping
from parity.errors import CheckpointError, MappingError, ProjectConfigError, TargetError

from .support import PARITY, ROOT, default_sigint

ST = "model.safetensors"
UP0 = "model.layers.0.mlp.up_proj.weight"
GATE0 = "model.layers.0.mlp.gate_proj.weight"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


# -- every file parity reads is a regular file, read in bounded size ------------------------------
def test_special_files_are_refused_by_name_without_reading(tmp_path):
    os.mkfifo(tmp_path / "pipe.toml")
    (tmp_path / "folder.toml").mkdir()
    cases = {tmp_path / "pipe.toml": "FIFO", tmp_path / "folder.toml": "a folder", Path("/dev/zero"): "device",
             tmp_path / "missing.toml": "not found"}
    for path, said in cases.items():
        with pytest.raises(MappingError, match=said) as info:
            read_text(path, "mapping file", MappingError)
        assert str(path) in str(info.value) and "mapping file" in str(info.value)
    big = tmp_path / "big.json"
    big.write_bytes(b" " * 2048)
    with pytest.raises(CheckpointError, match="2048 bytes, more than the 1024"):
        read_text(big, "config.json", CheckpointError, limit=1024)


def test_unreadable_config_json_is_not_called_invalid_json(tiny, tmp_path, monkeypatch):
    folder = shutil.copytree(tiny["llama"], tmp_path / "ckpt")
    import parity.definitions.files as files

    real_open = files.os.open

    def deny(path, *args, **kwargs):
        if str(path).endswith("config.json"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(files.os, "open", deny)
    with pytest.raises(CheckpointError, match=r"config\.json: config\.json cannot be read: permission denied") as info:
        parity.check(str(folder))
    assert "not valid JSON" not in str(info.value)


def test_unreadable_folder_says_permission_denied(tiny, tmp_path, monkeypatch):
    folder = shutil.copytree(tiny["llama"], tmp_path / "ckpt")
    import parity.sources.registry as registry

    monkeypatch.setattr(registry.os, "access", lambda path, mode: Path(path) != folder)
    with pytest.raises(CheckpointError, match="cannot be read \\(permission denied\\)"):
        parity.check(str(folder))


# -- the command line: one line on stderr, whatever happens to stdout or how often Ctrl-C comes -----
@pytest.mark.slow  # a real process whose stdout is /dev/full
def test_stdout_on_a_full_disk_is_an_error_not_a_traceback():
    with open("/dev/full", "w") as full:
        out = subprocess.run([*PARITY, "list"], stdout=full, stderr=subprocess.PIPE, text=True, env=ENV, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == "parity: error: cannot write to standard output: No space left on device"


SLOW_TARGET = """
    import pathlib, time
    from parity.ffn import SwiGLU

    class Slow(SwiGLU):
        def forward(self, x):
            pathlib.Path("running").touch()
            time.sleep(60)
            return super().forward(x)
"""


@pytest.mark.slow  # real SIGINTs into a real process
def test_ctrl_c_delivered_twice_exits_130_without_a_traceback(tiny, tmp_path):
    (tmp_path / "slow_target.py").write_text(textwrap.dedent(SLOW_TARGET))
    process = subprocess.Popen([sys.executable, "-m", "parity", str(tiny["llama"]), "--layer", "0", "--target",
                                "slow_target:Slow"], cwd=tmp_path, env=ENV, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "running").exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (tmp_path / "running").exists(), process.communicate(timeout=10)
        for pause in (0.0, 0.01, 0.3):  # as `timeout` and process managers do: more than one SIGINT
            time.sleep(pause)
            process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 130, err
    assert err.strip().endswith("parity: interrupted") and "Traceback" not in err and "Exception ignored" not in err


# -- targets are imported code; parity calls only what builds a module ------------------------------
def test_a_target_naming_a_shell_function_never_runs(tiny, tmp_path):
    marker = tmp_path / "PWNED"
    text = (builtin_mapping_dir() / "llama.toml").read_text()
    start = text.index("args = {")
    mapping = tmp_path / "m.toml"
    mapping.write_text(text.replace('class = "parity.ffn:SwiGLU"', 'class = "os:system"')
                       .replace(text[start:text.index("\n", start)], f'args = {{ command = "touch {marker}" }}'))
    with pytest.raises(TargetError, match="built-in function.*does not call it"):
        parity.check(str(tiny["llama"]), mapping=str(mapping), layers=[0])
    assert not marker.exists()
    for spec in ("subprocess:Popen", "builtins:exec", "os:path", "collections:OrderedDict"):
        with pytest.raises(TargetError, match="not an nn.Module class or a Python function|derives from none of"):
            parity.check(str(tiny["llama"]), target=spec, layers=[0])


# -- weights as checkpoints ship them ---------------------------------------------------------------
def test_mixed_float_dtypes_in_one_layer_are_computed_in_the_widest(tiny, tmp_path):
    folder = shutil.copytree(tiny["llama"], tmp_path / "ckpt")
    tensors = load_file(str(folder / ST))
    tensors[UP0] = tensors[UP0].double()
    tensors[GATE0] = tensors[GATE0].bfloat16()
    save_file(tensors, str(folder / ST), metadata={"format": "pt"})
    report = parity.check(str(folder), layers=[0])
    assert report.passed, report.layers
    from .mutants import SwappedSwiGLU

    assert not parity.check(str(folder), layers=[0], target=SwappedSwiGLU).passed  # still tells modules apart
    from parity.engine.layer import common_dtype

    upcast = common_dtype({"a": torch.zeros(2, dtype=torch.bfloat16), "b": torch.zeros(2, dtype=torch.float64)})
    assert {t.dtype for t in upcast.values()} == {torch.float64}


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_weights_are_refused_with_the_reason(tiny, tmp_path, dtype):
    folder = shutil.copytree(tiny["llama"], tmp_path / "ckpt")
    tensors = load_file(str(folder / ST))
    tensors[UP0] = tensors[UP0].to(dtype)
    save_file(tensors, str(folder / ST), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{UP0}.*{str(dtype).removeprefix('torch.')} \(FP8\).*scale"):
        parity.check(str(folder), layers=[0])


# -- interrupted runs leave nothing a later run trusts ----------------------------------------------
@pytest.fixture()
def small_synthetic(tmp_path, monkeypatch):
    """A mapping whose synthetic stand-in is tiny (2 layers of d=32), in a private cache."""
    monkeypatch.setenv("PARITY_CACHE", str(tmp_path / "cache"))
    text = (builtin_mapping_dir() / "llama.toml").read_text()
    for old, new in (("hidden_size = 2048", "hidden_size = 32"), ("intermediate_size = 5632", "intermediate_size = 88"),
                     ("num_hidden_layers = 22", "num_hidden_layers = 2"), ("num_attention_heads = 32",
                                                                         "num_attention_heads = 2"),
                     ("num_key_value_heads = 4", "num_key_value_heads = 2"), ('name = "llama"', 'name = "tiny/../x"')):
        assert old in text
        text = text.replace(old, new)
    (tmp_path / "m.toml").write_text(text)
    return load_mapping(tmp_path / "m.toml")


def test_interrupted_synthetic_shard_write_leaves_no_file(small_synthetic, tmp_path, monkeypatch):
    import safetensors.torch

    from parity.sources.synthetic import synthetic_checkpoint

    checkpoint = synthetic_checkpoint(small_synthetic, "test")
    folder = Path(checkpoint.location)
    assert folder.parent == tmp_path / "cache" / "synthetic"  # the mapping's name cannot leave the cache
    real_save = safetensors.torch.save_file

    def interrupted(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half a shard")
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", interrupted)
    name = next(n for n in sorted(checkpoint.weight_map) if n.endswith("gate_proj.weight"))
    with pytest.raises(KeyboardInterrupt):
        checkpoint.read([name])
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors.index.json"]
    monkeypatch.setattr(safetensors.torch, "save_file", real_save)
    assert checkpoint.read([name])[name].shape == (88, 32)
    shard = folder / checkpoint.weight_map[name]
    shard.write_bytes(shard.read_bytes()[:100])  # damaged after the fact (a full disk, a hand): written again
    assert checkpoint.read([name])[name].shape == (88, 32)


# -- memory: bounded by what is real, not by what a header claims -----------------------------------
# The child's own peak: VmHWM belongs to its address space, which exec makes new.  ru_maxrss would not do on Linux:
# it survives fork + exec, so a child of a large pytest process (one that imported JAX, MLX and the ONNX exporter)
# would report the parent's peak as its own.
MEMORY_PROBE = """
import json, resource, sys
from pathlib import Path
import parity.cli
codes = [parity.cli.main(argv) for argv in json.loads(sys.argv[1])]
status = Path("/proc/self/status")
lines = [l for l in status.read_text().splitlines() if l.startswith("VmHWM:")] if status.exists() else []
peak = int(lines[0].split()[1]) if lines else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"codes": codes, "peak_kb": peak}))
"""


@pytest.mark.slow  # a fresh process: its peak RSS is what is measured
def test_claimed_sizes_allocate_nothing(tiny, tmp_path):
    from .conftest import build_model
    from .gguf_files import Q, gguf_from_hf
    from .hostile_files import UINT32, Value, gguf_bytes, read_gguf

    gguf = read_gguf(gguf_from_hf(build_model("llama", seed=3), tmp_path / "ok.gguf", "llama", Q.F32))
    next(t for t in gguf.tensors if t.name == "blk.0.ffn_up.weight").dims = [32, 36_000_000]  # 4.6 GB of F32
    (tmp_path / "dims.gguf").write_bytes(gguf_bytes(gguf))
    gguf.metadata["llama.block_count"] = Value(UINT32, 2**31)
    (tmp_path / "blocks.gguf").write_bytes(gguf_bytes(gguf))
    folder = shutil.copytree(tiny["llama"], tmp_path / "layers")
    config = json.loads((folder / "config.json").read_text()) | {"num_hidden_layers": 2**31}
    (folder / "config.json").write_text(json.dumps(config))
    runs = [[str(tmp_path / "dims.gguf"), "--layer", "0"], [str(tmp_path / "blocks.gguf")],
            [str(folder), "--layer", "0"], [str(tiny["llama"]), "--layers", "0-149999999"]]
    out = subprocess.run([sys.executable, "-c", MEMORY_PROBE, json.dumps(runs)], capture_output=True, text=True,
                         env=ENV, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["codes"] == [2, 2, 2, 2], out.stderr
    assert result["peak_kb"] < 1024 * 1024, f"peak RSS {result['peak_kb'] // 1024} MB for files of a few KB"
    assert "internal error" not in out.stderr


# -- project files --------------------------------------------------------------------------------
def test_project_file_tool_key_and_missing_table(tmp_path):
    from parity.definitions.project import load_project

    (tmp_path / "pyproject.toml").write_text('tool = "x"\n')
    with pytest.raises(ProjectConfigError, match="'tool' = 'x' must be a table"):
        load_project(tmp_path / "pyproject.toml")
    with pytest.raises(ProjectConfigError, match="'tool' = 'x' must be a table"):
        load_project(cwd=tmp_path)
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n')
    with pytest.raises(ProjectConfigError, match="has no \\[tool.parity\\] table"):
        load_project(tmp_path / "pyproject.toml")
