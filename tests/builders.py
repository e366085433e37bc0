"""Test data more than one test module builds: results and reports without a model run, tiny MoE models,
edited copies of built-in mappings, Meta's release layout and its model.py FeedForward.  Test modules import these
from here, never from one another."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from parity.definitions.datafiles import builtin_mapping_dir
from parity.engine.results import LayerResult, Report
from parity.ffn import llama_intermediate_size

MIXTRAL = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
               vocab_size=64, num_local_experts=4, num_experts_per_tok=2)


def layer_result(layer=0, passed=True, max_abs=1e-9, **extra):
    return LayerResult(layer=layer, passed=passed, max_abs_diff=max_abs, max_rel_diff=0.0, mean_abs_diff=0.0,
                       max_at=[0, 0, 0], noise_floor=1e-9, tolerance=1e-6, ratio_to_noise=1.0,
                       preactivation_range=[-8.0, 8.0], **extra)


def report_with(*layers, model="m"):
    return Report(model=model, checkpoint="ckpt", weights="real", mapping="llama", target="pkg:FFN", reference="R",
                  reference_activation="silu", versions={"torch": "x"}, seed=0, layers=list(layers))


def tiny_model(model_type: str, seed: int, **kwargs):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kwargs))
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.05)
    return model.eval()


def mapping_variant(tmp_path: Path, family: str, old: str, new: str, target: str | None = None) -> str:
    text = (builtin_mapping_dir() / f"{family}.toml").read_text()
    assert old in text
    text = text.replace(old, new)
    if target:
        text = text.replace(text.split('class = "')[1].split('"')[0], target, 1)
    path = tmp_path / f"{family}-variant.toml"
    path.write_text(text)
    return str(path)


def write_meta(folder: Path, dim=64, n_layers=2, multiple_of=32, multiplier=None, seed=0, d_ff=None) -> Path:
    """Meta's release layout: consolidated.00.pth (bf16, Meta names) + params.json."""
    folder.mkdir(parents=True, exist_ok=True)
    d_ff = d_ff or llama_intermediate_size(dim, multiple_of, multiplier)
    generator = torch.Generator().manual_seed(seed)
    state = {"tok_embeddings.weight": torch.randn(100, dim, generator=generator).bfloat16(),
             "norm.weight": torch.ones(dim).bfloat16()}
    for layer in range(n_layers):
        for name, shape in (("w1", (d_ff, dim)), ("w3", (d_ff, dim)), ("w2", (dim, d_ff))):
            state[f"layers.{layer}.feed_forward.{name}.weight"] = (
                torch.randn(*shape, generator=generator) * 0.05).bfloat16()
    torch.save(state, folder / "consolidated.00.pth")
    params = {"dim": dim, "n_layers": n_layers, "n_heads": 4, "multiple_of": multiple_of, "norm_eps": 1e-5,
              "vocab_size": -1}
    if multiplier is not None:
        params["ffn_dim_multiplier"] = multiplier
    (folder / "params.json").write_text(json.dumps(params))
    return folder


class FeedForward(nn.Module):  # Meta's llama model.py
    def __init__(self, dim: int, hidden_dim: int, multiple_of: int, ffn_dim_multiplier: float | None):
        super().__init__()
        hidden_dim = int(2 * hidden_dim / 3)
        if ffn_dim_multiplier is not None:
            hidden_dim = int(ffn_dim_multiplier * hidden_dim)
        hidden_dim = multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def tiny_stand_in(monkeypatch, tmp_path: Path, name: str, config: dict) -> None:
    """Mapping ``name`` offline with nothing cached (its synthetic stand-in), the stand-in built from ``config``
    instead of the real model's (GPT-2 small's or TinyLlama's would take a minute); the mapping is otherwise the
    built-in one.  PARITY_CACHE is tmp_path/cache, HF_HOME empty."""
    import dataclasses

    import parity.engine.layout.resolve as resolve
    from parity.definitions.registry import builtin_mappings

    from .support import offline_home

    offline_home(monkeypatch, tmp_path)
    mappings = dict(builtin_mappings())
    mappings[name] = dataclasses.replace(mappings[name], synthetic_config=config)
    monkeypatch.setattr(resolve, "builtin_mappings", lambda: mappings)


def written_stand_in(capsys, tmp_path: Path, name: str) -> Path:
    """A copy of mapping ``name``'s whole stand-in folder under tmp_path (a check of every layer writes every
    shard): a real local checkpoint holding the stand-in's values."""
    import shutil

    from .support import run_main

    code, _, err = run_main(capsys, name, "--layers", "all")
    assert code == 0, err
    (folder,) = (tmp_path / "cache" / "synthetic").iterdir()
    return Path(shutil.copytree(folder, tmp_path / f"{name}-copy"))
