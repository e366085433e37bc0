"""Targets in other frameworks than PyTorch (parity.targets): MLX, Flax NNX, NumPy functions and ONNX graphs,
each checked with --target alone like a PyTorch module.  A correct GPT-2, SwiGLU and GeGLU FFN per framework
passes; each broken variant is named; the JSON names the framework.  A framework not installed here skips
with the reason (its wheel may not exist for this platform)."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest

import parity

from .support import ROOT, run_json, run_main

CORRECT = [("gpt2", "GPT2MLP"), ("llama", "MLP"), ("qwen2", "MLP"), ("gemma3_text", "GemmaMLP")]
BROKEN = [("gpt2", "ExactGeluGPT2MLP", "gelu_exact_instead_of_tanh"), ("llama", "SwappedMLP", "gate_up_swapped")]


def _needs(module: str) -> None:
    pytest.importorskip(module, reason=f"{module} is not installed here (parity's extras: pip install -e '.[test]')")


# -- MLX and Flax NNX: module classes ---------------------------------------------------------------------------

# (the framework's module, the ports' module, the report's framework name, its version key, a dropout left on)
MODULE_FRAMEWORKS = [("mlx.core", "tests.mlx_ports", "mlx", "mlx", ("llama", "DropoutOnMLP")),
                     ("flax.nnx", "tests.nnx_ports", "flax.nnx", "flax", ("gpt2", "DropoutOnGPT2MLP"))]


@pytest.mark.parametrize("framework", MODULE_FRAMEWORKS, ids=lambda f: f[2])
@pytest.mark.parametrize(("family", "cls"), CORRECT, ids=[f"{f}-{c}" for f, c in CORRECT])
def test_a_correct_port_passes_and_the_json_names_its_framework(tiny, framework, family, cls, capsys):
    needed, ports, name, version, _ = framework
    _needs(needed)
    code, report, err = run_json(capsys, tiny[family], "--layers", "0,1", "--target", f"{ports}:{cls}")
    assert code == 0, err
    assert report["framework"] == name and report["versions"][version]
    assert all(layer["passed"] and layer["diagnosis"] is None for layer in report["layers"])
    assert any("input mutation is not checked" in note for note in report["notes"])


@pytest.mark.parametrize("framework", MODULE_FRAMEWORKS, ids=lambda f: f[2])
@pytest.mark.parametrize("broken", [*BROKEN, "dropout"], ids=lambda v: v if isinstance(v, str) else v[1])
def test_a_broken_port_is_named(tiny, framework, broken, capsys):
    needed, ports, *_, dropout = framework
    _needs(needed)
    family, cls, mistake = (*dropout, "dropout_active") if broken == "dropout" else broken
    code, report, _ = run_json(capsys, tiny[family], "--layer", "1", "--target", f"{ports}:{cls}")
    assert code == 1 and report["layers"][0]["diagnosis"]["id"] == mistake, report["layers"][0]["diagnosis"]


def test_every_view_names_the_framework(tiny, tmp_path, capsys):
    _needs("mlx.core")
    junit, html = tmp_path / "r.xml", tmp_path / "r.html"
    code, out, err = run_main(capsys, tiny["llama"], "--layer", "0", "--target", "tests.mlx_ports:MLP",
                              "--junit", str(junit), "--html", str(html))
    assert code == 0, err
    assert "target      tests.mlx_ports:MLP (mlx " in out
    assert '<property name="framework" value="mlx"' in junit.read_text()
    assert "tests.mlx_ports:MLP</code> (mlx " in html.read_text()


def test_an_mlx_instance_is_checked_and_not_modified(tiny):
    _needs("mlx.core")
    import mlx.core as mx

    from tests.mlx_ports import instance

    module = instance(32, 88)  # tiny llama: d = 32, d_ff = 88
    report = parity.check(str(tiny["llama"]), layers=[0], target=module)
    assert report.passed and report.framework == "mlx"
    assert bool(mx.all(module.gate_proj.weight == 1.0))  # the caller's module still holds its own values


def test_an_mlx_port_in_bfloat16_computes_in_mlx_bfloat16(tiny, capsys):
    _needs("mlx.core")
    code, report, err = run_json(capsys, tiny["llama"], "--layer", "0", "--dtype", "bfloat16",
                                 "--target", "tests.mlx_ports:MLP")
    assert code == 0, err
    layer = report["layers"][0]
    assert report["dtype"] == "bfloat16" and layer["passed"]
    # computed in bfloat16: far from the float32 noise, within the reference's own bfloat16 error
    assert layer["max_abs_diff"] > 100 * layer["noise_floor"]


# -- Flax NNX --------------------------------------------------------------------------------------------------

def test_nnx_kernels_are_filled_transposed_and_a_kernel_filled_as_stored_is_named(tiny, tmp_path, capsys):
    """nnx.Linear stores kernel [in, out]: from LLaMA's [out, in] the inferred routes transpose; a mapping that
    fills a kernel as stored is missing_transpose."""
    _needs("flax.nnx")
    code, report, err = run_json(capsys, tiny["llama"], "--layer", "0", "--target", "tests.nnx_ports:MLP")
    assert code == 0, err
    assert report["routes"]["tensors"]["gate_proj.kernel"] == {"from": "gate_proj.weight", "transform": "transpose"}
    mapping = tmp_path / "nnx.toml"
    mapping.write_text('extends = "llama"\n[target]\nclass = "tests.nnx_ports:MLP"\n[tensors]\n'
                       '"gate_proj.kernel" = "gate_proj.weight"\n'
                       '"up_proj.kernel" = { from = "up_proj.weight", transform = "transpose" }\n'
                       '"down_proj.kernel" = { from = "down_proj.weight", transform = "transpose" }\n')
    code, report, _ = run_json(capsys, tiny["llama"], "--layer", "0", "--mapping", str(mapping))
    assert code == 1 and report["layers"][0]["diagnosis"]["id"] == "missing_transpose"


def test_an_nnx_constructor_of_sizes_and_a_default_config_passes(tiny, capsys):
    """features/hidden_dim bound by name, rngs passed, shd_config: ShardingConfig built with its defaults, a
    framework object's default (dtype=jnp.float32) left alone."""
    _needs("flax.nnx")
    code, report, err = run_json(capsys, tiny["gemma3_text"], "--layers", "0,1",
                                 "--target", "tests.nnx_ports:FeedForward")
    assert code == 0, err
    assert any("shd_config=ShardingConfig() (its defaults" in note for note in report["notes"]), report["notes"]


def test_bare_nnx_kernels_in_a_convention_group_pass(tiny, capsys):
    _needs("flax.nnx")
    code, _, err = run_json(capsys, tiny["llama"], "--layer", "0", "--target", "tests.nnx_ports:BareKernelMLP")
    assert code == 0, err


def test_an_nnx_instance_is_checked_and_not_modified(tiny):
    _needs("flax.nnx")
    import numpy as np

    from tests.nnx_ports import instance

    module = instance(32, 88)
    before = np.array(module.gate_proj.kernel[...])
    report = parity.check(str(tiny["llama"]), layers=[0], target=module)
    assert report.passed and report.framework == "flax.nnx"
    assert np.array_equal(np.array(module.gate_proj.kernel[...]), before)


# -- NumPy functions -------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("family", "function"), [("gpt2", "ffn"), ("llama", "swiglu"), ("qwen2", "swiglu"),
                                                  ("gemma3_text", "geglu")])
def test_a_correct_numpy_function_passes(tiny, family, function, capsys):
    code, report, err = run_json(capsys, tiny[family], "--layers", "0,1",
                                 "--target", f"tests.numpy_ports:{function}")
    assert code == 0, err
    assert report["framework"] == "numpy" and report["versions"]["numpy"]


@pytest.mark.parametrize(("family", "function", "mistake"),
                         [("gpt2", "ffn_exact_gelu", "gelu_exact_instead_of_tanh"),
                          ("llama", "swiglu_swapped", "gate_up_swapped")], ids=lambda v: str(v))
def test_a_broken_numpy_function_is_named(tiny, family, function, mistake, capsys):
    code, report, _ = run_json(capsys, tiny[family], "--layer", "1", "--target", f"tests.numpy_ports:{function}")
    assert code == 1 and report["layers"][0]["diagnosis"]["id"] == mistake


def test_a_numpy_function_that_writes_into_a_weight_is_told_where(tiny, capsys):
    code, _, err = run_main(capsys, tiny["llama"], "--layer", "0",
                            "--target", "tests.numpy_ports:swiglu_writes_its_weight")
    assert code == 2 and "read-only" in err and "numpy_ports.py" in err, err


def test_a_numpy_parameter_that_names_no_projection_is_exit_2_in_its_terms(tiny, capsys):
    code, _, err = run_main(capsys, tiny["llama"], "--layer", "0", "--target", "tests.numpy_ports:ffn_of_params")
    assert code == 2 and "its parameter 'params' names no projection" in err, err


def test_numpy_has_no_bfloat16_and_says_so(tiny, capsys):
    code, _, err = run_main(capsys, tiny["llama"], "--layer", "0", "--dtype", "bfloat16",
                            "--target", "tests.numpy_ports:swiglu")
    assert code == 2 and "--dtype bfloat16: a numpy target computes in float32, float16" in err, err


# -- ONNX graphs -----------------------------------------------------------------------------------------------

class SwappedExport:
    """An exporter fed the wrong module: LLaMA's MLP with the activation on the up branch."""

    def __new__(cls, mlp):
        import torch

        class Swapped(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.mlp = mlp

            def forward(self, x):
                m = self.mlp
                return m.down_proj(m.act_fn(m.up_proj(x)) * m.gate_proj(x))

        return Swapped().eval()


@pytest.fixture(scope="module")
def exports(tiny, tmp_path_factory):
    """Real exports of real layers, by torch's own exporter (dynamo): {name: path}."""
    _needs("onnxruntime")
    _needs("onnxscript")
    import torch
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("onnx")
    gpt2 = AutoModelForCausalLM.from_pretrained(tiny["gpt2"]).eval()
    llama = AutoModelForCausalLM.from_pretrained(tiny["llama"]).eval()
    assert gpt2.config.n_embd == llama.config.hidden_size
    x = torch.zeros(1, 4, gpt2.config.n_embd)
    made = {"gpt2-0": (gpt2.transformer.h[0].mlp, x), "gpt2-1": (gpt2.transformer.h[1].mlp, x),
            "llama-0": (llama.model.layers[0].mlp, x),
            "llama-0-swapped": (SwappedExport(llama.model.layers[0].mlp), x),
            "llama-0-f16": (copy.deepcopy(llama.model.layers[0].mlp).half(), x.half()),
            "llama-0-2d": (llama.model.layers[0].mlp, x[0])}  # a [tokens, d] input, fixed at 4 tokens
    paths = {}
    for name, (module, example) in made.items():
        paths[name] = root / f"{name}.onnx"
        torch.onnx.export(module, (example,), paths[name], dynamo=True, verbose=False)
    return paths


def test_an_onnx_export_of_the_layer_passes_and_its_initializers_are_identified(tiny, exports, capsys):
    code, report, err = run_json(capsys, tiny["gpt2"], "--layer", "0", "--target", str(exports["gpt2-0"]))
    assert code == 0, err
    assert report["framework"] == "onnx" and report["versions"]["onnxruntime"]
    identified = [n for n in report["notes"] if n.startswith("layer 0: ONNX initializer") and "checkpoint's" in n]
    assert len(identified) == 4, report["notes"]  # c_fc and c_proj, weight and bias
    code, report, err = run_json(capsys, tiny["llama"], "--layer", "0", "--target", str(exports["llama-0"]))
    assert code == 0, err
    code, report, err = run_json(capsys, tiny["llama"], "--layer", "0", "--target", str(exports["llama-0-2d"]))
    assert code == 0, err  # parity's [3, 16, d] tokens, fed 4 at a time as [4, d]


def test_an_onnx_export_of_another_layer_fails_and_says_which_initializers_are_not_this_layers(tiny, exports,
                                                                                              capsys):
    code, report, _ = run_json(capsys, tiny["gpt2"], "--layer", "0", "--target", str(exports["gpt2-1"]))
    assert code == 1
    assert sum("layer 0: ONNX initializer" in n and "is none of this layer's" in n for n in report["notes"]) == 4
    found = report["layers"][0]["diagnosis"]
    assert found["id"] == "other_layers_weights" and "layer 1's checkpoint tensors" in found["message"], found


def test_an_onnx_export_with_gate_and_up_swapped_is_named(tiny, exports, capsys):
    code, report, _ = run_json(capsys, tiny["llama"], "--layer", "0", "--target", str(exports["llama-0-swapped"]))
    assert code == 1 and report["layers"][0]["diagnosis"]["id"] == "gate_up_swapped"


def test_an_onnx_graph_computes_in_its_own_dtype(tiny, exports, capsys):
    code, _, err = run_main(capsys, tiny["llama"], "--layer", "0", "--target", str(exports["llama-0-f16"]))
    assert code == 2 and "computes in float16" in err and "--dtype float16" in err
    code, report, err = run_json(capsys, tiny["llama"], "--layer", "0", "--dtype", "float16",
                                 "--target", str(exports["llama-0-f16"]))
    assert code == 0, err


# -- every framework -------------------------------------------------------------------------------------------

def test_a_missing_framework_is_exit_2_naming_the_extra(tiny, tmp_path, capsys, monkeypatch):
    (tmp_path / "needs_mlx.py").write_text("import mlx.nn as nn\n\nclass MLP(nn.Module):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, "mlx", None)
    monkeypatch.setitem(sys.modules, "mlx.nn", None)
    code, _, err = run_main(capsys, tiny["llama"], "--layer", "0", "--target", "needs_mlx:MLP")
    assert code == 2 and "pip install 'mlx" in err and "parity[" not in err, err  # mlx's own name, never ours


def test_a_pytorch_check_imports_no_other_framework(tiny):
    code = ("import sys, parity; r = parity.check(sys.argv[1], layers=[0]); "
            "print(r.passed, sorted(m for m in ('mlx', 'jax', 'flax', 'onnxruntime', 'onnx') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, str(tiny["llama"])], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert out.stdout.split() == ["True", "[]"], out.stderr[-2000:]


def test_a_numpy_mapping_saved_on_a_checkpoint_with_biases_repeats_the_run(tiny, tmp_path, capsys):
    saved = tmp_path / "numpy.toml"
    code, _, err = run_main(capsys, tiny["gpt2"], "--layer", "0", "--target", "tests.numpy_ports:ffn_first_named_inp",
                            "--save-mapping", str(saved))
    assert code == 0, err
    assert '"c_fc.w" = ' in saved.read_text() and "module instance" not in saved.read_text()
    code, _, err = run_main(capsys, tiny["gpt2"], "--layer", "0", "--mapping", str(saved))
    assert code == 0, err


def test_outputs_that_are_no_hidden_states_are_told_so_not_diagnosed_as_half_precision(tiny, capsys):
    code, _, err = run_main(capsys, tiny["gpt2"], "--layer", "0", "--target", "tests.numpy_ports:ffn_returns_integers")
    assert code == 2 and "returned an array of int64" in err, err
    code, report, _ = run_json(capsys, tiny["gpt2"], "--layer", "0", "--target", "tests.numpy_ports:ffn_returns_zeros")
    assert code == 1 and report["layers"][0]["diagnosis"]["id"] != "low_precision_compute"


def test_a_target_module_with_a_syntax_error_is_named_with_its_line(tiny, tmp_path, capsys, monkeypatch):
    (tmp_path / "broken_syntax.py").write_text("def ffn(x, w1, w2, w3)\n    return x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code, _, err = run_main(capsys, tiny["llama"], "--layer", "0", "--target", "broken_syntax:ffn")
    assert code == 2 and "has a syntax error" in err and "line 1" in err and "PYTHONPATH" not in err, err
