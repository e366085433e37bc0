"""`parity inspect --target`: the target built as a check builds it and the routes a check would use, computing
nothing; `parity inspect --allow-pickle` for pickle-based checkpoints, with the check's meaning."""

import json
import shutil
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from parity import cli

from .support import run_main

META_FFN = '''
import torch.nn as nn
import torch.nn.functional as F


class FeedForward(nn.Module):  # Meta's names; the sizes read as Meta's ModelArgs names them
    def __init__(self, config):
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.hidden_dim, bias=False)
        self.w2 = nn.Linear(config.hidden_dim, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Ambiguous(nn.Module):  # two names no table knows, of one shape
    def __init__(self, config):
        super().__init__()
        self.left = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.right = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)


class Unbuildable(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.frobnicate_width)
'''
META_ROUTES = {"w1.weight": "gate_proj.weight", "w2.weight": "down_proj.weight", "w3.weight": "up_proj.weight"}


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory) -> Path:
    config = LlamaConfig(hidden_size=32, intermediate_size=88, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=64)
    torch.manual_seed(5)
    model = LlamaForCausalLM._from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.05)
    folder = tmp_path_factory.mktemp("llama") / "ckpt"
    model.save_pretrained(folder)
    return folder


@pytest.fixture()
def in_tmp(tmp_path, monkeypatch) -> Path:
    """The working directory holds the user's module (imported from it, as `parity` in a shell does)."""
    (tmp_path / "meta_ffn_it.py").write_text(textwrap.dedent(META_FFN))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_inspect_shows_the_routes_read_off_the_targets_names(llama_checkpoint, in_tmp, capsys, monkeypatch):
    from parity.sources.checkpoint import Checkpoint

    def no_running(*_args, **_kwargs):
        raise AssertionError("inspect must neither load tensors nor run a module")

    with monkeypatch.context() as patched:
        patched.setattr(Checkpoint, "read", no_running)
        patched.setattr("torch.nn.Module.__call__", no_running)
        code, out, err = run_main(capsys, "inspect", llama_checkpoint, "--target", "meta_ffn_it:FeedForward", "--json")
        assert code == 0, err
        info = json.loads(out)
        code, text, err = run_main(capsys, "inspect", llama_checkpoint, "--target", "meta_ffn_it:FeedForward")
        assert code == 0, err
    assert info["target_routes"]["inferred"] is True and info["target_routes"]["tensors"] == META_ROUTES
    assert info["target_error"] is None and info["target_problem"] is None
    assert info["target_args"] == {"config": "LlamaConfig"}
    assert ("routes       w1.weight ← gate_proj.weight, w2.weight ← down_proj.weight, w3.weight ← up_proj.weight "
            "(inferred from parameter names)") in text
    assert "note: target config: `dim` not in LlamaConfig, supplied 32" in text  # the view's answers, shown
    assert "note: target config: `hidden_dim` not in LlamaConfig, supplied 88" in text
    # the routes a check then uses are the ones inspect showed
    code, out, err = run_main(capsys, llama_checkpoint, "--target", "meta_ffn_it:FeedForward", "--json", "-")
    assert code == 0, err
    assert json.loads(out)["routes"]["tensors"] == info["target_routes"]["tensors"]


def test_inspect_without_target_shows_the_mappings_routes(llama_checkpoint, capsys):
    code, out, err = run_main(capsys, "inspect", llama_checkpoint)
    assert code == 0, err
    assert "routes       _gate.weight ← gate_proj.weight, _up.weight ← up_proj.weight" in out
    assert "(mapping llama)" in out


def test_inspect_says_when_the_target_cannot_be_built(llama_checkpoint, in_tmp, capsys):
    code, out, err = run_main(capsys, "inspect", llama_checkpoint, "--target", "meta_ffn_it:Unbuildable")
    assert code == 2  # a check would stop too
    assert "!! target meta_ffn_it:Unbuildable cannot be built" in out and "config.frobnicate_width" in out
    assert "parity: error: target meta_ffn_it:Unbuildable cannot be built" in err and "Traceback" not in err
    assert "routes       " not in out


def test_inspect_says_when_the_names_do_not_tell(llama_checkpoint, in_tmp, capsys):
    code, out, err = run_main(capsys, "inspect", llama_checkpoint, "--target", "meta_ffn_it:Ambiguous")
    assert code == 2
    assert "cannot be filled: cannot tell which checkpoint tensor goes into which parameter" in out
    assert "a mapping to edit" in out and '"left.weight" = "?"' in out  # the same details a check prints


# -- --allow-pickle ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_bin(llama_checkpoint, tmp_path_factory) -> Path:
    """The checkpoint as older hub repositories hold it: config.json and pytorch_model.bin only."""
    from safetensors.torch import load_file

    folder = tmp_path_factory.mktemp("bin") / "llama"
    folder.mkdir()
    shutil.copy(llama_checkpoint / "config.json", folder / "config.json")
    torch.save(load_file(str(llama_checkpoint / "model.safetensors")), folder / "pytorch_model.bin")
    return folder


def test_inspect_of_pickle_weights_needs_allow_pickle(llama_bin, capsys):
    code, out, err = run_main(capsys, "inspect", llama_bin)
    assert code == 2 and "--allow-pickle" in err and "Traceback" not in err
    code, out, err = run_main(capsys, "inspect", llama_bin, "--allow-pickle")
    assert code == 0, err
    assert "model.layers.0.mlp.gate_proj.weight  [88, 32]" in out and "pytorch_model.bin" in out


def test_allow_pickle_is_in_inspect_help(capsys):
    with pytest.raises(SystemExit):
        cli.main(["inspect", "--help"])
    assert "--allow-pickle" in capsys.readouterr().out
