"""The mutant zoo: every typical mistake fails with its own diagnosis id, on each family it
applies to; correct modules pass with no diagnosis.  Checkpoints are tiny real-format files
(distinct random weights and biases), inputs reach |z| ~ 8: see parity/diagnose.py for why
each hypothesis is separable from the others."""


import pytest

import parity

from . import mutants as m
from .builders import mapping_variant
from .conftest import build_model, save


@pytest.fixture(scope="session")
def extra(tmp_path_factory):
    root = tmp_path_factory.mktemp("zoo")
    return {
        "gpt2_exact": save(build_model("gpt2", seed=21, activation_function="gelu"), root / "gpt2_exact"),
        "gpt2_square": save(build_model("gpt2", seed=22, n_inner=32), root / "gpt2_square"),
        "llama_square": save(build_model("llama", seed=23, intermediate_size=32), root / "llama_square"),
        "llama_bias": save(build_model("llama", seed=24, mlp_bias=True), root / "llama_bias"),
    }


ZOO = [  # (checkpoint, target, expected id)
    ("gpt2", m.gpt2_exact_gelu, "gelu_exact_instead_of_tanh"),
    ("openai-gpt", m.gpt2_exact_gelu, "gelu_exact_instead_of_tanh"),
    ("gemma", m.geglu_exact_gelu, "gelu_exact_instead_of_tanh"),
    ("gemma3_text", m.geglu_exact_gelu, "gelu_exact_instead_of_tanh"),
    ("gpt2_exact", None, "gelu_tanh_instead_of_exact"),
    ("gpt2", m.gpt2_quick_gelu, "quick_gelu"),
    ("gemma2", m.geglu_quick_gelu, "quick_gelu"),
    ("gpt2", m.gpt2_silu, "silu_instead_of_gelu"),
    ("gemma3_text", m.gemma_with_silu, "silu_instead_of_gelu"),
    ("llama", m.llama_with_geglu, "gelu_instead_of_silu"),
    ("qwen2", m.llama_with_geglu, "gelu_instead_of_silu"),
    ("llama", m.SwappedSwiGLU, "gate_up_swapped"),
    ("mistral", m.SwappedSwiGLU, "gate_up_swapped"),
    ("qwen2", m.SwappedSwiGLU, "gate_up_swapped"),
    ("gemma", m.SwappedGeGLU, "gate_up_swapped"),
    ("gpt2", m.gpt2_no_output_bias, "bias_dropped"),
    ("llama_bias", m.llama_no_bias, "bias_dropped"),
    ("gpt2", m.gpt2_exact_dropout, "dropout_active"),
    ("llama", m.llama_with_dropout, "dropout_active"),
    ("gemma3_text", m.gemma_dropout, "dropout_active"),
    ("llama", m.bf16_swiglu, "low_precision_compute"),
    ("gemma3_text", m.AutocastGeGLU, "low_precision_compute"),
    ("gpt2", m.fp16_gpt2, "low_precision_compute"),
    ("gpt2", m.gpt2_bf16_matmul, "low_precision_compute"),
    ("llama", m.llama_four_d, "intermediate_size_mismatch"),
    ("gemma", m.gemma_doubled_dff, "intermediate_size_mismatch"),
]


@pytest.mark.parametrize("checkpoint, target, expected", ZOO, ids=[f"{c}-{e}" for c, _, e in ZOO])
def test_mutant_fails_with_its_own_diagnosis(tiny, extra, checkpoint, target, expected):
    folder = tiny.get(checkpoint) or extra[checkpoint]
    report = parity.check(str(folder), target=target)
    assert not report.passed
    for layer in report.layers:
        assert not layer.passed
        assert layer.diagnosis is not None and layer.diagnosis["id"] == expected, layer.diagnosis
        if layer.diagnosis["distance"] is not None and expected not in ("dropout_active", "low_precision_compute"):
            assert layer.diagnosis["distance"] < layer.diagnosis["reference_distance"]


def test_missing_transpose_square_conv1d(extra, tmp_path):
    """Conv1D c_fc loaded without its transpose: loads (square), computes another function."""
    mapping = mapping_variant(tmp_path, "gpt2", '"_layer1.weight" = { from = "c_fc.weight", transform = "transpose" }',
                              '"_layer1.weight" = "c_fc.weight"', target="tests.mutants:gpt2_square")
    report = parity.check(str(extra["gpt2_square"]), mapping=mapping)
    assert [r.diagnosis["id"] for r in report.layers] == ["missing_transpose"] * 3
    assert "c_fc.weight" in report.layers[0].diagnosis["message"]


def test_square_module_with_right_mapping_passes(extra, tmp_path):
    mapping = mapping_variant(tmp_path, "gpt2", 'class = "parity.ffn:FeedForward"',
                              'class = "tests.mutants:gpt2_square"')
    report = parity.check(str(extra["gpt2_square"]), mapping=mapping)
    assert report.passed and all(r.diagnosis is None for r in report.layers)


def test_missing_transpose_square_linear(extra, tmp_path):
    mapping = mapping_variant(tmp_path, "llama", '"_down.weight" = "down_proj.weight"',
                              '"_down.weight" = { from = "down_proj.weight", transform = "transpose" }')
    report = parity.check(str(extra["llama_square"]), mapping=mapping, layers=[0, 2])
    assert [r.diagnosis["id"] for r in report.layers] == ["missing_transpose"] * 2


def test_missing_transpose_by_shape(tiny, tmp_path):
    mapping = mapping_variant(tmp_path, "gpt2",
                              '"_layer2.weight" = { from = "c_proj.weight", transform = "transpose" }',
                              '"_layer2.weight" = "c_proj.weight"')
    report = parity.check(str(tiny["gpt2"]), mapping=mapping, layers=[1])
    (layer,) = report.layers
    assert not layer.passed and layer.max_abs_diff is None
    assert layer.diagnosis["id"] == "missing_transpose" and "transposed" in layer.diagnosis["message"]


def test_exact_gelu_checkpoint_passes_with_exact_module(extra):
    report = parity.check(str(extra["gpt2_exact"]), target=m.gpt2_exact_gelu_module)
    assert report.passed and report.reference_activation == "gelu"


@pytest.mark.parametrize("model_type",
                         ["gpt2", "openai-gpt", "llama", "mistral", "qwen2", "gemma", "gemma2", "gemma3_text"])
def test_correct_modules_get_no_diagnosis(tiny, model_type):
    report = parity.check(str(tiny[model_type]))
    assert report.passed and all(r.diagnosis is None for r in report.layers)


def test_llama_bias_checkpoint_with_bias_module_passes(extra):
    assert parity.check(str(extra["llama_bias"])).passed


def test_unexplained_deviation(tiny):
    def scaled(emb_size, hidden_dim, bias, dropout):
        module = m.SwiGLU(emb_size, dropout, hidden_dim, bias)
        forward = module.forward
        module.forward = lambda x: forward(x) * 1.01
        return module

    report = parity.check(str(tiny["llama"]), target=scaled, layers=[0])
    assert report.layers[0].diagnosis["id"] == "unexplained"
    assert "closest known mistake" in report.layers[0].diagnosis["message"]
