"""MLX FFNs written for this project in the style of MLX ports (mlx-lm's MLP(args), mlx-examples' dims /
hidden_dims), correct and broken, for tests/test_frameworks.py.  Importing this module needs mlx."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


class GPT2MLP(nn.Module):
    def __init__(self, dims: int, hidden_dims: int):
        super().__init__()
        self.c_fc = nn.Linear(dims, hidden_dims)
        self.c_proj = nn.Linear(hidden_dims, dims)

    def __call__(self, x):
        return self.c_proj(nn.gelu_approx(self.c_fc(x)))


class MLP(nn.Module):
    """mlx-lm's style: the model's args, gate/up/down."""

    def __init__(self, args):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def activation(self, x):
        return nn.silu(x)

    def __call__(self, x):
        return self.down_proj(self.activation(self.gate_proj(x)) * self.up_proj(x))


class GemmaMLP(MLP):
    def activation(self, x):
        return nn.gelu_approx(x)


class ExactGeluGPT2MLP(GPT2MLP):
    def __call__(self, x):
        return self.c_proj(nn.gelu(self.c_fc(x)))


class SwappedMLP(MLP):
    def __call__(self, x):
        return self.down_proj(self.activation(self.up_proj(x)) * self.gate_proj(x))


class DropoutOnMLP(MLP):
    """Keeps dropout on whatever mode it is put in."""

    def __init__(self, args):
        super().__init__(args)
        self.dropout = nn.Dropout(0.2)

    def train(self, mode: bool = True):
        return super().train(True)

    def __call__(self, x):
        return self.dropout(super().__call__(x))


def instance(hidden: int, width: int) -> MLP:
    """An MLX module built by the caller (parity.check(target=...)), with values to tell if it is modified."""
    class Args:
        hidden_size, intermediate_size = hidden, width

    module = MLP(Args())
    module.update({"gate_proj": {"weight": mx.ones((width, hidden))}})
    return module
