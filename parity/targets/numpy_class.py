"""NumPy class targets: a class that holds its weights as NumPy arrays in attributes and is called on the input
(llama3.np's ``FeedForward(up_weight, gate_weight, down_weight)`` with ``__call__(self, x)``).

Which classes: a plain Python class whose ``__call__`` is Python code taking the input first (named as a NumPy
function's is: ``INPUT_NAMES``), deriving from no framework's module (those are their frameworks', served or
named as not served: ``parity.targets.unserved``).

Built by its constructor as a PyTorch class is (``parity.engine.check.arguments``): sizes bound by parameter name
(``FeedForward(dim, hidden_dim)``), a config, a factory, a mapping's args; a constructor that takes the
projections themselves (llama3.np) gets a zero array per projection in the checkpoint's layout [out, in], which
it may transpose as llama3.np does: the attributes it keeps are what parity fills.

Its parameters are its floating NumPy-array attributes, under the attribute's name (``up_weight``), dicts' and
nested objects' under dotted names (``c_fc.w``, ``ffn.w1``): routes come from those names as from a NumPy
function's parameter names.  Each weight's layout is read off its shape against the checkpoint's d and d_ff
([d, d_ff] for a projection reading d is [in, out], for ``x @ w``); where the shape cannot tell (d = d_ff), NumPy's
``x @ w`` convention.  Parity declares them float32 (the run's dtype), whatever the constructor made them (NumPy's
random arrays are float64), and fills them as read-only arrays, so a class that writes into a weight fails naming
its line.  The input is the class's own copy, as for a NumPy function.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch

from parity.errors import TargetError
from parity.targets.base import INPUT_NAMES, CheckpointFacts, ForeignParameter, Framework, numpy_output, to_numpy

DEPTH = 3  # how deep attributes are searched for arrays: ffn.c_fc.w


class NumPyClass(Framework):
    name = "numpy"
    imports = ("numpy",)
    distribution = "numpy"
    dtypes = ("float32", "float16")

    def owns(self, obj: Any) -> bool:
        """A Python class (or an instance of one) with a Python ``__call__`` whose first parameter is the input,
        deriving from no framework's module."""
        from parity.targets.unserved import unserved

        if inspect.isfunction(obj) or inspect.ismethod(obj) or inspect.ismodule(obj):
            return False
        cls = obj if inspect.isclass(obj) else type(obj)
        if cls.__module__ == "builtins" or unserved(cls) is not None:
            return False
        call = next((vars(c)["__call__"] for c in cls.__mro__ if "__call__" in vars(c)), None)
        if not inspect.isfunction(call):
            return False
        try:
            names = list(inspect.signature(call).parameters)[1:]
        except (TypeError, ValueError):
            return False
        return bool(names) and names[0] in INPUT_NAMES

    def projection(self, in_features: int, out_features: int, bias: bool) -> Any:
        """What a constructor taking a projection itself gets: its weight in the checkpoint's layout, [out, in]
        (llama3.np transposes it), or picoGPT's ``{"w": [in, out], "b": [out]}`` where the FFN has biases."""
        import numpy as np

        if bias:
            return {"w": np.zeros((in_features, out_features), np.float32), "b": np.zeros(out_features, np.float32)}
        return np.zeros((out_features, in_features), np.float32)

    def copy(self, native: Any) -> Any:
        return copy.deepcopy(native)

    def parameters(self, native: Any, facts: CheckpointFacts | None) -> list[ForeignParameter]:
        from parity.targets.unserved import unserved

        found = arrays(native)
        said = None if found else unserved(native)
        if said is not None:
            raise TargetError(f"target {type(native).__qualname__} {said}")
        if not found:
            raise TargetError(f"NumPy class target {type(native).__qualname__}: it holds no floating NumPy array in "
                              f"its attributes ({attribute_kinds(native)}); parity fills a class's weights by "
                              "attribute name, as NumPy arrays (self.up_weight = ...)")
        return [ForeignParameter(name, tuple(array.shape), torch.float32, "dict" if "." in name else "",
                                 layout(name, tuple(array.shape), facts)) for name, array in found]

    def load(self, native: Any, values: dict[str, torch.Tensor]) -> None:
        for name, tensor in values.items():
            array = to_numpy(tensor)
            array.flags.writeable = False
            *path, leaf = name.split(".")
            holder = native
            for part in path:
                holder = holder[part] if isinstance(holder, dict) else getattr(holder, part)
            if isinstance(holder, dict):
                holder[leaf] = array
            else:
                setattr(holder, leaf, array)

    def call(self, native: Any, x: torch.Tensor) -> torch.Tensor:
        return numpy_output(native(x.numpy()), "__call__")  # x: the target's own copy, seen if changed in place


def arrays(obj: Any, prefix: str = "", depth: int = 0) -> list[tuple[str, Any]]:
    """(dotted name, array) of every floating NumPy array among ``obj``'s attributes (a dict's items), searched
    into dicts and plain objects up to DEPTH."""
    import numpy as np

    items = obj.items() if isinstance(obj, dict) else vars(obj).items() if hasattr(obj, "__dict__") else ()
    found = []
    for key, value in items:
        if not isinstance(key, str) or key.startswith("__") or "." in key:
            continue
        if isinstance(value, np.ndarray):
            if value.dtype.kind == "f" and value.ndim >= 1:
                found.append((prefix + key, value))
        elif depth < DEPTH and _container(value):
            found += arrays(value, f"{prefix}{key}.", depth + 1)
    return found


def _container(value: Any) -> bool:
    """A dict or an instance of a plain Python class: where a port keeps a projection's arrays."""
    if isinstance(value, dict):
        return True
    return (hasattr(value, "__dict__") and not inspect.isclass(value) and not inspect.isroutine(value)
            and not inspect.ismodule(value) and type(value).__module__ != "builtins")


def layout(name: str, shape: tuple[int, ...], facts: CheckpointFacts | None) -> str:
    """'out_in' where the weight's shape is its role's [out, in] and not [in, out] (a class that keeps the
    checkpoint's layout and computes x @ w.T); else 'in_out', NumPy's x @ w."""
    from parity.definitions.aliases import load_aliases

    if facts is None or len(shape) != 2:
        return "in_out"
    aliases = load_aliases()
    roles = {aliases.roles[role] for role, kind in aliases.roles_of(name) if kind == "weight"}
    sides = {(role.side, bool(role.fuses)) for role in roles}
    if len(sides) != 1:
        return "in_out"
    side, fused = sides.pop()
    width = facts.width * (2 if fused else 1)
    in_out = (facts.hidden, width) if side == "in" else (width, facts.hidden)
    return "out_in" if shape == in_out[::-1] and shape != in_out else "in_out"


def attribute_kinds(native: Any) -> str:
    """'up: tinygrad.tensor.Tensor, n: int': what a class holds instead of NumPy arrays."""
    items = vars(native).items() if hasattr(native, "__dict__") else ()
    shown = [f"{key}: {type(value).__module__}.{type(value).__qualname__}".replace("builtins.", "")
             for key, value in items if not key.startswith("__")]
    return ", ".join(shown[:8]) + (", ..." if len(shown) > 8 else "") if shown else "none"
