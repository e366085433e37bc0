"""MLX targets (``mlx.nn.Module``): the ports that run the hub's checkpoints on Apple hardware.

An MLX module is a dict of parameters: ``tree_flatten(module.parameters())`` gives the dotted names
(``layers.0.weight``), ``load_weights(pairs, strict=True)`` sets them.  ``mlx.nn.Linear`` stores its weight
[out, in], as torch does.  Computation is lazy: ``mx.eval`` forces it.  ``mx.array`` of a float64 NumPy array
silently becomes float32 unless the dtype is passed, so every conversion here names its dtype; bfloat16 arrays
do not convert to NumPy and go through float32 (exact).  MLX arrays are immutable: a target cannot change its
input.  On Linux MLX runs on the CPU (the ``mlx-cpu`` build).
"""

from __future__ import annotations

from typing import Any

import torch

from parity.targets.base import CheckpointFacts, ForeignParameter, Framework, to_numpy, torch_dtype


class MLX(Framework):
    name = "mlx"
    modules = ("mlx.",)
    imports = ("mlx.core", "mlx.nn")
    distribution = "mlx"
    extra = "mlx"
    immutable_arrays = True

    def float32(self) -> Any:
        import mlx.core as mx

        return mx.float32

    def parameters(self, native: Any, facts: CheckpointFacts | None) -> list[ForeignParameter]:
        import mlx.nn
        from mlx.utils import tree_flatten

        owners = dict(native.named_modules())
        found = []
        for name, array in tree_flatten(native.parameters()):
            owner = owners.get(name.rpartition(".")[0])
            layout = "out_in" if isinstance(owner, mlx.nn.Linear) else None
            found.append(ForeignParameter(name, tuple(array.shape), torch_dtype(_dtype_name(array.dtype)),
                                          type(owner).__name__ if owner is not None else "", layout))
        return found

    def load(self, native: Any, values: dict[str, torch.Tensor]) -> None:
        import mlx.core as mx

        native.load_weights([(name, _array(mx, value)) for name, value in values.items()], strict=True)
        mx.eval(native.parameters())

    def call(self, native: Any, x: torch.Tensor) -> torch.Tensor:
        import mlx.core as mx
        import numpy as np

        out = native(_array(mx, x))
        if isinstance(out, tuple) and out:
            out = out[0]
        if not isinstance(out, mx.array):
            raise TypeError(f"__call__ returned {type(out).__name__}, not an mlx.core.array")
        mx.eval(out)
        if not mx.issubdtype(out.dtype, mx.floating):
            raise TypeError(f"__call__ returned an array of {out.dtype}; an FFN returns floating-point hidden states")
        wide = out if out.dtype in (mx.float32, mx.float64) else out.astype(mx.float32)
        return torch.from_numpy(np.array(wide))

    def set_training(self, native: Any, mode: bool) -> None:
        native.train(mode)


def _dtype_name(dtype: Any) -> str:
    return str(dtype).rpartition(".")[2]  # mlx.core.bfloat16 -> bfloat16


def _array(mx: Any, tensor: torch.Tensor) -> Any:
    """A torch tensor as an MLX array of the same dtype, exactly (bfloat16 through float32)."""
    dtype = getattr(mx, str(tensor.dtype).removeprefix("torch."))
    return mx.array(to_numpy(tensor), dtype=mx.float32 if dtype == mx.bfloat16 else dtype).astype(dtype)
