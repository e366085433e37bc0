"""GGUF's ternary types (TQ1_0, TQ2_0: BitNet b1.58's storage) in ``parity compare``: written by gguf's own quantizer,
read by gguf's own dequantizer, A re-quantized with ``gguf.quants.quantize`` as the conversion.

A model trained ternary (each 256-value block's weights the block's absmean times -1, 0 or +1, as BitNet b1.58
rounds them) is carried exactly: a faithful export passes bit-identical, a broken one fails on its layer, named.  A
model that is not ternary cannot be carried by a ternary type: the conversion alone moves each layer by about its own
output, and the compare says the layer cannot be verified (never a pass)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from .gguf_files import Q, gguf_of_folder, tiny_hf
from .support import run_json

NAMES = {"mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
         "mlp.down_proj.weight": "ffn_down.weight"}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A tiny LLaMA whose sides are whole 256-value blocks, and its copy with ternary FFN weights."""
    root = tmp_path_factory.mktemp("ternary")
    plain = tiny_hf("llama", root / "llama", 7, hidden_size=256, intermediate_size=512, num_key_value_heads=2)
    ternary = root / "llama-ternary"
    shutil.copytree(plain, ternary)
    tensors = load_file(ternary / "model.safetensors")
    for name in [n for n in tensors if ".mlp." in n]:
        blocks = tensors[name].reshape(-1, 256)
        scale = blocks.abs().mean(-1, keepdim=True).half().float()  # GGUF's TQ scale is one float16 per block
        tensors[name] = ((blocks / scale).round().clamp(-1, 1) * scale).reshape(tensors[name].shape)
    save_file(tensors, ternary / "model.safetensors", metadata={"format": "pt"})
    return {"plain": plain, "ternary": ternary}


@pytest.mark.parametrize("qtype", [Q.TQ1_0, Q.TQ2_0], ids=lambda q: q.name)
def test_a_ternary_model_exported_ternary_passes_bit_identical(models, tmp_path, capsys, qtype):
    b = gguf_of_folder(models["ternary"], tmp_path / "b.gguf", "llama", NAMES, qtype)
    code, report, err = run_json(capsys, "compare", models["ternary"], b)
    assert code == 0 and report["passed"], err
    assert [unit["max_abs_diff"] for unit in report["layers"]] == [0.0, 0.0]
    for unit in report["layers"]:  # read from B's ternary blocks, A re-quantized by gguf's own quantizer
        assert unit["conversion"]["kind"] == f"quantized float32 -> {qtype.name}"
        assert all(t["conversion"] == f"re-quantized to {qtype.name} with gguf.quants.quantize"
                   for t in unit["conversion"]["tensors"])


@pytest.mark.parametrize("qtype", [Q.TQ1_0, Q.TQ2_0], ids=lambda q: q.name)
def test_a_ternary_export_with_gate_and_up_exchanged_fails_on_its_layer_named(models, tmp_path, capsys, qtype):
    def exchange(layer, tensors):
        if layer == 1:
            tensors["ffn_gate.weight"], tensors["ffn_up.weight"] = tensors["ffn_up.weight"], tensors["ffn_gate.weight"]
        return tensors
    b = gguf_of_folder(models["ternary"], tmp_path / "b.gguf", "llama", NAMES, qtype, edit=exchange)
    code, report, err = run_json(capsys, "compare", models["ternary"], b)
    assert code == 1, err
    assert [unit["passed"] for unit in report["layers"]] == [True, False]
    assert report["layers"][1]["diagnosis"]["id"] == "gate_up_exchanged"


def test_a_model_that_is_not_ternary_is_unverifiable_in_a_ternary_type_never_a_pass(models, tmp_path, capsys):
    b = gguf_of_folder(models["plain"], tmp_path / "b.gguf", "llama", NAMES, Q.TQ2_0)
    code, report, err = run_json(capsys, "compare", models["plain"], b)
    assert code != 0 and not report["passed"], err
    assert all(unit["unverifiable"] and "cannot carry this layer's function" in unit["unverifiable"]
               for unit in report["layers"]), report["layers"]
