"""`parity compare A B` on mixtures of experts judges each MoE layer's whole block beside its experts (issue 28 item
5): what no expert unit reads (the router, its selection bias, a shared expert's gate) is judged there.

A is a tiny checkpoint built with transformers' own classes; each B is a copy written with safetensors with one
change, or a GGUF file written with gguf's own writer (its router under gguf's name map's ``ffn_gate_inp``, kept in
F32 as llama.cpp's converter and quantizer keep it, or quantized like the experts)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from .derived_checkpoints import MOE, build, with_selection_bias
from .gguf_files import VALUES, Q, moe_gguf_of_folder, per_expert
from .support import run_json

DEEPSEEK = dict(first_k_dense_replace=0, n_group=2, topk_group=1, q_lora_rank=16, kv_lora_rank=16,
                qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, routed_scaling_factor=2.5, norm_topk_prob=True)


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> dict[str, Path]:
    """Tiny qwen2_moe (shared expert and its sigmoid gate) and deepseek_v3 (a non-zero selection bias) checkpoints,
    and a qwen2_moe whose widths Q8_0's 32-value blocks divide (for GGUF)."""
    root = tmp_path_factory.mktemp("compare_blocks")
    built = {"qwen2_moe": build("qwen2_moe", root / "qwen2_moe", 3, **MOE),
             "deepseek_v3": build("deepseek_v3", root / "deepseek_v3", 4, **{**MOE, **DEEPSEEK}),
             "qwen2_moe_q8": build("qwen2_moe", root / "qwen2_moe_q8", 5, **VALUES)}
    with_selection_bias(built["deepseek_v3"])
    return built


def edited(folder: Path, dest: Path, edit) -> Path:
    """A copy of ``folder`` whose tensors ``edit(tensors)`` changed, written with safetensors."""
    shutil.copytree(folder, dest)
    tensors = load_file(dest / "model.safetensors")
    edit(tensors)
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def units(report: dict) -> dict[tuple, dict]:
    return {(u["layer"], u["expert"] if u["unit"] != "block" else "block"): u for u in report["layers"]}


def permute_layer_1(tensors: dict, order: list[int], *, experts: bool, router: bool) -> None:
    """B's expert e of layer 1 holds A's expert order[e] (``experts``), and/or its router's row e A's row order[e]."""
    stem = "model.layers.1.mlp."
    if router:
        tensors[stem + "gate.weight"] = tensors[stem + "gate.weight"][order].clone()
    if experts:
        old = {k: v.clone() for k, v in tensors.items() if k.startswith(stem + "experts.")}
        for e, a in enumerate(order):
            for part in ("gate_proj", "up_proj", "down_proj"):
                tensors[f"{stem}experts.{e}.{part}.weight"] = old[f"{stem}experts.{a}.{part}.weight"]


def test_a_bfloat16_cast_passes_every_block(moe, tmp_path, capsys):
    cast = edited(moe["qwen2_moe"], tmp_path / "bf16",
                  lambda t: t.update({k: v.to(torch.bfloat16) for k, v in t.items()}))
    code, report, err = run_json(capsys, "compare", moe["qwen2_moe"], cast)
    assert code == 0 and report["passed"], err
    blocks = [u for u in report["layers"] if u["unit"] == "block"]
    assert [(u["layer"], u["passed"]) for u in blocks] == [(0, True), (1, True)]
    assert all(u["coverage"]["never_chosen"] == [] for u in blocks)


def test_experts_permuted_with_the_router_rows_pass_and_are_said_permuted(moe, tmp_path, capsys):
    order = [2, 0, 3, 1]
    b = edited(moe["qwen2_moe"], tmp_path / "perm",
               lambda t: permute_layer_1(t, order, experts=True, router=True))
    code, report, err = run_json(capsys, "compare", moe["qwen2_moe"], b)
    assert code == 0 and report["passed"], err
    assert units(report)[(1, "block")]["passed"]
    assert any("permut" in note and "layer 1" in note for note in report["notes"]), report["notes"]


def test_router_rows_permuted_alone_fail_on_the_block_only_and_are_named(moe, tmp_path, capsys):
    b = edited(moe["qwen2_moe"], tmp_path / "router",
               lambda t: permute_layer_1(t, [1, 0, 2, 3], experts=False, router=True))
    code, report, err = run_json(capsys, "compare", moe["qwen2_moe"], b)
    assert code == 1, err
    failing = [key for key, u in units(report).items() if not u["passed"]]
    assert failing == [(1, "block")], failing
    found = units(report)[(1, "block")]["diagnosis"]
    assert found["id"] == "router_rows_permuted" and "row 0 is A's row 1" in found["message"], found


@pytest.mark.parametrize("model_type, name, change", [
    ("deepseek_v3", "model.layers.1.mlp.gate.e_score_correction_bias", lambda t: t.flip(0)),
    ("qwen2_moe", "model.layers.1.mlp.shared_expert_gate.weight", lambda t: -t),
], ids=["selection-bias-changed", "shared-gate-negated"])
def test_a_changed_tensor_outside_the_experts_fails_the_block_named(moe, tmp_path, capsys, model_type, name, change):
    b = edited(moe[model_type], tmp_path / "changed", lambda t: t.update({name: change(t[name]).contiguous()}))
    code, report, err = run_json(capsys, "compare", moe[model_type], b)
    assert code == 1, err
    failing = [key for key, u in units(report).items() if not u["passed"]]
    assert failing == [(1, "block")], failing
    found = units(report)[(1, "block")]["diagnosis"]
    relative = name.removeprefix("model.layers.1.mlp.")
    assert found["id"] == "block_tensor_changed" and relative in found["message"], found


def gguf_with_router(folder: Path, path: Path, qtype: Q, *, router_qtype: Q | None = Q.F32, edit=None) -> Path:
    """A qwen2moe GGUF file of ``folder``: experts and shared expert as ``qtype``, the router and the shared
    expert's gate written as ``router_qtype`` (None: left out)."""
    experts = per_expert("shared_expert")

    def layer_tensors(state: dict, layer: int) -> dict[str, np.ndarray]:
        found = experts(state, layer)
        if router_qtype is not None:
            stem = f"model.layers.{layer}.mlp."
            found["ffn_gate_inp.weight"] = state[stem + "gate.weight"]
            found["ffn_gate_inp_shexp.weight"] = state[stem + "shared_expert_gate.weight"][0]  # [d], as llama.cpp
        return found
    return moe_gguf_of_folder(folder, path, "qwen2moe", layer_tensors, qtype, edit=edit,
                              kinds={"ffn_gate_inp.weight": router_qtype} if router_qtype is not None else None,
                              router=False)


@pytest.mark.parametrize("qtype, router", [(Q.F32, Q.F32), (Q.Q8_0, Q.F32), (Q.Q8_0, Q.Q8_0)],
                         ids=["f32", "q8_0-router-f32", "q8_0-router-q8_0"])
def test_a_gguf_file_s_blocks_are_compared_through_gguf_s_name_map(moe, tmp_path, capsys, qtype, router):
    b = gguf_with_router(moe["qwen2_moe_q8"], tmp_path / "b.gguf", qtype, router_qtype=router)
    code, report, err = run_json(capsys, "compare", moe["qwen2_moe_q8"], b)
    assert code == 0 and report["passed"], err
    assert [(u["layer"], u["passed"]) for u in report["layers"] if u["unit"] == "block"] == [(0, True), (1, True)]


def test_a_gguf_file_whose_router_rows_are_permuted_fails_its_block_named(moe, tmp_path, capsys):
    def edit(layer, tensors):
        if layer == 1:
            tensors["ffn_gate_inp.weight"] = tensors["ffn_gate_inp.weight"][[1, 0, 2, 3]]
        return tensors
    b = gguf_with_router(moe["qwen2_moe_q8"], tmp_path / "b.gguf", Q.Q8_0, edit=edit)
    code, report, err = run_json(capsys, "compare", moe["qwen2_moe_q8"], b)
    assert code == 1, err
    assert [key for key, u in units(report).items() if not u["passed"]] == [(1, "block")]
    assert units(report)[(1, "block")]["diagnosis"]["id"] == "router_rows_permuted"


def test_a_gguf_file_without_its_router_fails_its_blocks_named_and_its_experts_judged(moe, tmp_path, capsys):
    """No ffn_gate_inp: the experts are judged one by one (and pass), each layer's block unit fails tensor_missing
    naming the router (it was a note and a pass: a block that cannot route passed on its experts alone)."""
    b = gguf_with_router(moe["qwen2_moe_q8"], tmp_path / "b.gguf", Q.Q8_0, router_qtype=None)
    code, report, err = run_json(capsys, "compare", moe["qwen2_moe_q8"], b)
    assert code == 1 and not report["passed"], err
    blocks = [u for u in report["layers"] if u["unit"] == "block"]
    assert blocks and all(u["diagnosis"]["id"] == "tensor_missing" and "gate.weight" in u["diagnosis"]["message"]
                          for u in blocks), blocks
    assert all(u["passed"] for u in report["layers"] if u["unit"] != "block")


def test_a_release_without_its_router_fails_that_block_named(moe, tmp_path, capsys):
    b = edited(moe["qwen2_moe"], tmp_path / "no-router", lambda t: t.pop("model.layers.1.mlp.gate.weight"))
    code, report, err = run_json(capsys, "compare", moe["qwen2_moe"], b)
    assert code == 1, err
    failing = [key for key, u in units(report).items() if not u["passed"]]
    assert failing == [(1, "block")], failing
    found = units(report)[(1, "block")]["diagnosis"]
    assert found["id"] == "tensor_missing" and "gate.weight" in found["message"], found
