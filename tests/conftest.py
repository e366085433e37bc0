"""Tiny real-format checkpoints, built with transformers' own classes (no network, ever)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from .moe_blocks import family_checkpoints, many_experts_checkpoint
from .support import cache_repo, use_hf_home

os.environ["HF_HUB_OFFLINE"] = "1"  # tests never touch the network

TINY = {
    "gpt2": dict(model_type="gpt2", n_embd=32, n_layer=3, n_head=2, n_positions=64, vocab_size=64),
    "openai-gpt": dict(model_type="openai-gpt", n_embd=32, n_layer=3, n_head=2, n_positions=64, vocab_size=64),
    "llama": dict(model_type="llama", hidden_size=32, intermediate_size=88, num_hidden_layers=3,
                  num_attention_heads=2, num_key_value_heads=2, vocab_size=64),
    "mistral": dict(model_type="mistral", hidden_size=32, intermediate_size=112, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=2, vocab_size=64),
    "qwen2": dict(model_type="qwen2", hidden_size=32, intermediate_size=72, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2, vocab_size=64),
    "gemma": dict(model_type="gemma", hidden_size=32, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=64, hidden_act="gelu"),
    "gemma2": dict(model_type="gemma2", hidden_size=32, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=64),
    "gemma3_text": dict(model_type="gemma3_text", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=64),
}
# model_type -> the built-in mapping that serves it
FAMILY = {"gpt2": "gpt2", "openai-gpt": "openai-gpt", "llama": "llama", "mistral": "mistral", "qwen2": "qwen2",
          "gemma": "gemma", "gemma2": "gemma", "gemma3_text": "gemma"}


def build_model(model_type: str, seed: int = 0, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {k: v for k, v in TINY[model_type].items() if k != "model_type"} | overrides
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # distinct random values everywhere, biases included (HF inits them to 0)
        for param in model.parameters():
            param.normal_(0.0, 0.05)
    return model.eval()


def save(model, folder: Path, **kwargs) -> Path:
    model.save_pretrained(folder, **kwargs)
    return folder


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """model_type -> folder of a tiny checkpoint saved by save_pretrained."""
    root = tmp_path_factory.mktemp("tiny")
    folders = {mt: save(build_model(mt, seed=i), root / mt) for i, mt in enumerate(TINY)}
    # Gemma 1 configs on the hub say hidden_act = "gelu" (save_pretrained writes transformers' override).
    config = json.loads((folders["gemma"] / "config.json").read_text())
    config["hidden_act"] = "gelu"
    (folders["gemma"] / "config.json").write_text(json.dumps(config))
    return folders


@pytest.fixture(scope="session")
def gpt2_bare(tmp_path_factory):
    """GPT-2 as on the hub: keys without the 'transformer.' prefix (GPT2Model.save_pretrained)."""
    model = build_model("gpt2", seed=11)
    return save(model.transformer, tmp_path_factory.mktemp("gpt2_bare") / "gpt2")


@pytest.fixture(scope="session")
def llama_sharded(tmp_path_factory):
    folder = save(build_model("llama", seed=12), tmp_path_factory.mktemp("sharded") / "llama", max_shard_size="20KB")
    assert (folder / "model.safetensors.index.json").is_file()
    return folder


@pytest.fixture(scope="session")
def llama_bias(tmp_path_factory):
    return save(build_model("llama", seed=13, mlp_bias=True), tmp_path_factory.mktemp("bias") / "llama")


@pytest.fixture()
def hf_cache(tmp_path, tiny, monkeypatch):
    """A huggingface_hub cache (HF_HOME) holding tiny GPT-2 and LLaMA repos, laid out as the hub lays them."""
    home = tmp_path / "hf_home"
    for repo, src in {"tiny-org/gpt2": tiny["gpt2"], "tiny-org/llama": tiny["llama"]}.items():
        cache_repo(home, repo, src)
    return use_hf_home(monkeypatch, home)  # the environment, and huggingface_hub's constants read at import


@pytest.fixture(autouse=True)
def _parity_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("PARITY_CACHE", str(tmp_path_factory.getbasetemp() / "parity_cache"))


@pytest.fixture(scope="session")
def blocks(tmp_path_factory) -> dict[str, Path]:
    """A tiny checkpoint of each MoE family (tests/moe_blocks.py), for the whole-block tests."""
    return family_checkpoints(tmp_path_factory.mktemp("moe_blocks"))


@pytest.fixture(scope="session")
def many_experts(tmp_path_factory) -> Path:
    """A DeepSeek V3 of 64 experts in 8 groups (tests/moe_blocks.py)."""
    return many_experts_checkpoint(tmp_path_factory.mktemp("many"))
