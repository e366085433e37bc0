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


# -- a constructor zoo: every way a constructor takes its sizes, each built to another size by parity's guess, for
# tests/test_targets_redteam.py (every factory parity prints for them must build a module that passes)

class _Meta(nn.Module):
    """SwiGLU sized as Meta's FeedForward sizes itself: hidden_dim is 4d, of which it keeps 2/3 (rounded up to
    multiple_of)."""

    def __init__(self, dim, hidden_dim, multiple_of=1):
        super().__init__()
        hidden = int(2 * hidden_dim / 3)
        hidden = multiple_of * ((hidden + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class PositionalOnly(_Meta):
    def __init__(self, dim, hidden_dim, /):
        super().__init__(dim, hidden_dim)


class KeywordOnly(_Meta):
    def __init__(self, *, dim, hidden_dim):
        super().__init__(dim, hidden_dim)


class KwargsOnly(_Meta):
    """Another model's default size (d = 96) unless told: reads its sizes from **kwargs, keeps all of hidden_dim."""

    def __init__(self, **kwargs):
        super().__init__(kwargs.get("dim", 96), kwargs.get("hidden_dim", 88) * 3 // 2)


class Defaults(_Meta):
    def __init__(self, dim=4096, hidden_dim=16384, multiple_of=256):
        super().__init__(dim, hidden_dim, multiple_of)


class ConfigAndWidth(_Meta):
    """Takes the config beside a plain width (which it reduces)."""

    def __init__(self, config, hidden_dim):
        super().__init__(config.hidden_size, hidden_dim)
