"""What a red team found a foreign target or a constructor could do to parity (issue 26), as users trigger it:
an ONNX graph that runs for ever must stop at Ctrl-C, a graph's fixed input shape is read before anything is
allocated, a target's prints never reach a stdout carrying a report, NumPy class ports are targets, a module of a
framework parity does not serve is named by its framework, every factory parity prints builds, and a size
mismatch names the size that differs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
import time

import numpy as np
import pytest

from .support import PARITY, ROOT, default_sigint, run_json, run_main

pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")


# -- ONNX graphs built with onnx.helper ------------------------------------------------------------------------

def _graph(path, nodes, x_shape, initializers=(), y_shape=None):
    from onnx import TensorProto, helper

    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape or x_shape)],
                              list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def forever_graph(path, d):
    """y = x + 0 * (a Loop of 2^62 trips adding 1): a graph that computes for ever."""
    from onnx import TensorProto, helper, numpy_helper

    scalar = helper.make_tensor_value_info
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]), helper.make_node("Add", ["v_in", "one"], ["v_out"])],
        "body", [scalar("i", TensorProto.INT64, []), scalar("cond_in", TensorProto.BOOL, []),
                 scalar("v_in", TensorProto.FLOAT, [])],
        [scalar("cond_out", TensorProto.BOOL, []), scalar("v_out", TensorProto.FLOAT, [])],
        [numpy_helper.from_array(np.array(1.0, np.float32), "one")])
    constants = {"M": np.array(2**62, np.int64), "cond": np.array(True), "v0": np.array(0.0, np.float32),
                 "zero": np.array(0.0, np.float32)}
    return _graph(path, [helper.make_node("Loop", ["M", "cond", "v0"], ["v"], body=body),
                         helper.make_node("Mul", ["v", "zero"], ["z"]), helper.make_node("Add", ["x", "z"], ["y"])],
                  ["b", "t", d], [numpy_helper.from_array(a, n) for n, a in constants.items()])


def identity_graph(path, x_shape):
    from onnx import helper

    return _graph(path, [helper.make_node("Identity", ["x"], ["y"])], x_shape)


MARK_RUN = """
import pathlib, onnxruntime
_run = onnxruntime.InferenceSession.run
def run(self, *args, **kwargs):
    pathlib.Path({marker!r}).touch()
    return _run(self, *args, **kwargs)
onnxruntime.InferenceSession.run = run
"""


@pytest.mark.slow  # a real SIGINT into a real process
def test_ctrl_c_stops_an_onnx_graph_that_runs_for_ever_with_exit_130(tiny, tmp_path):
    graph = forever_graph(tmp_path / "forever.onnx", 32)
    marker = tmp_path / "graph-started"
    hooks = tmp_path / "hooks"  # the child's sitecustomize: touches a file when ONNX Runtime starts the graph
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(MARK_RUN.format(marker=str(marker)))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join([str(hooks), str(ROOT)])}
    process = subprocess.Popen([*PARITY, str(tiny["llama"]), "--layer", "0", "--target", str(graph)], cwd=tmp_path,
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=default_sigint)
    try:
        deadline = time.monotonic() + 240
        while not marker.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marker.exists(), process.communicate(timeout=10)
        time.sleep(0.5)  # inside the Loop by now
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)  # a safety bound: a run that ignores Ctrl-C is killed, and fails
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
            pytest.fail("parity was still running 60 s after Ctrl-C: the ONNX graph's run held the process")
    assert process.returncode == 130, err
    assert err.strip().endswith("parity: interrupted") and "Traceback" not in err


class _RunUntilTerminated:
    """An ONNX Runtime session stand-in whose run holds its thread until the run's terminate flag is set, as a
    graph that runs for ever does, and records when it has returned."""

    def __init__(self):
        self.returned = False

    def run(self, names, feed, options):
        deadline = time.monotonic() + 60  # a safety bound: the interrupt never came
        while not options.terminate and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # ONNX Runtime takes a moment to leave the run
        self.returned = True
        raise RuntimeError("Exiting due to terminate flag being set to true")


def test_an_interrupted_onnx_run_has_returned_before_the_interrupt_goes_on():
    """The interrupt must not reach the interpreter's exit while the run is still on the worker thread: there the
    worker is ended inside ONNX Runtime's C++ frames and the process aborts (SIGABRT instead of exit 130).  A
    Thread.join broken by the KeyboardInterrupt marks the running worker as stopped and returns at once."""
    import _thread
    import threading

    from parity.targets.onnx_graph import stoppable_run

    session = _RunUntilTerminated()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # a background job starts with it ignored
    try:
        threading.Timer(0.3, _thread.interrupt_main).start()
        with pytest.raises(KeyboardInterrupt):
            stoppable_run(session, {"x": np.zeros(1, np.float32)})
    finally:
        signal.signal(signal.SIGINT, previous)
    assert session.returned, "the interrupt went on while the run was still on the worker thread"


def test_a_graph_fixed_to_2_to_the_26_tokens_is_exit_2_before_anything_is_allocated(tiny, tmp_path, capsys):
    graph = identity_graph(tmp_path / "huge.onnx", [1, 2**26, 32])  # fed padded, [1, 2^26, 32] is 8 GiB
    code, out, err = run_main(capsys, tiny["llama"], "--layer", "0", "--target", graph)
    assert code == 2, err
    assert "input 'x' has shape [1, 67108864, 32]" in err and "67108864 tokens per call" in err, err
    assert "dynamic" in err and "Traceback" not in err


@pytest.mark.parametrize("shape, says", [
    (["t", 48], "its width is 48, the checkpoint's hidden size is 32"),
    ([1, 1, "t", 32], "rank 4"),
    ([32], "rank 1"),
])
def test_a_graph_input_shape_parity_cannot_feed_is_exit_2_naming_it(tiny, tmp_path, capsys, shape, says):
    graph = identity_graph(tmp_path / "shaped.onnx", shape)
    code, _, err = run_main(capsys, tiny["llama"], "--layer", "0", "--target", graph)
    shown = "[" + ", ".join("'?'" if isinstance(n, str) else str(n) for n in shape) + "]"
    assert code == 2 and f"input 'x' has shape {shown}" in err and says in err, err


def test_a_graph_fixed_to_a_few_tokens_is_still_fed_in_batches(tiny, tmp_path, capsys):
    graph = identity_graph(tmp_path / "few.onnx", [1, 5, 32])  # 48 tokens in 10 calls of 5, the last padded
    code, report, err = run_json(capsys, tiny["llama"], "--layer", "0", "--target", graph)
    assert code == 1 and report["layers"][0]["max_abs_diff"] is not None, err  # computed (identity is no FFN)


# -- a target's own output ---------------------------------------------------------------------------------------

@pytest.mark.slow  # file descriptor 1 of a real process
def test_a_target_printing_10_mb_and_writing_to_fd_1_leaves_the_json_report_whole(tiny, tmp_path):
    result = subprocess.run([*PARITY, str(tiny["llama"]), "--layer", "0", "--target",
                             "tests.numpy_ports:swiglu_chatty", "--json", "-"], cwd=ROOT, capture_output=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)  # stdout is the report and nothing else
    assert report["passed"] is True
    assert b"CHATTY-FD1" in result.stderr and b"CHATTY-PRINT" in result.stderr
    assert len(result.stderr) > 10 * 1024 * 1024  # the 10 MB went to stderr, not lost


CHATTY_MODULE = """
    import os
    from parity.ffn import SwiGLU

    class Chatty(SwiGLU):
        def __init__(self, emb_size, hidden_dim, bias=False, dropout=0.0):
            print("CHATTY-INIT")
            os.write(1, b"CHATTY-INIT-FD1\\n")
            super().__init__(emb_size, dropout, hidden_dim, bias)

        def forward(self, x):
            os.write(1, b"CHATTY-FORWARD-FD1\\n")
            return super().forward(x)
"""


@pytest.mark.slow  # file descriptor 1 of a real process
def test_a_pytorch_target_printing_in_its_constructor_and_forward_leaves_the_json_report_whole(tiny, tmp_path):
    (tmp_path / "chatty.py").write_text(textwrap.dedent(CHATTY_MODULE))
    result = subprocess.run([*PARITY, str(tiny["llama"]), "--layer", "0", "--target", "chatty:Chatty",
                             "--json", "-"], cwd=tmp_path, capture_output=True, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout)["passed"] is True
    assert all(word in result.stderr for word in ("CHATTY-INIT", "CHATTY-INIT-FD1", "CHATTY-FORWARD-FD1"))


# -- NumPy class ports --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("target", ["FeedForward", "SizedFeedForward", "make_llama3np"])
def test_a_numpy_class_port_passes_built_by_parity_or_by_a_factory(tiny, capsys, target):
    code, report, err = run_json(capsys, tiny["llama"], "--layers", "0,1", "--target", f"tests.numpy_ports:{target}")
    assert code == 0, err
    assert report["framework"] == "numpy" and report["versions"]["numpy"]


def test_a_numpy_class_with_picogpt_dicts_as_attributes_passes(tiny, capsys):
    code, report, err = run_json(capsys, tiny["gpt2"], "--layer", "0", "--target", "tests.numpy_ports:GPT2Block")
    assert code == 0, err


def test_a_numpy_class_with_gate_and_up_swapped_is_named(tiny, capsys):
    code, report, _ = run_json(capsys, tiny["llama"], "--layer", "1",
                               "--target", "tests.numpy_ports:FeedForwardSwapped")
    assert code == 1 and report["layers"][0]["diagnosis"]["id"] == "gate_up_swapped"


def test_a_numpy_class_mapping_saved_repeats_the_run_and_routes_its_attributes(tiny, tmp_path, capsys):
    saved = tmp_path / "llama3np.toml"
    code, _, err = run_main(capsys, tiny["llama"], "--layer", "0", "--target", "tests.numpy_ports:FeedForward",
                            "--save-mapping", saved)
    assert code == 0, err
    assert '"up_weight" = { from = "up_proj.weight"' in saved.read_text()
    code, _, err = run_main(capsys, tiny["llama"], "--layer", "1", "--mapping", saved)
    assert code == 0, err


def test_a_numpy_class_instance_is_checked_and_not_modified(tiny):
    import parity
    from tests.numpy_ports import FeedForward

    d, d_ff = 32, 88
    rng = np.random.default_rng(1)
    port = FeedForward(rng.standard_normal((d_ff, d)), rng.standard_normal((d_ff, d)), rng.standard_normal((d, d_ff)))
    before = port.up_weight.copy()
    report = parity.check(str(tiny["llama"]), layers=[0], target=port)
    assert report.passed and report.framework == "numpy"
    assert np.array_equal(port.up_weight, before)


# -- frameworks parity does not serve -----------------------------------------------------------------------------

UNSERVED_MODULE = """
    class Tensor:  # stands for tinygrad.Tensor: tinygrad models are plain classes holding them
        pass

    Tensor.__module__ = "tinygrad.tensor"

    class Module:  # a class whose MRO names tinygrad, as tinygrad.nn's layers are
        pass

    Module.__module__ = "tinygrad.nn"

    class TinyFFN(Module):
        def __init__(self, dim, hidden_dim):
            self.w1 = Tensor()

        def __call__(self, x):
            return x

    class HoldsTinygrad:
        def __init__(self, dim, hidden_dim):
            self.w1 = Tensor()

        def __call__(self, x):
            return x

    def make_holds_tinygrad(config):
        return HoldsTinygrad(config.hidden_size, config.intermediate_size)
"""


def test_a_flax_linen_module_is_refused_by_its_framework(tiny, tmp_path, capsys, monkeypatch):
    pytest.importorskip("flax.linen")
    (tmp_path / "linen_ffn.py").write_text(textwrap.dedent("""
        import flax.linen as nn

        class FeedForward(nn.Module):
            features: int = 32

            @nn.compact
            def __call__(self, x):
                return nn.Dense(self.features)(x)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    code, _, err = run_main(capsys, tiny["llama"], "--layer", "0", "--target", "linen_ffn:FeedForward")
    assert code == 2 and "flax.linen modules are not served" in err and "flax.nnx" in err, err
    assert "derives from none of" not in err


@pytest.mark.parametrize("target, says", [
    ("TinyFFN", "is a tinygrad module (it derives from tinygrad.nn.Module); tinygrad modules are not served"),
    ("make_holds_tinygrad", "holds tinygrad.tensor.Tensor in its attribute 'w1': it is tinygrad code"),
])
def test_a_tinygrad_module_is_refused_by_its_framework(tiny, tmp_path, capsys, monkeypatch, target, says):
    (tmp_path / "tiny_ffn.py").write_text(textwrap.dedent(UNSERVED_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    code, _, err = run_main(capsys, tiny["llama"], "--layer", "0", "--target", f"tiny_ffn:{target}")
    assert code == 2 and says in err and "ONNX" in err, err


# -- constructors: every printed factory builds; a size mismatch names the size ------------------------------------

ZOO = ["PositionalOnly", "KeywordOnly", "KwargsOnly", "Defaults", "ConfigAndWidth"]


def printed_factories(text: str) -> list[str]:
    """Every `def make_ffn(config): return CALL` in ``text``, CALL cut at its balanced closing parenthesis."""
    found, marker = [], "def make_ffn(config): return "
    start = text.find(marker)
    while start >= 0:
        body = text[start + len(marker):]
        depth = 0
        for end, char in enumerate(body):
            depth += {"(": 1, ")": -1}.get(char, 0)
            if char == ")" and depth == 0:
                found.append(body[:end + 1])
                break
        start = text.find(marker, start + 1)
    return found


def test_every_factory_parity_prints_for_the_constructor_zoo_builds_a_module_that_passes(tiny, capsys):
    import parity
    from tests import broken_targets

    built = {}
    for name in ZOO:
        code, _, err = run_main(capsys, tiny["llama"], "--layer", "0", "--target", f"tests.broken_targets:{name}")
        assert code == 2, (name, err)
        factories = printed_factories(err)
        assert factories, (name, err)
        for call in factories:
            namespace = {name: getattr(broken_targets, name)}
            exec(f"def make_ffn(config):\n    return {call}\n", namespace)  # as the user would paste it
            report = parity.check(str(tiny["llama"]), layers=[0], target=namespace["make_ffn"])
            assert report.passed, (name, call)
            built[name] = call
    assert built["PositionalOnly"] == "PositionalOnly(config.hidden_size, 132)"  # positional-only, positionally
    assert built["KeywordOnly"].startswith("KeywordOnly(dim=config.hidden_size")
    assert set(built) == set(ZOO)


def test_a_kwargs_constructor_built_to_another_models_size_is_exit_2_naming_d_with_both_values(tiny, capsys):
    code, out, err = run_main(capsys, tiny["llama"], "--layer", "0", "--target", "tests.broken_targets:KwargsOnly")
    assert code == 2 and not out.strip(), err
    assert "its d is 96, the checkpoint's is 32" in err and "d_ff is 88 but" not in err, err
    assert "its own defaults for dim" in err and "KwargsOnly(dim=config.hidden_size, hidden_dim=" in err, err


def test_a_module_of_another_width_is_told_its_d_differs_not_its_d_ff(tiny, tmp_path, capsys, monkeypatch):
    """Built by the user's own factory (so judged, exit 1): the shape finding names d, with both values."""
    (tmp_path / "wide.py").write_text(textwrap.dedent("""
        from tests.broken_targets import _Meta

        def make_ffn(config):
            return _Meta(96, config.intermediate_size * 3 // 2)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    code, report, err = run_json(capsys, tiny["llama"], "--layer", "0", "--target", "wide:make_ffn")
    assert code == 1, err
    message = report["layers"][0]["diagnosis"]["message"]
    assert "the target's d is 96 but the checkpoint's is 32" in message and "d_ff is 88 but" not in message, message
