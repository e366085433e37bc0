"""Mixture-of-experts: each expert's SwiGLU against transformers' MixtralExperts; Phi-3's fused gate_up."""

import json

import numpy as np
import pytest
import torch

import parity
from parity.errors import LayerRangeError
from parity.ffn import SwiGLU

from .builders import MIXTRAL, tiny_model
from .gguf_files import Q, write_gguf
from .mutants import SwappedSwiGLU
from .support import run_main


@pytest.fixture(scope="session")
def mixtral(tmp_path_factory):
    return tiny_model("mixtral", 41, **MIXTRAL)


@pytest.fixture(scope="session")
def mixtral_hub(mixtral, tmp_path_factory):
    """save_pretrained's default: per-expert block_sparse_moe.experts.{e}.w1/w2/w3, as on the hub."""
    folder = tmp_path_factory.mktemp("mixtral") / "hub-layout"
    mixtral.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def mixtral_fused(mixtral, tmp_path_factory):
    """transformers 5's in-memory layout on disk: mlp.experts.gate_up_proj / down_proj."""
    folder = tmp_path_factory.mktemp("mixtral") / "fused-layout"
    mixtral.save_pretrained(folder, save_original_format=False)
    return folder


def test_layouts_are_what_the_tests_claim(mixtral_hub, mixtral_fused):
    from safetensors import safe_open

    with safe_open(str(mixtral_hub / "model.safetensors"), "pt") as f:
        assert "model.layers.1.block_sparse_moe.experts.3.w1.weight" in f.keys()
    with safe_open(str(mixtral_fused / "model.safetensors"), "pt") as f:
        assert f.get_slice("model.layers.1.mlp.experts.gate_up_proj").get_shape() == [4, 96, 32]


@pytest.mark.parametrize("layout, mapping", [("hub", "mixtral"), ("fused", "mixtral-fused")])
def test_every_expert_of_every_layer_passes(mixtral_hub, mixtral_fused, layout, mapping):
    folder = mixtral_hub if layout == "hub" else mixtral_fused
    report = parity.check(str(folder))
    assert report.mapping == mapping and report.reference.endswith("MixtralExperts")
    assert report.reference_activation == "silu"
    assert [(r.layer, r.expert) for r in report.layers] == [(layer, e) for layer in range(2) for e in range(4)]
    assert report.passed, [(r.layer, r.expert, r.max_abs_diff, r.tolerance) for r in report.layers]
    assert all(max(abs(v) for v in r.preactivation_range) >= 6.0 for r in report.layers)


@pytest.mark.parametrize("layout", ["hub", "fused"])
def test_swapped_gate_up_fails_for_each_expert(mixtral_hub, mixtral_fused, layout):
    folder = mixtral_hub if layout == "hub" else mixtral_fused
    report = parity.check(str(folder), target=SwappedSwiGLU, layers=[1], experts="0,2")
    assert [(r.layer, r.expert) for r in report.layers] == [(1, 0), (1, 2)]
    assert not any(r.passed for r in report.layers)


def test_load_ffn_holds_that_experts_weights(mixtral, mixtral_hub, mixtral_fused):
    experts = mixtral.model.layers[1].mlp.experts
    gate, up = experts.gate_up_proj[2].chunk(2, dim=0)
    for folder in (mixtral_hub, mixtral_fused):
        module = parity.load_ffn(str(folder), layer=1, expert=2)
        assert isinstance(module, SwiGLU)
        assert torch.equal(module._gate.weight, gate) and torch.equal(module._up.weight, up)
        assert torch.equal(module._down.weight, experts.down_proj[2])
    with pytest.raises(LayerRangeError, match="expert=N"):
        parity.load_ffn(str(mixtral_hub), layer=0)
    with pytest.raises(LayerRangeError, match="expert 4 is out of range"):
        parity.check(str(mixtral_hub), experts=[4])


def test_expert_reference_is_transformers_own_expert(mixtral, mixtral_hub):
    """The one-expert oracle agrees with the loaded model's own experts module routed to that expert."""
    from transformers import AutoModelForCausalLM

    from parity.engine.suite import open_session

    loaded = AutoModelForCausalLM.from_pretrained(str(mixtral_hub)).eval()
    session = open_session(str(mixtral_hub))
    x = torch.randn(2, 5, 32)
    for expert in (0, 3):
        reference = session.build_reference(1, session.read_layer(1, expert))
        routed = loaded.model.layers[1].mlp.experts(x.reshape(-1, 32), torch.full((10, 1), expert), torch.ones(10, 1))
        assert torch.allclose(reference(x), routed.reshape(2, 5, 32), atol=1e-6, rtol=0)


def test_a_target_reading_the_wrong_expert_fails(mixtral_hub, tmp_path):
    text = (parity.definitions.mapping.builtin_mapping_dir() / "mixtral.toml").read_text()
    text = text.replace('layer_key = "model.layers.{layer}.block_sparse_moe.experts.{expert}"',
                        'layer_key = "model.layers.{layer}.block_sparse_moe.experts.{expert}"\nkey_prefixes = [""]')
    text = text.replace('[tensors]\n"_gate.weight" = "w1.weight"\n"_up.weight" = "w3.weight"',
                        '[tensors]\n"_gate.weight" = "w3.weight"\n"_up.weight" = "w1.weight"')
    (tmp_path / "m.toml").write_text(text)
    assert not parity.check(str(mixtral_hub), mapping=str(tmp_path / "m.toml"), layers=[0], experts=[1]).passed


def test_cli_table_and_json_show_the_expert(mixtral_hub, capsys):
    code, out, err = run_main(capsys, mixtral_hub, "--layer", "1", "--experts", "1-2", "--json", "-")
    assert code == 0, err
    assert "expert" in err.splitlines()[err.splitlines().index("") + 1]  # the table header
    data = json.loads(out)
    assert [(r["layer"], r["expert"]) for r in data["layers"]] == [(1, 1), (1, 2)]


def test_dense_report_has_null_expert(tiny):
    data = json.loads(parity.check(str(tiny["llama"]), layers=[0]).to_json())
    assert data["layers"][0]["expert"] is None
    with pytest.raises(LayerRangeError, match="dense"):
        parity.check(str(tiny["llama"]), experts="1")


def test_mixtral_gguf_stacked_experts(mixtral, tmp_path):
    state = mixtral.state_dict()
    meta = {"block_count": 2, "embedding_length": 32, "feed_forward_length": 48, "attention.head_count": 2,
            "attention.head_count_kv": 2, "expert_count": 4, "expert_used_count": 2}
    tensors = {}
    for layer in range(2):
        gate_up = state[f"model.layers.{layer}.mlp.experts.gate_up_proj"].numpy()
        tensors[f"blk.{layer}.ffn_gate_exps.weight"] = (np.ascontiguousarray(gate_up[:, :48]), Q.F16)
        tensors[f"blk.{layer}.ffn_up_exps.weight"] = (np.ascontiguousarray(gate_up[:, 48:]), Q.F16)
        tensors[f"blk.{layer}.ffn_down_exps.weight"] = (state[f"model.layers.{layer}.mlp.experts.down_proj"].numpy(),
                                                        Q.BF16)
    path = write_gguf(tmp_path / "mixtral.gguf", "llama", meta, tensors)
    report = parity.check(str(path), layers=[1])
    assert report.mapping == "mixtral-gguf" and report.passed and len(report.layers) == 4
    assert not parity.check(str(path), layers=[1], experts=[3], target=SwappedSwiGLU).passed


@pytest.fixture(scope="session")
def phi3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("phi3") / "phi3"
    tiny_model("phi3", 42, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=2, vocab_size=64, pad_token_id=0).save_pretrained(folder)
    return folder


def test_phi3_fused_gate_up_chunks(phi3):
    from safetensors.torch import load_file

    report = parity.check(str(phi3))
    assert report.mapping == "phi3" and report.reference.endswith("Phi3MLP") and report.passed
    module = parity.load_ffn(str(phi3), layer=1)
    fused = load_file(str(phi3 / "model.safetensors"))["model.layers.1.mlp.gate_up_proj.weight"]
    assert torch.equal(module._gate.weight, fused[:48]) and torch.equal(module._up.weight, fused[48:])
    assert not parity.check(str(phi3), target=SwappedSwiGLU).passed
