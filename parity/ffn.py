"""The repository's feed-forward modules, exactly as the seed chapter specifies them.

These are the modules parity checks against transformers by default; user modules can
be checked instead with ``--target``.  Attribute names (``_layer1``, ``_gate`` ...) are
part of the spec: the mapping files address parameters by them.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class GELU(nn.Module):
    """tanh approximation of GELU (HF ``gelu_new`` / ``gelu_pytorch_tanh``), as in GPT-1/2 and Gemma."""

    def __init__(self) -> None:
        super().__init__()
        # A 0-dim tensor acts as a scalar: it keeps the input's dtype and device.
        self.sqrt_2_over_pi = torch.sqrt(torch.tensor(2.0) / math.pi)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1 + torch.tanh(self.sqrt_2_over_pi * (x + 0.044715 * torch.pow(x, 3))))


class SiLU(nn.Module):
    """SiLU / Swish with beta = 1: x * sigmoid(x)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x) * x


class FeedForward(nn.Module):
    """Classic FFN: dropout(phi(x W1 + b1) W2 + b2), d_ff = 4 * emb_size, biases always."""

    def __init__(self, emb_size: int, dropout: float = 0.1, activation: str = "relu") -> None:
        super().__init__()
        self._layer1 = nn.Linear(emb_size, emb_size * 4)
        if activation == "relu":
            self._activation = nn.ReLU()
        elif activation == "gelu":
            self._activation = nn.GELU()  # exact, erf form
        elif activation == "gelu_tanh":
            self._activation = GELU()  # tanh form (HF: gelu_new)
        else:
            raise ValueError(f"Unknown activation: {activation!r}; expected 'relu', 'gelu' or 'gelu_tanh'")
        self._layer2 = nn.Linear(emb_size * 4, emb_size)
        self._dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._dropout(self._layer2(self._activation(self._layer1(x))))


class _GatedFFN(nn.Module):
    """down(act(gate(x)) * up(x)): the activation sits on the gate branch, as in HF."""

    def __init__(self, emb_size: int, dropout: float, hidden_dim: int | None, bias: bool,
                 activation: nn.Module) -> None:
        super().__init__()
        hidden_dim = 4 * emb_size if hidden_dim is None else hidden_dim
        if hidden_dim <= 0:
            raise ValueError(f"hidden_dim must be positive, got {hidden_dim}")
        self._gate = nn.Linear(emb_size, hidden_dim, bias=bias)
        self._up = nn.Linear(emb_size, hidden_dim, bias=bias)
        self._down = nn.Linear(hidden_dim, emb_size, bias=bias)
        self._activation = activation
        self._dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_out = self._gate(x)
        activation_out = self._activation(gate_out)
        up_out = self._up(x)
        out = self._down(up_out * activation_out)
        return self._dropout(out)


class SwiGLU(_GatedFFN):
    """SiLU-gated FFN (LLaMA, Mistral, Qwen2, Mixtral experts)."""

    def __init__(self, emb_size: int, dropout: float = 0.1, hidden_dim: int | None = None, bias: bool = True) -> None:
        super().__init__(emb_size, dropout, hidden_dim, bias, SiLU())


class GeGLU(_GatedFFN):
    """tanh-GELU-gated FFN (Gemma 1, 2, 3)."""

    def __init__(self, emb_size: int, dropout: float = 0.1, hidden_dim: int | None = None, bias: bool = True) -> None:
        super().__init__(emb_size, dropout, hidden_dim, bias, GELU())


def llama_intermediate_size(embed_dim: int, multiple_of: int = 256, ffn_dim_multiplier: float | None = None) -> int:
    """LLaMA's d_ff: floor(8d/3), optionally scaled, rounded UP to a multiple of ``multiple_of``."""
    hidden = int(2 * 4 * embed_dim / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)
