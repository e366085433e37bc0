"""End to end through the library API on tiny real-format checkpoints of every family."""

import pytest
import torch

import parity
from parity.errors import LayerRangeError, MappingError, MissingTensorError, TargetError
from parity.ffn import FeedForward, GeGLU, SwiGLU

from .conftest import FAMILY, TINY
from .mutants import SwappedGeGLU, SwappedSwiGLU, gemma_with_silu, gpt2_exact_gelu


@pytest.mark.parametrize("model_type", list(TINY))
def test_repository_modules_pass_on_every_family(tiny, model_type):
    report = parity.check(str(tiny[model_type]))
    assert report.mapping == FAMILY[model_type]
    assert report.weights == "real"
    assert report.passed, [(r.layer, r.max_abs_diff, r.tolerance) for r in report.layers]
    assert [r.layer for r in report.layers] == list(
        range(TINY[model_type].get("n_layer") or TINY[model_type]["num_hidden_layers"]))
    for r in report.layers:
        assert r.max_abs_diff <= r.tolerance and r.noise_floor > 0
        assert max(abs(v) for v in r.preactivation_range) >= 6.0  # the activation's interesting range is swept


@pytest.mark.parametrize("model_type, activation", [
    ("gpt2", "gelu_new"), ("openai-gpt", "gelu_new"), ("llama", "silu"), ("gemma", "gelu_pytorch_tanh"),
    ("gemma3_text", "gelu_pytorch_tanh"),
])
def test_report_names_the_reference_activation(tiny, model_type, activation):
    report = parity.check(str(tiny[model_type]), layers=[0])
    assert report.reference_activation == activation


def test_gemma1_gelu_override_is_noted(tiny):
    report = parity.check(str(tiny["gemma"]), layers=[0])
    assert any("'gelu'" in n and "gelu_pytorch_tanh" in n for n in report.notes)


def test_gpt2_exact_gelu_fails(tiny):
    report = parity.check(str(tiny["gpt2"]), target=gpt2_exact_gelu)
    assert not report.passed
    assert all(r.max_abs_diff > 3 * r.tolerance for r in report.layers)


@pytest.mark.parametrize("model_type, mutant", [
    ("llama", SwappedSwiGLU), ("mistral", SwappedSwiGLU), ("qwen2", SwappedSwiGLU), ("gemma3_text", SwappedGeGLU),
])
def test_gate_up_swap_fails(tiny, model_type, mutant):
    report = parity.check(str(tiny[model_type]), target=mutant)
    assert not any(r.passed for r in report.layers)


def test_geglu_checkpoint_in_swiglu_fails(tiny):
    assert not parity.check(str(tiny["gemma2"]), target=gemma_with_silu).passed


def test_gpt2_bare_and_prefixed_keys(tiny, gpt2_bare):
    assert parity.check(str(gpt2_bare)).passed
    assert parity.check(str(tiny["gpt2"] / "model.safetensors")).passed  # a file inside the folder


def test_sharded_checkpoint(llama_sharded):
    report = parity.check(str(llama_sharded), layers="0,2")
    assert report.passed and [r.layer for r in report.layers] == [0, 2]


def test_mlp_bias_routes_biases(llama_bias):
    module = parity.load_ffn(str(llama_bias), layer=1)
    assert module._gate.bias is not None
    assert parity.check(str(llama_bias)).passed


def test_load_ffn_returns_checkpoint_weights_in_eval_mode(tiny):
    from safetensors.torch import load_file

    module = parity.load_ffn(str(tiny["gpt2"]), layer=2)
    assert isinstance(module, FeedForward) and not module.training
    stored = load_file(str(tiny["gpt2"] / "model.safetensors"))
    assert torch.equal(module._layer1.weight, stored["transformer.h.2.mlp.c_fc.weight"].t())
    assert torch.equal(module._layer2.bias, stored["transformer.h.2.mlp.c_proj.bias"])
    llama = parity.load_ffn(str(tiny["llama"]), layer=0)
    assert isinstance(llama, SwiGLU) and llama._gate.weight.shape == (88, 32)
    assert isinstance(parity.load_ffn(str(tiny["gemma2"]), layer=1), GeGLU)


def test_layers_out_of_range(tiny):
    with pytest.raises(LayerRangeError, match="valid: 0-2"):
        parity.check(str(tiny["gpt2"]), layers=[3])


def test_wrong_intermediate_size_fails_with_a_hint(tiny):
    def four_d(emb_size, hidden_dim, bias, dropout):
        return SwiGLU(emb_size, dropout, None, bias)

    report = parity.check(str(tiny["llama"]), target=four_d, layers=[0])
    assert not report.passed and report.layers[0].diagnosis["id"] == "intermediate_size_mismatch"
    assert ("4*d default" in report.layers[0].diagnosis["message"]
            and "[128, 32]" in report.layers[0].diagnosis["message"])


def test_missing_transpose_fails_with_a_hint(tiny, tmp_path):
    text = (parity.definitions.mapping.builtin_mapping_dir() / "gpt2.toml").read_text()
    text = text.replace('{ from = "c_fc.weight", transform = "transpose" }', '"c_fc.weight"')
    (tmp_path / "m.toml").write_text(text)
    report = parity.check(str(tiny["gpt2"]), mapping=str(tmp_path / "m.toml"), layers=[0])
    assert not report.passed and report.layers[0].diagnosis["id"] == "missing_transpose"
    assert "transposed" in report.layers[0].diagnosis["message"]


def test_unimportable_target(tiny):
    with pytest.raises(TargetError, match="cannot import"):
        parity.check(str(tiny["gpt2"]), target="no_such_pkg.mod:FFN")


def test_user_module_via_own_mapping(tiny, tmp_path):
    mapping = tmp_path / "my_gpt2.toml"
    mapping.write_text('''
name = "my-gpt2"
model_types = ["gpt2"]
num_layers = "config.n_layer"
hidden_size = "config.n_embd"
[checkpoint]
layer_key = "h.{layer}.mlp"
key_prefixes = ["", "transformer."]
[reference]
module = "transformer.h.{layer}.mlp"
[target]
class = "tests.mutants:ConfigMLP"
args = { config = "config" }
[tensors]
"c_fc.weight" = { from = "c_fc.weight", transform = "transpose" }
"c_fc.bias" = "c_fc.bias"
"c_proj.weight" = { from = "c_proj.weight", transform = "transpose" }
"c_proj.bias" = "c_proj.bias"
''')
    report = parity.check(str(tiny["gpt2"]), mapping=str(mapping))
    assert report.passed and report.target == "tests.mutants:ConfigMLP"


def test_missing_tensor_lists_closest_names(tiny, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "broken"
    shutil.copytree(tiny["llama"], folder)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert parity.check(str(folder), layers=[0]).passed
    with pytest.raises(MissingTensorError, match="up_proj"):
        parity.check(str(folder), layers=[1])


def test_unknown_model_type(tmp_path, tiny):
    import json
    import shutil

    folder = tmp_path / "odd"
    shutil.copytree(tiny["llama"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "bert"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(MappingError, match="no mapping serves model_type 'bert'"):
        parity.check(str(folder))
