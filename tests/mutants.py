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


def bf16_swiglu(emb_size, hidden_dim, bias, dropout):
    """Weights held and computed in bfloat16 (model.to(torch.bfloat16))."""
    return SwiGLU(emb_size, dropout, hidden_dim, bias).to(torch.bfloat16)


class AutocastGeGLU(GeGLU):
    """float32 weights, but the forward runs under bfloat16 autocast."""

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return super().forward(x).float()


def fp16_gpt2(emb_size, activation, dropout):
    return FeedForward(emb_size, dropout, activation).to(torch.float16)


class ConfigMLP(nn.Module):
    """A user's module in the common style: built from the config, nn.Linear c_fc / c_proj."""

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.act = nn.GELU(approximate="tanh")

    def forward(self, x):
        return self.c_proj(self.act(self.c_fc(x)))


class _Gated(nn.Module):
    """down(act(gate(x)) * up(x)) with a chosen activation; the zoo's base for activation mix-ups."""

    def __init__(self, emb_size, hidden_dim, bias, act):
        super().__init__()
        self._gate = nn.Linear(emb_size, hidden_dim, bias=bias)
        self._up = nn.Linear(emb_size, hidden_dim, bias=bias)
        self._down = nn.Linear(hidden_dim, emb_size, bias=bias)
        self._act = act

    def forward(self, x):
        return self._down(self._act(self._gate(x)) * self._up(x))


def geglu_exact_gelu(emb_size, hidden_dim, bias, dropout):
    return _Gated(emb_size, hidden_dim, bias, nn.GELU())


def geglu_quick_gelu(emb_size, hidden_dim, bias, dropout):
    return _Gated(emb_size, hidden_dim, bias, lambda z: z * torch.sigmoid(1.702 * z))


def llama_with_geglu(emb_size, hidden_dim, bias, dropout):
    """A SwiGLU checkpoint run through a GeGLU module."""
    return GeGLU(emb_size, dropout, hidden_dim, bias)


def llama_four_d(emb_size, hidden_dim, bias, dropout):
    """d_ff left at the 4*d default instead of the checkpoint's intermediate_size."""
    return SwiGLU(emb_size, dropout, None, bias)


def gemma_doubled_dff(emb_size, hidden_dim, bias, dropout):
    """Gemma's published d_ff (gate + up summed) used per matrix."""
    return GeGLU(emb_size, dropout, 2 * hidden_dim, bias)


def llama_no_bias(emb_size, hidden_dim, bias, dropout):
    """mlp_bias checkpoint, module built without biases."""
    return SwiGLU(emb_size, dropout, hidden_dim, False)


class _Classic(nn.Module):
    def __init__(self, emb_size, act, bias2=True, hidden=None):
        super().__init__()
        hidden = hidden or 4 * emb_size
        self._layer1 = nn.Linear(emb_size, hidden)
        self._layer2 = nn.Linear(hidden, emb_size, bias=bias2)
        self._act = act

    def forward(self, x):
        return self._layer2(self._act(self._layer1(x)))


def gpt2_quick_gelu(emb_size, activation, dropout):
    return _Classic(emb_size, lambda z: z * torch.sigmoid(1.702 * z))


def gpt2_silu(emb_size, activation, dropout):
    return _Classic(emb_size, nn.SiLU())


def gpt2_no_output_bias(emb_size, activation, dropout):
    return _Classic(emb_size, nn.GELU(approximate="tanh"), bias2=False)


def gpt2_square(emb_size, activation, dropout):
    """For a checkpoint with n_inner = n_embd (square c_fc): tanh GELU, d_ff = d."""
    return _Classic(emb_size, nn.GELU(approximate="tanh"), hidden=emb_size)


def gpt2_exact_dropout(emb_size, activation, dropout):
    """Dropout that ignores eval()."""
    module = FeedForward(emb_size, 0.0, "gelu_tanh")
    module._dropout = _AlwaysDropout(0.1)
    return module


def gemma_dropout(emb_size, hidden_dim, bias, dropout):
    module = GeGLU(emb_size, 0.0, hidden_dim, bias)
    module._dropout = _AlwaysDropout(0.2)
    return module


class _AlwaysDropout(nn.Dropout):
    def forward(self, x):
        return nn.functional.dropout(x, self.p, training=True)


def gpt2_exact_gelu_module(emb_size, activation, dropout):
    """The correct module for a checkpoint trained with exact GELU."""
    return FeedForward(emb_size, dropout, "gelu")


class _Bf16MatmulLinear(nn.Linear):
    """Matmul in bfloat16, bias added in float32: outputs are not bfloat16 values."""

    def forward(self, x):
        return nn.functional.linear(x.bfloat16(), self.weight.bfloat16()).float() + self.bias


def gpt2_bf16_matmul(emb_size, activation, dropout):
    module = FeedForward(emb_size, dropout, activation)
    module._layer1 = _Bf16MatmulLinear(emb_size, 4 * emb_size)
    module._layer2 = _Bf16MatmulLinear(4 * emb_size, emb_size)
    return module
