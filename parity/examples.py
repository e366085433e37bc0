"""Example FFN modules for the documentation: each makes one typical porting mistake, so that every command
the docs show runs from a plain ``pip install`` of parity.

    parity gpt2 --layer 0 --target parity.examples:ExactGeluFFN          # exit 1: gelu_exact_instead_of_tanh
    parity gpt2 --layer 0 --target parity.examples:TanhGeluFFN           # exit 0: the same module, fixed
    parity llama --layer 0 --target parity.examples:SwappedSwiGLU        # exit 1: gate_up_swapped

They are written as a user would write them, with plain ``torch.nn`` layers, and take the same constructor
arguments as the repository's modules in ``parity.ffn`` (the built-in mappings' ``[target].args``), with the
same parameter names (``_layer1``, ``_gate`` ...), so a built-in mapping fills them as it fills
``parity.ffn``'s.  Nothing in parity imports this module.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ExactGeluFFN", "SwappedSwiGLU", "TanhGeluFFN"]


class ExactGeluFFN(nn.Module):
    """GPT-2's classic FFN written with PyTorch's exact GELU, ``nn.GELU()``.

    GPT-1 and GPT-2 were trained with the tanh approximation of GELU (transformers' ``gelu_new``); the exact
    (erf) form differs from it by up to 4.73e-4 near |z| = 2.7, so this module loads GPT-2's weights without
    an error and computes another function. parity diagnoses it as ``gelu_exact_instead_of_tanh``.

    ``activation`` is accepted because the ``gpt2`` mapping passes ``activation = "gelu_tanh"``, and ignored:
    that is the mistake. ``TanhGeluFFN`` is the same module with the fix.
    """

    def __init__(self, emb_size: int, dropout: float = 0.0, activation: str = "gelu_tanh") -> None:
        super().__init__()
        self._layer1 = nn.Linear(emb_size, 4 * emb_size)
        self._activation = self.make_activation()
        self._layer2 = nn.Linear(4 * emb_size, emb_size)
        self._dropout = nn.Dropout(dropout)

    def make_activation(self) -> nn.Module:
        return nn.GELU()  # the exact (erf) GELU: PyTorch's default

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._dropout(self._layer2(self._activation(self._layer1(x))))


class TanhGeluFFN(ExactGeluFFN):
    """``ExactGeluFFN`` fixed: the tanh GELU GPT-2 was trained with, ``nn.GELU(approximate="tanh")``. It passes."""

    def make_activation(self) -> nn.Module:
        return nn.GELU(approximate="tanh")


class SwappedSwiGLU(nn.Module):
    """A LLaMA-style SwiGLU, ``down(silu(gate(x)) * up(x))``, with the activation on the wrong branch.

    It computes ``down(silu(up(x)) * gate(x))``: the w1/w3 confusion of Meta's names (w1 is the gate, w3 the
    up projection). Gate and up have the same shape, so the weights load without any error and the module
    silently computes another function. parity diagnoses it as ``gate_up_swapped``.

    The constructor is ``parity.ffn.SwiGLU``'s, as the ``llama``, ``mistral``, ``qwen2`` and ``mixtral``
    mappings call it.
    """

    def __init__(self, emb_size: int, dropout: float = 0.0, hidden_dim: int | None = None, bias: bool = True) -> None:
        super().__init__()
        hidden_dim = 4 * emb_size if hidden_dim is None else hidden_dim
        self._gate = nn.Linear(emb_size, hidden_dim, bias=bias)
        self._up = nn.Linear(emb_size, hidden_dim, bias=bias)
        self._down = nn.Linear(hidden_dim, emb_size, bias=bias)
        self._dropout = nn.Dropout(dropout)

    @staticmethod
    def _activation(z: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(z) * z  # SiLU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._dropout(self._down(self._activation(self._up(x)) * self._gate(x)))  # should be gate, then up
