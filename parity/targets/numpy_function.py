"""NumPy targets: a function that takes the input and the layer's weights by its own parameter names.

The signature parity documents (docs/frameworks.md)::

    def ffn(x, c_fc, c_proj): ...          # GPT-2 (picoGPT's style): c_fc = {"w": [d, d_ff], "b": [d_ff]}
    def ffn(x, w1, w2, w3): ...            # LLaMA, no biases: w1 = gate [d, d_ff], w3 = up, w2 = down [d_ff, d]

The first parameter is the input, [batch, seq, d] (``INPUT_NAMES``); every other parameter is one projection,
named as a module's parameter would be (``aliases.toml``: c_fc, gate_proj, w1, fc1, ...), so the same inference
routes the checkpoint into it.  A projection is an array when the checkpoint's FFN has no biases, else a dict
``{"w": weight, "b": bias}`` (the NumPy convention of picoGPT and of code that keeps TensorFlow checkpoints'
parameters).  Weights are given [in, out], for ``x @ w``.  Arrays are read-only (a function that writes into a
weight fails, naming its line); the input is the function's own copy, so an in-place change to it is seen, as
for a PyTorch module.  NumPy has no bfloat16: ``--dtype float16`` runs, ``bfloat16`` is refused.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch

from parity.errors import TargetError
from parity.targets.base import INPUT_NAMES, CheckpointFacts, ForeignParameter, Framework, numpy_output, to_numpy


class NumPyFunction(Framework):
    name = "numpy"
    imports = ("numpy",)
    distribution = "numpy"
    dtypes = ("float32", "float16")

    def owns(self, obj: Any) -> bool:
        """A plain function whose first parameter is the input and which takes more: a factory takes a config or
        sizes, whose names are none of ``INPUT_NAMES`` (``hidden``, a size in many factories, is not one)."""
        if not inspect.isfunction(obj):
            return False
        names = list(_parameters(obj))
        return len(names) >= 2 and names[0] in INPUT_NAMES

    def open(self, obj: Any) -> Any:
        return NumPyCall(obj)

    def parameters(self, native: Any, facts: CheckpointFacts | None) -> list[ForeignParameter]:
        from parity.definitions.aliases import load_aliases

        function = native.function
        if facts is None:
            raise TargetError(f"NumPy target {function.__qualname__}: the checkpoint's config states no d and d_ff "
                              "to size its weights from")
        aliases = load_aliases()
        found = []
        for name in list(_parameters(function))[1:]:
            roles = {aliases.roles[role] for role, kind in aliases.roles_of(name) if kind == "weight"}
            sides = {(role.side, bool(role.fuses)) for role in roles}
            if len(sides) != 1:
                known = "no projection" if not sides else "more than one projection"
                raise TargetError(
                    f"NumPy target {function.__qualname__}{inspect.signature(function)}: its parameter '{name}' "
                    f"names {known} ({aliases.path}); take each projection's weights as its own parameter, named "
                    "as a module's would be (def ffn(x, c_fc, c_proj) or def ffn(x, w1, w2, w3))")
            side, fused = sides.pop()
            width = facts.width * (2 if fused else 1)
            shape = (facts.hidden, width) if side == "in" else (facts.width, facts.hidden)
            if facts.bias:
                found.append(ForeignParameter(f"{name}.w", shape, torch.float32, "dict", "in_out"))
                found.append(ForeignParameter(f"{name}.b", (shape[1],), torch.float32, "dict", "in_out"))
            else:
                found.append(ForeignParameter(name, shape, torch.float32, "", "in_out"))
        return found

    def load(self, native: Any, values: dict[str, torch.Tensor]) -> None:
        native.weights = arguments(values)

    def call(self, native: Any, x: torch.Tensor) -> torch.Tensor:
        return numpy_output(native.function(x.numpy(), **native.weights))  # x: its own copy, seen if changed


@dataclass
class NumPyCall:
    """The function and the weights it is called with (read-only arrays, set by ``load``)."""

    function: Any
    weights: dict[str, Any] = field(default_factory=dict)


def _parameters(function: Any) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return {}


def arguments(values: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The mirror's tensors as the function's arguments: read-only arrays, ``{"w", "b"}`` dicts by dotted name."""
    given: dict[str, Any] = {}
    for name, tensor in values.items():
        array = to_numpy(tensor)
        array.flags.writeable = False
        owner, _, leaf = name.partition(".")
        if leaf:
            given.setdefault(owner, {})[leaf] = array
        else:
            given[owner] = array
    return given
