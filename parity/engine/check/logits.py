"""--logits: what the target does to the model's output.

The target module replaces the checked layers' MLPs inside the full transformers model;
a fixed token sequence runs through the model with and without the substitution, and the
final logits are compared (max |Δ|, top-1 agreement).  This is the number people quote
("the wrong GELU moves GPT-2's logits by ~1e-4").  It needs every weight of the model:
real ones from a local folder or the hub, or for the synthetic stand-in (FFN weights only)
the synthetic FFN weights inside an otherwise seeded-random model, said so in the report.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from parity.engine.check.run import run_module

TOKENS = 32
MEMORY_SHARE = 0.6  # of MemAvailable, for the model in float32 (held once; one MLP swapped at a time)


def available_memory() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class _Substitute(nn.Module):
    """Runs the target where transformers' MLP sat, in float32, whatever the call signature."""

    def __init__(self, target: nn.Module):
        super().__init__()
        self.target = target

    def forward(self, hidden_states, *args, **kwargs):
        return run_module(self.target, hidden_states.float()).to(hidden_states.dtype)


def logits_impact(session: Any, layers: list[int]) -> dict:
    from transformers import AutoModelForCausalLM

    if session.mapping.experts is not None:
        return {"skipped": "the targets are single experts; a routed MoE block cannot be replaced by one of them"}
    params = sum(p.numel() for p in session.reference.skeleton.parameters())
    need, have = params * 4, available_memory()
    if have is not None and need > MEMORY_SHARE * have:
        return {"skipped": f"the full model needs about {need / 2**30:.1f} GiB in float32 and this machine has "
                           f"{have / 2**30:.1f} GiB available; check logits on a larger machine"}
    checkpoint = session.checkpoint
    if checkpoint.weights == "synthetic":
        torch.manual_seed(session.seed)
        model = AutoModelForCausalLM.from_config(session.config, dtype=torch.float32)
        for layer in range(session.num_layers):  # the synthetic checkpoint's own FFN weights, all layers
            reference = session.build_reference(layer, session.read_layer(layer))
            _swap_module(model, session.mapping.reference_path(layer), reference)
        weights = "synthetic: checkpoint FFN weights, other weights seeded-random"
    elif checkpoint.repo_id is not None:  # the hub: downloads what the one-layer check did not need
        model = AutoModelForCausalLM.from_pretrained(checkpoint.repo_id, revision=checkpoint.revision,
                                                     dtype=torch.float32)
        weights = "real"
    elif checkpoint.config_dir is not None:
        model = AutoModelForCausalLM.from_pretrained(str(checkpoint.config_dir), dtype=torch.float32)
        weights = "real"
    else:
        return {"skipped": f"{checkpoint.location} does not hold a full transformers model"}
    model.eval()
    generator = torch.Generator().manual_seed(session.seed)
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (1, TOKENS), generator=generator)
    with torch.no_grad():
        base = model(ids).logits.double()
        originals = {}
        for layer in layers:
            path = session.mapping.reference_path(layer)
            target, _ = session.build_target(session.read_layer(layer))
            originals[path] = _swap_module(model, path, _Substitute(target))
        changed = model(ids).logits.double()
        for path, original in originals.items():
            _swap_module(model, path, original)
    return {
        "weights": weights,
        "layers": layers,
        "tokens": TOKENS,
        "max_abs_diff": float((changed - base).abs().max()),
        "logit_scale": float(base.abs().max()),
        "top1_agreement": float((changed.argmax(-1) == base.argmax(-1)).double().mean()),
    }


def _swap_module(model: nn.Module, path: str, module: nn.Module) -> nn.Module:
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    original = getattr(parent, name)
    setattr(parent, name, module)
    return original
