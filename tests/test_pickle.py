"""Pickle-based files: refused by default, opened with allow_pickle via torch.load(weights_only=True)."""

import json
import shutil
from pathlib import Path

import pytest
import torch

import parity
from parity.errors import CheckpointError, PickleRefusedError
from parity.ffn import SwiGLU, llama_intermediate_size

from .builders import write_meta
from .conftest import build_model
from .mutants import SwappedSwiGLU, gpt2_exact_gelu
from .support import run_main


@pytest.fixture(scope="session")
def meta(tmp_path_factory):
    return write_meta(tmp_path_factory.mktemp("meta") / "llama-meta")


@pytest.fixture(scope="session")
def gpt2_bin(tiny, tmp_path_factory):
    """An HF folder with pytorch_model.bin only (as older hub repositories are)."""
    from safetensors.torch import load_file

    folder = tmp_path_factory.mktemp("bin") / "gpt2"
    folder.mkdir()
    shutil.copy(tiny["gpt2"] / "config.json", folder / "config.json")
    torch.save(load_file(str(tiny["gpt2"] / "model.safetensors")), folder / "pytorch_model.bin")
    return folder


def test_meta_refused_without_opt_in(meta):
    with pytest.raises(PickleRefusedError, match="--allow-pickle"):
        parity.check(str(meta))
    with pytest.raises(PickleRefusedError, match="consolidated.00.pth"):
        parity.check(str(meta / "consolidated.00.pth"))


def test_meta_with_opt_in_passes_and_mutant_fails(meta):
    report = parity.check(str(meta), allow_pickle=True)
    assert report.mapping == "llama-meta" and report.passed and len(report.layers) == 2
    assert any("llama_intermediate_size(64, multiple_of=32" in note for note in report.notes)
    assert not any(r.passed for r in parity.check(str(meta), allow_pickle=True, target=SwappedSwiGLU).layers)


def test_meta_params_become_a_llama_config(meta):
    from parity.engine.layout.resolve import resolve

    config = resolve(str(meta), allow_pickle=True).config
    assert (config.model_type, config.hidden_size, config.num_hidden_layers) == ("llama", 64, 2)
    assert config.intermediate_size == llama_intermediate_size(64, 32) == 192
    assert config.vocab_size == 100  # params.json says -1: taken from tok_embeddings.weight


def test_meta_load_ffn_routes_w1_w3_w2(meta):
    module = parity.load_ffn(str(meta), layer=1, allow_pickle=True)
    stored = torch.load(meta / "consolidated.00.pth", weights_only=True)
    assert isinstance(module, SwiGLU)
    assert torch.equal(module._gate.weight, stored["layers.1.feed_forward.w1.weight"].float())
    assert torch.equal(module._up.weight, stored["layers.1.feed_forward.w3.weight"].float())
    assert torch.equal(module._down.weight, stored["layers.1.feed_forward.w2.weight"].float())


def test_meta_ffn_dim_multiplier(tmp_path):
    folder = write_meta(tmp_path / "m", dim=96, multiple_of=64, multiplier=1.3)
    report = parity.check(str(folder), allow_pickle=True, layers=[0])
    assert report.passed
    assert parity.load_ffn(str(folder), allow_pickle=True)._gate.weight.shape[0] == llama_intermediate_size(96, 64, 1.3)


def test_meta_params_that_do_not_fit_the_weights(tmp_path):
    folder = write_meta(tmp_path / "m", d_ff=160)
    with pytest.raises(CheckpointError, match="does not belong to these weights"):
        parity.check(str(folder), allow_pickle=True)


def test_meta_model_parallel_shards_are_explained(meta, tmp_path):
    folder = tmp_path / "mp"
    shutil.copytree(meta, folder)
    shutil.copy(folder / "consolidated.00.pth", folder / "consolidated.01.pth")
    with pytest.raises(CheckpointError, match="model-parallel shards"):
        parity.check(str(folder), allow_pickle=True)


def test_weights_only_refuses_arbitrary_objects(tmp_path):
    folder = tmp_path / "evil"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 2}))
    torch.save({"h.0.mlp.c_fc.weight": torch.zeros(2), "payload": Path("/")}, folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="weights_only"):
        parity.check(str(folder), allow_pickle=True)


def test_hf_pytorch_model_bin(gpt2_bin):
    with pytest.raises(PickleRefusedError, match="pytorch_model.bin"):
        parity.check(str(gpt2_bin))
    report = parity.check(str(gpt2_bin), allow_pickle=True)
    assert report.mapping == "gpt2" and report.passed
    assert not parity.check(str(gpt2_bin), allow_pickle=True, target=gpt2_exact_gelu).passed


def test_hf_sharded_bin_with_index(tmp_path):
    model = build_model("llama", seed=31)
    folder = tmp_path / "llama-bin"
    folder.mkdir()
    model.config.to_json_file(folder / "config.json")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    shards = {"pytorch_model-00001-of-00002.bin": {k: v for k, v in state.items() if ".layers.0." in k},
              "pytorch_model-00002-of-00002.bin": {k: v for k, v in state.items() if ".layers.0." not in k}}
    for name, part in shards.items():
        torch.save(part, folder / name)
    index = {"weight_map": {k: name for name, part in shards.items() for k in part}}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    report = parity.check(str(folder), allow_pickle=True)
    assert report.passed and len(report.layers) == 3


def test_cli_flag(meta, capsys):
    code, _, err = run_main(capsys, meta)
    assert code == 2 and "--allow-pickle" in err and "Traceback" not in err
    code, out, err = run_main(capsys, meta, "--allow-pickle")
    assert code == 0, err
    assert "llama-meta" in out and "PASS" in out
