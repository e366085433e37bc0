"""Module classes of frameworks parity does not serve, named for what they are.

A class deriving from flax.linen's ``Module``, a tinygrad, Keras, TensorFlow, PaddlePaddle, Haiku, Equinox or
MindSpore one is refused with its framework's name and the way to a framework parity serves, decided by the
module names in its MRO (and, for an instance, its attributes' types: a tinygrad model is a plain class holding
``tinygrad.Tensor``s).  Nothing is imported to ask.
"""

from __future__ import annotations

import inspect
from typing import Any

# module prefix -> (what it is, what to do instead).  Longest prefixes first: flax.linen before flax.
UNSERVED: tuple[tuple[str, str, str], ...] = (
    ("flax.linen", "a flax.linen module",
     "port it to flax.nnx (flax's nnx.bridge converts linen modules), which parity checks, or export it to ONNX"),
    ("tinygrad", "a tinygrad module",
     "export it to ONNX, or port the FFN to PyTorch, MLX, flax.nnx or a NumPy function"),
    ("keras", "a Keras layer", "export it to ONNX (tf2onnx), or port the FFN to PyTorch, flax.nnx or NumPy"),
    ("tf_keras", "a Keras layer", "export it to ONNX (tf2onnx), or port the FFN to PyTorch, flax.nnx or NumPy"),
    ("tensorflow", "a TensorFlow module", "export it to ONNX (tf2onnx), or port the FFN to PyTorch or NumPy"),
    ("paddle", "a PaddlePaddle layer", "export it to ONNX (paddle2onnx), or port the FFN to PyTorch or NumPy"),
    ("haiku", "a Haiku module", "port it to flax.nnx or a NumPy function"),
    ("equinox", "an Equinox module", "port it to flax.nnx or a NumPy function, or export it to ONNX"),
    ("mindspore", "a MindSpore cell", "export it to ONNX, or port the FFN to PyTorch or NumPy"),
)


def _framework_of_module(module: str) -> tuple[str, str] | None:
    for prefix, what, instead in UNSERVED:
        if module == prefix or module.startswith(prefix + "."):
            return what, instead
    return None


def unserved(obj: Any) -> str | None:
    """For a class (or instance) of a framework parity does not serve: 'is a flax.linen module (it derives from
    flax.linen.module.Module); flax.linen modules are not served: port it to ...'.  None otherwise."""
    cls = obj if inspect.isclass(obj) else type(obj)
    for base in getattr(cls, "__mro__", ()):
        found = _framework_of_module(getattr(base, "__module__", "") or "")
        if found is not None:
            what, instead = found
            return (f"is {what} (it derives from {base.__module__}.{base.__qualname__}); "
                    f"{what.partition(' ')[2]}s are not served: {instead}")
    if inspect.isclass(obj):
        return None
    for key, value in (vars(obj).items() if hasattr(obj, "__dict__") else ()):
        found = _framework_of_module(type(value).__module__ or "")
        if found is not None:
            what, instead = found
            kind = what.partition(" ")[2].split()[0]
            return (f"holds {type(value).__module__}.{type(value).__qualname__} in its attribute '{key}': it is "
                    f"{kind} code, which parity does not serve: {instead}")
    return None
