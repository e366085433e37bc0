"""Targets that are broken in the ways a user's module can be (for tests/test_errors.py)."""

from torch import nn

from parity.ffn import SwiGLU


class RaisesInInit(nn.Module):
    def __init__(self, *args, **kwargs):
        raise RuntimeError("boom in __init__")


def not_a_module(**kwargs):
    return 42


class WrongSignature(nn.Module):
    def __init__(self, width):
        super().__init__()


class ForwardRaises(SwiGLU):
    def forward(self, x):
        raise ValueError("boom in forward")


class WrongOutputShape(SwiGLU):
    def forward(self, x):
        return super().forward(x)[..., :5]


class ReturnsNone(SwiGLU):
    def forward(self, x):
        return None


def swiglu_with_bias(emb_size, hidden_dim, bias, dropout):
    """Has biases the (bias-free) LLaMA checkpoint does not hold."""
    return SwiGLU(emb_size, dropout, hidden_dim, True)


class BrokenParameters(SwiGLU):
    """Breaks inside parity's own code path (not a forward): exercises the internal-error catch-all."""

    def named_parameters(self, *args, **kwargs):
        raise ZeroDivisionError("deliberately broken named_parameters")
