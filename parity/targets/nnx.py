"""Flax NNX targets (``flax.nnx.Module``): the ports that train the hub's checkpoints on TPUs.

Parameters are ``nnx.Param`` variables: ``nnx.state(module, nnx.Param)`` flattened gives their paths
(``('layers', 0, 'kernel')`` is ``layers.0.kernel`` here), and ``nnx.update`` sets them.  ``nnx.Linear``
stores its ``kernel`` [in, out]: the routes transpose a checkpoint's [out, in] weights for it, and
``missing_transpose`` names a kernel filled the other way.  Constructors take a keyword-only ``rngs``:
parity passes ``nnx.Rngs(0)`` (the values it draws are overwritten by the fill; a dropout's stream stays
seeded).  ``jax.nn.gelu`` defaults to the tanh form.

float64: JAX computes in float64 only under ``jax_enable_x64``, a process-wide flag that must be set before
any array exists.  parity never sets it (in a user's own process it would change every other JAX computation):
an NNX target computes in float32 (or the --dtype asked), as its users run it, and is judged against the float64
truth like any float32 target.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from parity.targets.base import CheckpointFacts, ForeignParameter, Framework, to_numpy, torch_dtype


class FlaxNNX(Framework):
    name = "flax.nnx"
    modules = ("flax.nnx",)
    imports = ("jax", "flax.nnx")
    distribution = "flax"
    extra = "jax"
    immutable_arrays = True
    extra_spelling = {"rngs": "nnx.Rngs(0)"}
    computes_with = ("jax", "jaxlib")

    def float32(self) -> Any:
        import jax.numpy as jnp

        return jnp.float32

    def constructor_extras(self, parameters: dict[str, inspect.Parameter]) -> dict[str, Any]:
        from flax import nnx

        return {"rngs": nnx.Rngs(0)} if "rngs" in parameters else {}

    def copy(self, native: Any) -> Any:
        from flax import nnx

        return nnx.clone(native)

    def parameters(self, native: Any, facts: CheckpointFacts | None) -> list[ForeignParameter]:
        from flax import nnx

        found = []
        for path, variable in _flat(native):
            owner = _node(native, path[:-1])
            layout = "in_out" if isinstance(owner, nnx.Linear) else None
            value = variable.get_value()
            found.append(ForeignParameter(".".join(map(str, path)), tuple(value.shape), torch_dtype(str(value.dtype)),
                                          type(owner).__name__ if path[:-1] else "", layout))
        return found

    def load(self, native: Any, values: dict[str, torch.Tensor]) -> None:
        from flax import nnx

        state = nnx.state(native, nnx.Param)
        for path, variable in nnx.to_flat_state(state):
            variable.set_value(_array(values[".".join(map(str, path))]))
        nnx.update(native, state)

    def call(self, native: Any, x: torch.Tensor) -> torch.Tensor:
        import jax
        import jax.numpy as jnp
        import numpy as np

        out = native(_array(x))
        if isinstance(out, tuple) and out:
            out = out[0]
        if not isinstance(out, jax.Array):
            raise TypeError(f"__call__ returned {type(out).__name__}, not a jax.Array")
        if not jnp.issubdtype(out.dtype, jnp.floating):
            raise TypeError(f"__call__ returned an array of {out.dtype}; an FFN returns floating-point hidden states")
        wide = out if out.dtype in (jnp.float32, jnp.float64) else out.astype(jnp.float32)
        return torch.from_numpy(np.array(wide))

    def set_training(self, native: Any, mode: bool) -> None:
        native.train() if mode else native.eval()


def _flat(native: Any) -> list[tuple[tuple, Any]]:
    from flax import nnx

    return list(nnx.to_flat_state(nnx.state(native, nnx.Param)))


def _node(native: Any, path: tuple) -> Any:
    node = native
    for key in path:
        node = node[key] if isinstance(key, int) else getattr(node, key)
    return node


def _array(tensor: torch.Tensor) -> Any:
    """A torch tensor as a JAX array of the same dtype, exactly (bfloat16 through float32)."""
    import jax.numpy as jnp

    dtype = getattr(jnp, str(tensor.dtype).removeprefix("torch."))
    return jnp.asarray(to_numpy(tensor)).astype(dtype)
