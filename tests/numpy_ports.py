"""NumPy FFN functions written for this project in the style of NumPy ports (picoGPT's parameter dicts,
x @ w), correct and broken, for tests/test_frameworks.py."""

from __future__ import annotations

import math

import numpy as np


def gelu(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def linear(x, w, b):
    return x @ w + b


def ffn(x, c_fc, c_proj):
    return linear(gelu(linear(x, **c_fc)), **c_proj)


def silu(x):
    return x / (1 + np.exp(-x))


def swiglu(x, gate_proj, up_proj, down_proj):
    return (silu(x @ gate_proj) * (x @ up_proj)) @ down_proj


def geglu(x, w1, w2, w3):
    return (gelu(x @ w1) * (x @ w3)) @ w2


_erf = np.vectorize(math.erf)


def ffn_exact_gelu(x, c_fc, c_proj):
    h = linear(x, **c_fc)
    return linear(0.5 * h * (1 + _erf(h / math.sqrt(2))), **c_proj)


def swiglu_swapped(x, gate_proj, up_proj, down_proj):
    return (silu(x @ up_proj) * (x @ gate_proj)) @ down_proj


def swiglu_writes_its_weight(x, gate_proj, up_proj, down_proj):
    gate_proj *= 1.0
    return swiglu(x, gate_proj, up_proj, down_proj)


def ffn_of_params(x, params):
    return x @ params


def ffn_returns_zeros(x, c_fc, c_proj):
    return np.zeros_like(x)


def ffn_returns_integers(x, c_fc, c_proj):
    return np.rint(ffn(x, c_fc, c_proj)).astype(np.int64)


def ffn_first_named_inp(inp, c_fc, c_proj):
    return ffn(inp, c_fc, c_proj)


_SPOKEN = []


def swiglu_chatty(x, gate_proj, up_proj, down_proj):
    """A correct SwiGLU that prints as debugging ports do: 10 MB once through print, a line through fd 1 on every
    call (os.write, as a C extension's printf does): none of it may reach a stdout that carries a report."""
    import os

    if not _SPOKEN:
        _SPOKEN.append(True)
        print("debug " * (10 * 1024 * 1024 // 6))
    os.write(1, b"CHATTY-FD1 written by the target\n")
    print("CHATTY-PRINT from the target")
    return swiglu(x, gate_proj, up_proj, down_proj)


# -- classes holding their weights as NumPy arrays, called on the input ---------------------------------------------

class FeedForward:
    """likejazz/llama3.np's FeedForward, written for this project in its style: the constructor takes the
    checkpoint's [out, in] weights and keeps them transposed, for x @ w."""

    def __init__(self, up_weight, gate_weight, down_weight):
        self.up_weight = up_weight.T
        self.gate_weight = gate_weight.T
        self.down_weight = down_weight.T

    def __call__(self, x):
        swish = silu(x @ self.gate_weight)
        x_V = x @ self.up_weight
        return (swish * x_V) @ self.down_weight


class FeedForwardSwapped(FeedForward):
    """gate and up exchanged in __call__: the port's classic bug."""

    def __call__(self, x):
        return (silu(x @ self.up_weight) * (x @ self.gate_weight)) @ self.down_weight


class SizedFeedForward:
    """A constructor of sizes that creates its arrays (random, float64, as NumPy makes them); weights [in, out]."""

    def __init__(self, dim, hidden_dim):
        rng = np.random.default_rng(0)
        self.w1 = rng.standard_normal((dim, hidden_dim))
        self.w3 = rng.standard_normal((dim, hidden_dim))
        self.w2 = rng.standard_normal((hidden_dim, dim))

    def __call__(self, x):
        return (silu(x @ self.w1) * (x @ self.w3)) @ self.w2


class GPT2Block:
    """picoGPT's parameter dicts kept as attributes: self.c_fc = {"w": [d, d_ff], "b": [d_ff]}."""

    def __init__(self, n_embd):
        self.c_fc = {"w": np.zeros((n_embd, 4 * n_embd), np.float32), "b": np.zeros(4 * n_embd, np.float32)}
        self.c_proj = {"w": np.zeros((4 * n_embd, n_embd), np.float32), "b": np.zeros(n_embd, np.float32)}

    def __call__(self, x):
        return ffn(x, self.c_fc, self.c_proj)


def make_llama3np(config):
    """A factory returning the class built with the checkpoint's own sizes."""
    d, d_ff = config.hidden_size, config.intermediate_size
    return FeedForward(np.zeros((d_ff, d)), np.zeros((d_ff, d)), np.zeros((d, d_ff)))
