"""Very large layers: the reference computed in slices along d_ff (parity.engine.sliced) and the target
filled from the stored tensors read again one at a time (LayerOnDisk).  Forced on tiny checkpoints by
lowering SLICE_BYTES: results must be those of the whole-layer run (only the float64 summation order
changes) and every mistake must keep its diagnosis."""

import pytest
import torch

import parity
from parity.engine import sliced
from parity.engine.inputs import preactivation
from parity.engine.layer import LayerReader
from parity.engine.reference import ReferenceModel
from parity.engine.sliced import SlicedMLP, plan_slices, slice_bounds
from parity.engine.upcast import compute_in

from . import mutants as m
from .conftest import build_model, save

TINY_SLICE = 4000  # float64 bytes per slice: 6 to 13 slices of the tiny layers


@pytest.fixture()
def slicing(monkeypatch):
    """Every layer sliced; counts the slices run and the tensors read one at a time to fill a target."""
    seen = {"forwards": 0, "reads": 0}
    forward, read_one = SlicedMLP.forward, LayerReader.read_one

    def counting_forward(self, x):
        seen["forwards"] += 1
        return forward(self, x)

    def counting_read(self, *args, **kwargs):
        seen["reads"] += 1
        return read_one(self, *args, **kwargs)

    monkeypatch.setattr(sliced, "SLICE_BYTES", TINY_SLICE)
    monkeypatch.setattr(SlicedMLP, "forward", counting_forward)
    monkeypatch.setattr(LayerReader, "read_one", counting_read)
    return seen


def test_slice_bounds_cover_d_ff_once():
    for d_ff, count in ((53248, 39), (88, 7), (5, 5), (7, 100), (3072, 1)):
        bounds = slice_bounds(d_ff, count)
        assert bounds[0][0] == 0 and bounds[-1][1] == d_ff
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
        assert {stop - start for start, stop in bounds} <= {d_ff // len(bounds), d_ff // len(bounds) + 1}


def test_plan_only_cuts_what_is_a_sum_over_units():
    llama = {"gate_proj.weight": (88, 32), "up_proj.weight": (88, 32), "down_proj.weight": (32, 88)}
    gpt2 = {"c_fc.weight": (32, 128), "c_fc.bias": (128,), "c_proj.weight": (128, 32), "c_proj.bias": (32,)}
    assert plan_slices(llama, 88, 32, 10**9) is None  # small: whole
    assert plan_slices(llama, 88, 32, TINY_SLICE).axes == {"gate_proj.weight": 0, "up_proj.weight": 0,
                                                           "down_proj.weight": 1}
    assert plan_slices(gpt2, 128, 32, TINY_SLICE).axes == {"c_fc.weight": 1, "c_fc.bias": 0, "c_proj.weight": 0,
                                                           "c_proj.bias": None}
    assert plan_slices({**llama, "norm.weight": (88, 88)}, 88, 32, TINY_SLICE) is None  # no single d_ff axis
    assert plan_slices({"w.weight": (32, 32)}, 32, 32, 1) is None  # square: d_ff = d tells no axis


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "gemma"])
def test_sliced_reference_computes_the_whole_layer(model_type):
    """transformers' MLP built for each slice width, summed: the float64 result differs from the whole
    layer's by summation order only, far below the float32 noise the tolerance is made of."""
    model = build_model(model_type, seed=5)
    path = "transformer.h.1.mlp" if model_type == "gpt2" else "model.layers.1.mlp"
    stored = {n: t.detach().to(torch.bfloat16) for n, t in model.get_submodule(path).named_parameters()}
    config = model.config
    whole = ReferenceModel(config).build(path, stored, config.hidden_size)
    cut = ReferenceModel(config, slice_bytes=TINY_SLICE).build(path, stored, config.hidden_size)
    assert isinstance(cut, SlicedMLP) and len(cut.plan.bounds) > 3 and not isinstance(whole, SlicedMLP)
    x = torch.randn(3, 7, config.hidden_size, generator=torch.Generator().manual_seed(1)) * 3
    with torch.no_grad():
        z_whole, z_cut = preactivation(whole, x), preactivation(cut, x)
        assert z_whole.shape == z_cut.shape
        assert float((z_whole - z_cut).abs().max()) <= 1e-5 * float(z_whole.abs().max())  # float32 rounding
        want32, got32 = whole(x).double(), cut(x).double()
        want64 = compute_in(whole, torch.float64)(x.double())
        got64 = compute_in(cut, torch.float64)(x.double())
    noise = float((want32 - want64).abs().max())
    assert noise > 0
    assert float((got64 - want64).abs().max()) <= 1e-3 * noise
    assert float((got32 - want64).abs().max()) <= 10 * noise  # the sliced float32 run is as noisy as the whole one


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "gemma2"])
def test_sliced_check_reports_what_the_whole_check_reports(tiny, slicing, monkeypatch, model_type):
    sliced_report = parity.check(str(tiny[model_type]))
    layers = len(sliced_report.layers)
    assert slicing["forwards"] >= 2 * layers and slicing["reads"] >= 2 * layers  # float32 + float64; refilled
    monkeypatch.setattr(sliced, "SLICE_BYTES", 10**12)
    whole_report = parity.check(str(tiny[model_type]))
    assert sliced_report.passed and whole_report.passed
    for cut, whole in zip(sliced_report.layers, whole_report.layers, strict=True):
        # the inputs are scaled from the float32 pre-activation's reach, which slicing moves by float32 rounding:
        # the deviations move by that much, far inside the tolerance
        assert abs(cut.max_abs_diff - whole.max_abs_diff) <= 0.1 * whole.tolerance
        assert cut.fingerprint == whole.fingerprint
        assert cut.preactivation_range == pytest.approx(whole.preactivation_range, rel=1e-5)


def test_layers_below_the_slice_size_are_computed_whole(tiny, monkeypatch):
    """The default SLICE_BYTES leaves every layer up to a few GB of float64 weights whole: the results of
    ordinary checks are those of the whole-layer reference, bit for bit."""
    forward, calls = SlicedMLP.forward, []
    monkeypatch.setattr(SlicedMLP, "forward", lambda self, x: calls.append(1) or forward(self, x))
    assert parity.check(str(tiny["llama"])).passed and not calls

SLICED_ZOO = [
    ("gpt2", m.gpt2_exact_gelu, "gelu_exact_instead_of_tanh"),
    ("gemma", m.geglu_exact_gelu, "gelu_exact_instead_of_tanh"),
    ("gpt2", m.gpt2_quick_gelu, "quick_gelu"),
    ("llama", m.llama_with_geglu, "gelu_instead_of_silu"),
    ("llama", m.SwappedSwiGLU, "gate_up_swapped"),
    ("gemma", m.SwappedGeGLU, "gate_up_swapped"),
    ("gpt2", m.gpt2_no_output_bias, "bias_dropped"),
    ("llama_bias", m.llama_no_bias, "bias_dropped"),
    ("llama", m.llama_with_dropout, "dropout_active"),
    ("llama", m.bf16_swiglu, "low_precision_compute"),
    ("llama", m.llama_four_d, "intermediate_size_mismatch"),
]


@pytest.fixture(scope="module")
def llama_bias_folder(tmp_path_factory):
    return save(build_model("llama", seed=24, mlp_bias=True), tmp_path_factory.mktemp("sliced") / "llama_bias")


@pytest.mark.parametrize("checkpoint, target, expected", SLICED_ZOO, ids=[f"{c}-{e}" for c, _, e in SLICED_ZOO])
def test_sliced_layers_keep_their_diagnoses(tiny, llama_bias_folder, slicing, checkpoint, target, expected):
    folder = llama_bias_folder if checkpoint == "llama_bias" else tiny[checkpoint]
    report = parity.check(str(folder), target=target, layers=[1])
    (layer,) = report.layers
    assert not layer.passed and layer.diagnosis["id"] == expected, layer.diagnosis
    assert slicing["forwards"] > 0


def test_sliced_low_precision_run(tiny, slicing):
    """bfloat16 compute: the reference's own bfloat16 run stays whole (stored tensors, no float32 copy); the
    float32 and float64 truths are sliced; a correct module passes, a swapped one is named."""
    correct = parity.check(str(tiny["llama"]), dtype="bfloat16")
    swapped = parity.check(str(tiny["llama"]), target=m.SwappedSwiGLU, dtype="bfloat16")
    assert correct.passed and slicing["forwards"] > 0
    assert not swapped.passed
    assert {r.diagnosis["id"] for r in swapped.layers} == {"gate_up_swapped"}
