"""Bounded per-layer memory: per-call upcasting, the early-stopping pre-activation probe,
the cheap finiteness check and the frozen-gc layer loop."""

import gc
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import parity
import parity.engine.suite
from parity.engine.inputs import preactivation
from parity.engine.layer import all_finite
from parity.engine.memory import young_objects_only
from parity.engine.upcast import compute_in, upcast_on_call, works_on_call
from parity.errors import WeightDefectError

from .conftest import build_model


def llama_mlp(dtype=torch.bfloat16):
    return build_model("llama", seed=3).model.layers[0].mlp.to(dtype)


def test_upcast_on_call_computes_exactly_as_a_converted_module():
    stored = llama_mlp()
    x = torch.randn(2, 5, 32)
    want32, want64 = [
        type(stored).forward(converted, x.to(dtype))
        for dtype, converted in ((torch.float32, _converted(stored, torch.float32)),
                                 (torch.float64, _converted(stored, torch.float64)))
    ]
    hooked = upcast_on_call(_converted(stored, torch.bfloat16), torch.float32)
    with torch.no_grad():
        got32 = hooked(x)
        got64 = compute_in(hooked, torch.float64)(x.double())
    assert got32.dtype == torch.float32 and torch.equal(got32, want32)
    assert got64.dtype == torch.float64 and torch.equal(got64, want64)
    assert {p.dtype for p in hooked.parameters()} == {torch.bfloat16}  # released after the call


def test_scratch_buffers_are_reused_across_shapes_and_dtypes():
    stored = build_model("gpt2", seed=4).transformer.h[0].mlp.to(torch.bfloat16)  # weights and biases of 4 sizes
    x = torch.randn(3, 4, 32)
    want = _converted(stored, torch.float32)(x)
    hooked = upcast_on_call(_converted(stored, torch.bfloat16), torch.float32)
    with torch.no_grad():
        for _ in range(3):  # later calls run on buffers left by earlier ones
            assert torch.equal(hooked(x), want)
        assert torch.equal(compute_in(hooked, torch.float64)(x.double()), _converted(stored, torch.float64)(x.double()))
        assert torch.equal(compute_in(hooked, torch.float32)(x), want)


def test_a_hooked_module_converted_as_a_whole_computes_in_that_dtype():
    stored = llama_mlp()
    x = torch.randn(2, 3, 32, dtype=torch.float64)
    hooked = upcast_on_call(_converted(stored, torch.bfloat16), torch.float32).double()  # the pre-upcast idiom
    with torch.no_grad():
        got = hooked(x)
    assert got.dtype == torch.float64 and torch.equal(got, _converted(stored, torch.float64)(x))
    assert {p.dtype for p in hooked.parameters()} == {torch.float64}


def test_only_the_running_projection_is_upcast():
    module = upcast_on_call(llama_mlp(), torch.float64)
    seen = {}
    for name, child in module.named_children():
        if any(True for _ in child.parameters()):
            # registered after upcast_on_call's hooks: runs once this child is materialised
            child.register_forward_pre_hook(
                lambda m, args, name=name: seen.update({name: {n: p.dtype for n, p in module.named_parameters()}}))
    with torch.no_grad():
        module(torch.randn(1, 2, 32, dtype=torch.float64))
    assert set(seen) == {"gate_proj", "up_proj", "down_proj"}
    for running, dtypes in seen.items():
        assert {n for n, d in dtypes.items() if d == torch.float64} == {f"{running}.weight"}


@pytest.mark.parametrize("model_type", ["gpt2", "llama", "gemma3_text"])
def test_checks_use_per_call_upcasting(tiny, model_type):
    session = parity.engine.suite.open_session(str(tiny[model_type]))
    tensors = {k: v.to(torch.bfloat16) for k, v in session.read_layer(0, dtype=None).items()}
    reference = session.build_reference(0, tensors)
    assert hasattr(reference, "_parity_compute")  # not converted as a whole
    assert {p.dtype for p in reference.parameters()} == {torch.bfloat16}


def test_forward_reading_a_child_dtype_is_not_upcast_per_call():
    class ReadsDtype(nn.Module):  # T5DenseActDense casts its input to wo.weight.dtype before calling wo
        def __init__(self):
            super().__init__()
            self.wo = nn.Linear(8, 8)

        def forward(self, x):
            return self.wo(x.to(self.wo.weight.dtype))

    with torch.device("meta"):
        meta = ReadsDtype()
    assert not works_on_call(meta, torch.bfloat16, 8)
    with torch.device("meta"):
        assert works_on_call(build_model("llama").model.layers[0].mlp.to("meta"), torch.bfloat16, 32)


def test_preactivation_stops_at_the_activation():
    module = llama_mlp(torch.float32)
    calls = []
    module.down_proj.register_forward_pre_hook(lambda m, a: calls.append(1))
    x = torch.randn(1, 3, 32)
    z = preactivation(module, x)
    assert not calls
    assert torch.equal(z, module.gate_proj(x))
    module(x)  # the hook was removed: a later forward runs through
    assert calls == [1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_all_finite_finds_any_nan_or_inf(dtype):
    t = torch.randn(64, 48).to(dtype)
    assert all_finite(t) and all_finite(torch.zeros(0, dtype=dtype)) and all_finite(torch.arange(5))
    for bad in (float("nan"), float("inf"), float("-inf")):
        for index in ((0, 0), (17, 33), (63, 47)):
            u = t.clone()
            u[index] = bad
            assert not all_finite(u), (bad, index)


def test_nan_weight_is_a_checkpoint_defect(tiny, tmp_path):
    folder = shutil.copytree(tiny["llama"], tmp_path / "llama")
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][5, 7] = float("nan")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    assert parity.check(str(folder), layers=[0]).passed
    with pytest.raises(WeightDefectError, match=r"layers\.1\.mlp\.up_proj\.weight.*1 NaN/Inf"):
        parity.check(str(folder), layers=[1])


def test_layer_loop_collects_cycles_and_unfreezes():
    class Cycle:
        def __init__(self):
            self.me = self

    with young_objects_only():
        assert gc.get_freeze_count() > 0
        ref = Cycle()
        import weakref

        alive = weakref.ref(ref)
        del ref
        gc.collect()
        assert alive() is None
    assert gc.get_freeze_count() == 0


def _converted(module, dtype):
    import copy

    return copy.deepcopy(module).to(dtype)
