"""The MoE checkpoints and the streamed check the whole-block tests share (tests/test_moe_block.py,
tests/test_streamed_replays.py; the checkpoints are conftest's session fixtures ``blocks`` and ``many_experts``): tiny
checkpoints of each MoE family built with transformers' own classes, a
64-expert grouped DeepSeek V3, and ``check`` with every block forced onto the streamed path."""

from __future__ import annotations

from pathlib import Path

import torch

from parity.api import check

from .derived_checkpoints import MOE, build, with_selection_bias

MOE_HEADS = dict(num_attention_heads=2, num_key_value_heads=2)

FAMILIES = {  # model_type -> config values beyond MOE's
    "mixtral": {},
    "qwen2_moe": {},
    "deepseek_v3": dict(first_k_dense_replace=1, n_group=2, topk_group=1, q_lora_rank=16, kv_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, routed_scaling_factor=2.5,
                        norm_topk_prob=True),
    "gpt_oss": {},
    "llama4_text": dict(intermediate_size_mlp=72, interleave_moe_layer_step=1),
    "olmoe": {},
    "qwen3_moe": {},
}


def family_checkpoints(root: Path) -> dict[str, Path]:
    """model_type -> a tiny checkpoint; DeepSeek's selection bias (a buffer, zero when built) set to values that
    change the choice, so a port that puts it into the weights differs."""
    built = {mt: build(mt, root / mt, seed, **{**MOE, **values}) for seed, (mt, values) in enumerate(FAMILIES.items())}
    with_selection_bias(built["deepseek_v3"])
    return built


def many_experts_checkpoint(root: Path) -> Path:
    """DeepSeek V3 with 64 experts in 8 groups (top-4 groups, top-8 experts), a random selection bias, and a shared
    expert as wide as the expert count (its [64, d] gate_proj beside the router's [64, d] weight)."""
    from safetensors.torch import load_file, save_file

    folder = build("deepseek_v3", root / "ds64", 3, hidden_size=256, num_hidden_layers=2,
                   first_k_dense_replace=1, n_routed_experts=64, num_experts_per_tok=8, n_group=8, topk_group=4,
                   moe_intermediate_size=64, n_shared_experts=1, intermediate_size=128, q_lora_rank=16,
                   kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, **MOE_HEADS)
    tensors = load_file(folder / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    for name in [n for n in tensors if n.endswith("e_score_correction_bias")]:
        tensors[name] = torch.randn(tensors[name].shape, generator=generator) * 0.05
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def streamed_check(monkeypatch, folder: Path, port):
    """``check`` with every block streamed (HELD_BYTES 0): each expert read, built and run one at a time."""
    from parity.engine.check import block_check

    with monkeypatch.context() as patched:
        patched.setattr(block_check, "HELD_BYTES", 0)
        return check(str(folder), target=port)


def recorded_builds(monkeypatch, *, slice_units: int | None = None) -> list[str]:
    """The class of each expert a streamed block's replays build (engine.check.block_replay's ``expert_builder``),
    appended as the check runs; ``slice_units``: the streamed pass computes each expert of a 32-wide block that many
    intermediate units at a time (engine.experts.SLICE_BYTES)."""
    from parity.engine import experts
    from parity.engine.check import block_check

    built: list[str] = []
    original = block_check.expert_builder

    def recorded(*args, **kwargs):
        build = original(*args, **kwargs)

        def one(expert, *, stored=None):
            module = build(expert, stored=stored)
            built.append(type(module).__name__)
            return module
        return one

    monkeypatch.setattr(block_check, "expert_builder", recorded)
    if slice_units:
        monkeypatch.setattr(experts, "SLICE_BYTES", slice_units * 8 * 3 * 32)
    return built


def assert_named_as_held(held, streamed, named: str) -> None:
    """A failing block streamed gets the held block's name, from replays on the tokens where it fails, the replay
    within tolerance of the port and the correct block beyond it."""
    assert not streamed.passed and streamed.layers
    for a, b in zip(held.layers, streamed.layers, strict=True):
        assert a.diagnosis.id == named, held
        assert b.unverifiable is None and b.max_abs_diff > 100 * b.tolerance
        assert b.diagnosis.id == named and "replayed on 8 of the tokens where it fails" in b.diagnosis.message, b
        assert b.diagnosis.distance <= b.tolerance < b.diagnosis.reference_distance
