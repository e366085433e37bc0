"""Typical mistakes, each as a module with the repository modules' constructor signatures."""

import torch
from torch import nn

from parity.ffn import FeedForward, GeGLU, SwiGLU


def gpt2_exact_gelu(emb_size, activation, dropout):
    """GPT-2 FFN with PyTorch's exact GELU instead of the tanh form."""
    return FeedForward(emb_size, dropout, "gelu")


class SwappedSwiGLU(SwiGLU):
    """Activation applied to the up branch (w1/w3 confusion)."""

    def forward(self, x):
        return self._dropout(self._down(self._activation(self._up(x)) * self._gate(x)))


class SwappedGeGLU(GeGLU):
    def forward(self, x):
        return self._dropout(self._down(self._activation(self._up(x)) * self._gate(x)))


def gemma_with_silu(emb_size, hidden_dim, bias, dropout):
    """A GeGLU checkpoint run through a SwiGLU module."""
    return SwiGLU(emb_size, dropout, hidden_dim, bias)


def llama_with_dropout(emb_size, hidden_dim, bias, dropout):
    """Dropout left on: a module that stays in train mode whatever eval() says."""
    module = SwiGLU(emb_size, 0.1, hidden_dim, bias)

    class AlwaysTrain(nn.Dropout):
        def forward(self, x):
            return nn.functional.dropout(x, self.p, training=True)

    module._dropout = AlwaysTrain(0.1)
    return module


class Bf16SwiGLU(SwiGLU):
    """Computes in bfloat16."""

    def forward(self, x):
        return super().forward(x.bfloat16()).float()


class ConfigMLP(nn.Module):
    """A user's module in the common style: built from the config, nn.Linear c_fc / c_proj."""

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.act = nn.GELU(approximate="tanh")

    def forward(self, x):
        return self.c_proj(self.act(self.c_fc(x)))
