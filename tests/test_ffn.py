"""The repository's FFN modules reproduce the seed chapter's numbers."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from parity.ffn import GELU, FeedForward, GeGLU, SiLU, SwiGLU, llama_intermediate_size

# x, GELU (erf), GELU (tanh), SiLU  -- the seed chapter's table, 4 decimals
TABLE = [
    (-3, -0.0040, -0.0036, -0.1423), (-2, -0.0455, -0.0454, -0.2384), (-1, -0.1587, -0.1588, -0.2689),
    (-0.5, -0.1543, -0.1543, -0.1888), (0, 0.0, 0.0, 0.0), (0.5, 0.3457, 0.3457, 0.3112),
    (1, 0.8413, 0.8412, 0.7311), (2, 1.9545, 1.9546, 1.7616), (3, 2.9960, 2.9964, 2.8577),
]


@pytest.mark.parametrize("x, erf, tanh, silu", TABLE)
def test_activation_table(x, erf, tanh, silu):
    t = torch.tensor([float(x)])
    assert GELU()(t).item() == pytest.approx(tanh, abs=5e-5)
    assert torch.nn.GELU()(t).item() == pytest.approx(erf, abs=5e-5)
    assert SiLU()(t).item() == pytest.approx(silu, abs=5e-5)


def test_tanh_gelu_max_error_vs_exact():
    x = torch.linspace(-20, 20, 4_000_001, dtype=torch.float64)
    err = (GELU()(x) - 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))).abs()
    assert err.max().item() == pytest.approx(4.73e-4, abs=5e-6)
    assert abs(x[err.argmax()].item()) == pytest.approx(2.70, abs=0.01)


def relative_error(got: torch.Tensor, truth: torch.Tensor) -> float:
    """Largest error against a float64 truth, relative to max(|truth|, 1): in float32 ulps of the output."""
    return ((got.double() - truth).abs() / truth.abs().clamp_min(1.0)).max().item()


def test_gelu_matches_torch_tanh_form_in_float32():
    # Both float32 results against the float64 truth: parity's GELU may err at most 10x what torch's own
    # float32 kernel does (at least one ulp).  Comparing the two float32 results with each other (1 ulp,
    # 2.4e-7) held only while both happened to round alike on this CPU.
    x = torch.cat([torch.randn(1_000_000, generator=torch.Generator().manual_seed(0)), torch.linspace(-4, 4, 200_001),
                   torch.linspace(-20, 20, 400_001)])
    truth = F.gelu(x.double(), approximate="tanh")
    noise = max(relative_error(F.gelu(x, approximate="tanh"), truth), torch.finfo(torch.float32).eps)
    assert relative_error(GELU()(x), truth) <= 10 * noise
    assert relative_error(F.gelu(x.double()), truth) > 1000 * noise  # the exact form is far outside that


def test_silu_matches_torch():
    x = torch.linspace(-10, 10, 10_001)
    assert torch.allclose(SiLU()(x), F.silu(x), atol=1e-6)


def test_gelu_keeps_dtype():
    assert GELU()(torch.ones(3, dtype=torch.bfloat16)).dtype == torch.bfloat16


@pytest.mark.parametrize("args, expected", [
    ((4096,), 11008), ((5120,), 13824), ((8192, 4096, 1.3), 28672), ((288, 32), 768), ((512,), 1536), ((2048,), 5632),
])
def test_llama_intermediate_size(args, expected):
    assert llama_intermediate_size(*args) == expected


def test_llama_intermediate_size_rounds_up_not_down():
    assert llama_intermediate_size(4096) != 10752


def count(module):
    return sum(p.numel() for p in module.parameters())


def test_parameter_counts():
    assert count(FeedForward(256)) == 525_568 == 8 * 256**2 + 5 * 256
    assert count(FeedForward(768)) == 4_722_432
    assert count(SwiGLU(256)) == 788_736
    assert count(SwiGLU(256, hidden_dim=768, bias=False)) == 589_824
    assert count(GeGLU(256)) == 788_736


def test_unknown_activation_raises():
    with pytest.raises(ValueError, match="swish"):
        FeedForward(8, activation="swish")


@pytest.mark.parametrize("cls", [SwiGLU, GeGLU])
@pytest.mark.parametrize("hidden_dim", [0, -4])
def test_nonpositive_hidden_dim_raises(cls, hidden_dim):
    with pytest.raises(ValueError):
        cls(8, hidden_dim=hidden_dim)


def test_module_structure():
    ff = FeedForward(8, activation="gelu_tanh")
    assert [n for n, _ in ff.named_children()] == ["_layer1", "_activation", "_layer2", "_dropout"]
    assert isinstance(ff._activation, GELU)
    assert isinstance(FeedForward(8, activation="gelu")._activation, torch.nn.GELU)
    sw = SwiGLU(8, hidden_dim=12, bias=False)
    assert [n for n, _ in sw.named_children()] == ["_gate", "_up", "_down", "_activation", "_dropout"]
    assert sw._gate.bias is None and sw._gate.out_features == 12
    assert isinstance(sw._activation, SiLU) and isinstance(GeGLU(8)._activation, GELU)


def test_swiglu_formula_activation_on_gate():
    torch.manual_seed(0)
    m = SwiGLU(6, dropout=0.0, hidden_dim=10).eval()
    x = torch.randn(2, 3, 6)
    with torch.no_grad():  # the formula in float64 is the truth; torch's own float32 run of it the noise floor
        g, u, d = (layer.double() for layer in (copy.deepcopy(m._gate), copy.deepcopy(m._up), copy.deepcopy(m._down)))
        expected = d(F.silu(g(x.double())) * u(x.double()))
        swapped = d(F.silu(u(x.double())) * g(x.double()))
        noise = (m._down(F.silu(m._gate(x)) * m._up(x)).double() - expected).abs().max().item()
        got = (m(x).double() - expected).abs().max().item()
    noise = max(noise, torch.finfo(torch.float32).eps * expected.abs().max().item())
    assert got <= 10 * noise
    assert (swapped - expected).abs().max().item() > 1000 * noise


def test_dropout_only_at_output_and_off_in_eval():
    m = FeedForward(16, dropout=0.5)
    x = torch.randn(4, 16)
    m.eval()
    assert torch.equal(m(x), m(x))
    m.train()
    torch.manual_seed(1)
    assert not torch.equal(m(x), m(x))
    assert sum(isinstance(c, torch.nn.Dropout) for c in m.modules()) == 1
