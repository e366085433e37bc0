"""Flax NNX FFNs written for this project in the style of NNX ports (config objects, keyword-only rngs,
kernels [in, out]), correct and broken, for tests/test_frameworks.py.  Importing this module needs flax."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx


class GPT2MLP(nnx.Module):
    def __init__(self, config, *, rngs: nnx.Rngs):
        self.c_fc = nnx.Linear(config.n_embd, 4 * config.n_embd, rngs=rngs)
        self.c_proj = nnx.Linear(4 * config.n_embd, config.n_embd, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        return self.dropout(self.c_proj(jax.nn.gelu(self.c_fc(x))))  # jax.nn.gelu: the tanh form by default


class MLP(nnx.Module):
    def __init__(self, config, *, rngs: nnx.Rngs):
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = nnx.Linear(d, f, use_bias=False, rngs=rngs)
        self.up_proj = nnx.Linear(d, f, use_bias=False, rngs=rngs)
        self.down_proj = nnx.Linear(f, d, use_bias=False, rngs=rngs)

    def activation(self, x):
        return jax.nn.silu(x)

    def __call__(self, x):
        return self.down_proj(self.activation(self.gate_proj(x)) * self.up_proj(x))


class GemmaMLP(MLP):
    def activation(self, x):
        return jax.nn.gelu(x, approximate=True)


class ExactGeluGPT2MLP(GPT2MLP):
    def __call__(self, x):
        return self.c_proj(jax.nn.gelu(self.c_fc(x), approximate=False))


class SwappedMLP(MLP):
    def __call__(self, x):
        return self.down_proj(self.activation(self.up_proj(x)) * self.gate_proj(x))


class DropoutOnGPT2MLP(GPT2MLP):
    def __call__(self, x):
        return self.dropout(self.c_proj(jax.nn.gelu(self.c_fc(x))), deterministic=False)


class BareKernelMLP(nnx.Module):
    """Kernels as bare parameters, [in, out], computing x @ W."""

    def __init__(self, config, *, rngs: nnx.Rngs):
        d, f = config.hidden_size, config.intermediate_size
        self.W_gate = nnx.Param(jnp.zeros((d, f)))
        self.W_in = nnx.Param(jnp.zeros((d, f)))
        self.W_out = nnx.Param(jnp.zeros((f, d)))

    def __call__(self, x):
        return (jax.nn.silu(x @ self.W_gate[...]) * (x @ self.W_in[...])) @ self.W_out[...]


def instance(hidden: int, width: int) -> MLP:
    class Config:
        hidden_size, intermediate_size = hidden, width

    return MLP(Config(), rngs=nnx.Rngs(3))


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
    """In the style of flax's examples/gemma: a sharding config whose defaults mean no sharding."""

    ffw_weight_df: tuple | None = None
    ffw_weight_fd: tuple | None = None


class FeedForward(nnx.Module):
    """In the style of flax's examples/gemma FeedForward: plain sizes, keyword-only rngs and a required config of
    the project's own, framework objects as defaults."""

    def __init__(self, features: int, hidden_dim: int, *, rngs: nnx.Rngs, shd_config: ShardingConfig,
                 dtype: jnp.dtype = jnp.float32, dropout_rate: float = 0.0):
        self.gate_proj = nnx.Linear(features, hidden_dim, use_bias=False, rngs=rngs, dtype=dtype)
        self.up_proj = nnx.Linear(features, hidden_dim, use_bias=False, rngs=rngs, dtype=dtype)
        self.down_proj = nnx.Linear(hidden_dim, features, use_bias=False, rngs=rngs, dtype=dtype)
        self.sharding = shd_config

    def __call__(self, x):
        return self.down_proj(jax.nn.gelu(self.gate_proj(x)) * self.up_proj(x))
