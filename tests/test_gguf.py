"""GGUF files: config from metadata, only the layer's FFN tensors dequantized, every family."""

import json

import numpy as np
import pytest
import torch

import parity
from parity.errors import CheckpointError, MissingTensorError
from parity.ffn import FeedForward, GeGLU, SwiGLU
from parity.sources.gguf import open_gguf
from parity.sources.gguf_header import read_header

from .conftest import build_model
from .gguf_files import Q, gguf_from_hf, gguf_gpt2, write_gguf
from .mutants import SwappedGeGLU, SwappedSwiGLU, gemma_with_silu, gpt2_exact_gelu
from .support import run_main

TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_K, Q.Q5_0, Q.Q6_K]


@pytest.fixture(scope="session")
def llama_256():
    """A tiny LLaMA whose rows fit the K-quants' 256-value blocks."""
    return build_model("llama", seed=21, hidden_size=256, intermediate_size=512, num_hidden_layers=2)


@pytest.fixture(scope="session")
def gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf")


@pytest.fixture(scope="session")
def llama_mixed(llama_256, gguf_dir):
    """As a Q4_K_M file mixes them: Q4_K gate, Q8_0 up, Q6_K down."""
    return gguf_from_hf(llama_256, gguf_dir / "llama-mixed.gguf", "llama",
                        {"ffn_gate.weight": Q.Q4_K, "ffn_up.weight": Q.Q8_0, "ffn_down.weight": Q.Q6_K})


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_every_quant_type_passes_and_swapped_gate_up_fails(llama_256, gguf_dir, qtype):
    path = gguf_from_hf(llama_256, gguf_dir / f"llama-{qtype.name}.gguf", "llama", qtype)
    report = parity.check(str(path))
    assert report.mapping.endswith("'llama' map") and report.reference.endswith("LlamaMLP")
    assert report.passed, [(r.max_abs_diff, r.tolerance) for r in report.layers]
    assert any(qtype.name in note for note in report.notes)
    assert not any(r.passed for r in parity.check(str(path), target=SwappedSwiGLU).layers)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_dequantized_tensors_equal_ggufs_own_reader(llama_256, gguf_dir, qtype):
    from gguf import GGUFReader
    from gguf.quants import dequantize

    path = gguf_from_hf(llama_256, gguf_dir / f"llama-read-{qtype.name}.gguf", "llama", qtype)
    ours = open_gguf(path).read(["blk.1.ffn_gate.weight", "blk.1.ffn_down.weight"])
    for tensor in GGUFReader(str(path)).tensors:
        if tensor.name in ours:
            expected = dequantize(tensor.data, tensor.tensor_type)
            assert ours[tensor.name].dtype == torch.float32
            assert ours[tensor.name].shape == expected.shape  # [out, in]: HF layout
            assert torch.equal(ours[tensor.name], torch.from_numpy(np.array(expected, dtype=np.float32)))
    if qtype in (Q.F32, Q.F16, Q.BF16, Q.Q8_0):  # close to the HF weights they were made from
        hf = llama_256.state_dict()["model.layers.1.mlp.gate_proj.weight"]
        assert (ours["blk.1.ffn_gate.weight"] - hf).abs().max() < 0.02 * hf.abs().max()


def test_load_ffn_holds_the_dequantized_weights(llama_mixed):
    module = parity.load_ffn(str(llama_mixed), layer=1)
    stored = open_gguf(llama_mixed).read(["blk.1.ffn_gate.weight", "blk.1.ffn_up.weight", "blk.1.ffn_down.weight"])
    assert isinstance(module, SwiGLU) and module._gate.bias is None
    assert torch.equal(module._gate.weight, stored["blk.1.ffn_gate.weight"])
    assert torch.equal(module._up.weight, stored["blk.1.ffn_up.weight"])
    assert torch.equal(module._down.weight, stored["blk.1.ffn_down.weight"])
    assert not torch.equal(module._gate.weight, module._up.weight)


def test_config_comes_from_the_metadata(llama_mixed):
    from parity.engine.layout.resolve import resolve

    resolved = resolve(str(llama_mixed))
    config = resolved.config
    assert (config.model_type, config.hidden_size, config.intermediate_size,
            config.num_hidden_layers) == ("llama", 256, 512, 2)
    assert config.vocab_size == 64  # from the token list: the file has no token_embd.weight
    assert config.hidden_act == "silu"
    assert resolved.checkpoint.config_dir is None


def test_only_the_layers_tensors_are_read(llama_mixed, monkeypatch):
    from parity.sources import gguf as gguf_source

    read = []
    original = gguf_source.dequantize
    monkeypatch.setattr(gguf_source, "dequantize", lambda path, info: read.append(info.name) or original(path, info))
    parity.check(str(llama_mixed), layers=[1])
    assert sorted(read) == ["blk.1.ffn_down.weight", "blk.1.ffn_gate.weight", "blk.1.ffn_up.weight"]


def test_qwen2_architecture(gguf_dir):
    model = build_model("qwen2", seed=22, intermediate_size=96)
    report = parity.check(str(gguf_from_hf(model, gguf_dir / "qwen2.gguf", "qwen2", Q.Q8_0)))
    assert report.passed and report.reference.endswith("Qwen2MLP")


@pytest.mark.parametrize("model_type, arch, reference", [
    ("gemma", "gemma", "GemmaMLP"), ("gemma2", "gemma2", "Gemma2MLP"), ("gemma3_text", "gemma3", "Gemma3MLP"),
])
def test_gemma_architectures(gguf_dir, model_type, arch, reference):
    path = gguf_from_hf(build_model(model_type, seed=23), gguf_dir / f"{arch}.gguf", arch, Q.F16)
    report = parity.check(str(path))
    assert report.mapping.endswith(f"'{arch}' map") and report.reference.endswith(reference)
    assert report.reference_activation == "gelu_pytorch_tanh"
    assert report.passed
    assert isinstance(parity.load_ffn(str(path), layer=0), GeGLU)
    assert not parity.check(str(path), target=SwappedGeGLU).passed
    assert not parity.check(str(path), target=gemma_with_silu).passed


def test_gpt2_architecture_linear_layout(gguf_dir):
    model = build_model("gpt2", seed=24)
    path = gguf_gpt2(model, gguf_dir / "gpt2.gguf", Q.F32)
    report = parity.check(str(path))
    assert report.mapping.endswith("'gpt2' map") and report.passed
    module = parity.load_ffn(str(path), layer=2)
    assert isinstance(module, FeedForward)
    # GGUF holds [out, in]: the repository's nn.Linear gets it as stored, equal to HF's Conv1D weight transposed
    assert torch.equal(module._layer1.weight, model.state_dict()["transformer.h.2.mlp.c_fc.weight"].t())
    assert not parity.check(str(path), target=gpt2_exact_gelu).passed


def test_family_name_with_a_gguf_checkpoint_uses_the_gguf_mapping(llama_mixed):
    report = parity.check("llama", checkpoint=str(llama_mixed), layers=[0])
    assert report.passed and report.mapping.endswith("'llama' map")
    assert any(report.mapping in note for note in report.notes)


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        parity.check(str(bad))


def test_truncated_file(llama_mixed, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(llama_mixed.read_bytes()[:200])
    with pytest.raises(CheckpointError, match="truncated"):
        parity.check(str(cut))


def test_unsupported_architecture(tmp_path):
    path = write_gguf(tmp_path / "bert.gguf", "bert", {"block_count": 1, "embedding_length": 32}, {})
    with pytest.raises(CheckpointError, match="architecture 'bert' is not supported"):
        parity.check(str(path))


def test_missing_layer_tensor_names_the_closest(llama_256, tmp_path):
    state = llama_256.state_dict()
    meta = {"block_count": 2, "embedding_length": 256, "feed_forward_length": 512, "attention.head_count": 2,
            "attention.head_count_kv": 2}
    tensors = {f"blk.{layer}.{g}": (state[f"model.layers.{layer}.mlp.{h}"].numpy(), Q.F32)
               for layer in range(2) for h, g in (("gate_proj.weight", "ffn_gate.weight"),
                                                  ("up_proj.weight", "ffn_up.weight"),
                                                  ("down_proj.weight", "ffn_down.weight"))}
    del tensors["blk.1.ffn_up.weight"]
    path = write_gguf(tmp_path / "holed.gguf", "llama", meta, tensors)
    assert parity.check(str(path), layers=[0]).passed
    with pytest.raises(MissingTensorError, match="blk.1.ffn_up.weight"):
        parity.check(str(path), layers=[1])


def test_header_skips_the_vocabulary_and_keeps_offsets(tmp_path):
    values = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    path = write_gguf(tmp_path / "v.gguf", "llama", {"block_count": 1}, {"blk.0.ffn_up.weight": (values, Q.F32)},
                      n_tokens=50_000)
    header = read_header(path)
    assert header.metadata["tokenizer.ggml.tokens"].count == 50_000  # counted, not decoded
    assert header.tensors["blk.0.ffn_up.weight"].shape == (64, 32)
    from parity.sources.gguf import dequantize

    assert torch.equal(dequantize(path, header.tensors["blk.0.ffn_up.weight"]), torch.from_numpy(values))


def test_cli_on_a_gguf_file(llama_mixed, capsys):
    code, out, err = run_main(capsys, llama_mixed, "--layer", "1", "--json", "-")
    assert code == 0, err
    data = json.loads(out)
    assert data["mapping"].endswith("'llama' map") and data["passed"] and data["layers"][0]["layer"] == 1
    assert "Q4_K" in err  # the notes in the table header
    code, out, _ = run_main(capsys, llama_mixed, "--target", "tests.mutants:SwappedSwiGLU")
    assert code == 1 and "MISMATCH" in out


def test_inspect_describes_gguf_tensors_from_the_file_index(llama_mixed):
    from parity.engine.check.inspect import inspect_model

    info = inspect_model(str(llama_mixed), layer=1)
    rows = {row["name"]: row for row in info["tensors"]}
    assert set(rows) >= {"blk.1.ffn_gate.weight", "blk.1.ffn_up.weight", "blk.1.ffn_down.weight"}
    for row in rows.values():
        assert row["shape"] is not None and row["dtype"] and row["source"] == "index"
