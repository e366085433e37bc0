"""The frameworks a target may be written in, registered in one place (as checkpoint formats are in
``parity.sources``).  The framework is found from what --target names: a class or instance deriving from a
framework's module base, a NumPy function (its first parameter the input), a class holding NumPy arrays and called
on the input, an ``.onnx`` path.  A module of a framework parity does not serve (flax.linen, tinygrad, Keras, ...)
is named by its framework in the refusal (``parity.targets.unserved``).  PyTorch modules
are parity's own kind (``native``: no adapter); every other framework's target is put behind a torch module by
``parity.targets.proxy`` and checked by the same engine.

Registering one more framework is one class (``parity.targets.base.Framework``) and one line here.
"""

from __future__ import annotations

from typing import Any

from parity.targets.base import CheckpointFacts, Framework
from parity.targets.mlx import MLX
from parity.targets.nnx import FlaxNNX
from parity.targets.numpy_class import NumPyClass
from parity.targets.numpy_function import NumPyFunction
from parity.targets.onnx_graph import ONNXGraph
from parity.targets.pytorch import PyTorch
from parity.targets.unserved import unserved

FRAMEWORKS: tuple[Framework, ...] = (PyTorch(), MLX(), FlaxNNX(), ONNXGraph(), NumPyFunction(), NumPyClass())


def framework_of(obj: Any) -> Framework | None:
    """The registered framework ``obj`` (a class, an instance, a function or a path) belongs to; None for anything
    else (a factory function: what it returns says)."""
    return next((framework for framework in FRAMEWORKS if framework.owns(obj)), None)


def framework_importing(module: str | None) -> Framework | None:
    """The framework whose package ``module`` (a missing import's name, "mlx.nn") belongs to."""
    top = (module or "").partition(".")[0]
    return next((f for f in FRAMEWORKS if any(m.partition(".")[0] == top for m in f.imports)), None) if top else None


def distribution_of(name: str) -> str:
    """The package whose version a report gives for the framework ``name`` ("onnx" -> "onnxruntime")."""
    return next((f.distribution for f in FRAMEWORKS if f.name == name), name)


def foreign(framework: Framework, native: Any, facts: CheckpointFacts | None):
    """``native`` behind a torch module (the framework imported first, or exit 2 naming its extra)."""
    from parity.targets.proxy import ForeignModule

    framework.require()
    return ForeignModule(framework, native, facts)


__all__ = ["FRAMEWORKS", "CheckpointFacts", "Framework", "distribution_of", "foreign", "framework_importing",
           "framework_of", "unserved"]
