"""What a framework other than PyTorch provides to be checked like a PyTorch module.

Nothing in parity's judgement is PyTorch-specific: the truth is transformers' MLP in float64, the verdict
compares output arrays, the diagnoses replay mistakes on transformers' MLP.  Only building, listing, filling
and running the target are the framework's, and those are the methods here.  ``parity.targets.proxy`` puts a
framework's module behind a torch ``nn.Module`` whose parameters mirror the framework's by name, shape and
dtype, so routes, fill, the two runs, the verdict and every view are the ones a PyTorch target gets.

A framework module imports its framework only inside these methods: a PyTorch check imports none of them.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from dataclasses import dataclass
from typing import Any

import torch

from parity.definitions.distribution import install_command
from parity.errors import TargetError

# What a NumPy target's input parameter is named: the first parameter of a function, or of a class's __call__
INPUT_NAMES = ("x", "inp", "input", "inputs", "hidden_states", "h")


@dataclass(frozen=True)
class ForeignParameter:
    """One parameter of a framework's module: its dotted name in the framework's own spelling (``fc.kernel``,
    ``layers.0.weight``), shape and dtype (as torch names it), the class of the layer holding it, and how that
    layer stores its weight (``out_in`` as nn.Linear and mlx.nn.Linear, ``in_out`` as flax.nnx.Linear's kernel
    and NumPy's ``x @ w``; None where the layer does not say)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    owner: str = ""
    layout: str | None = None


@dataclass(frozen=True)
class CheckpointFacts:
    """What a target with no parameters of its own to list (a NumPy function) is sized from: the checkpoint's
    d, d_ff and whether its FFN has biases."""

    hidden: int
    width: int
    bias: bool


class Framework:
    """One framework a target may be written in.  Subclasses set the class attributes and override what their
    framework does differently; ``parity.targets.FRAMEWORKS`` registers them."""

    name = ""  # as reports name it: "mlx", "flax.nnx", "numpy", "onnx"
    modules: tuple[str, ...] = ()  # the framework's own module prefixes: a class deriving from one is its module
    imports: tuple[str, ...] = ()  # what must import for a target of it to run
    distribution = ""  # the package whose version the report gives
    extra: str | None = None  # parity's extra for it (pyproject.toml), whose requirements a message names
    immutable_arrays = False  # the target cannot change its input: input mutation is not checked, and said so
    dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")  # what --dtype it computes in
    fills = True  # False: its weights are inside it (an ONNX graph): parity checks them instead of filling
    native = False  # True for PyTorch only: the engine's own kind, checked without a proxy
    extra_spelling: dict[str, str] = {}  # constructor_extras as a factory parity prints writes them
    computes_with: tuple[str, ...] = ()  # the packages that compute for it, whose versions the report gives too

    def versions(self) -> dict[str, str]:
        """The framework's package version, and those of the packages it computes with (Flax NNX: jax, jaxlib)."""
        found = {self.distribution: self.version()}
        for package in self.computes_with:
            try:
                found[package] = importlib.metadata.version(package)
            except importlib.metadata.PackageNotFoundError:
                continue
        return found

    # -- which objects are its own ---------------------------------------------------------------------------
    def owns(self, obj: Any) -> bool:
        """A class (or an instance of one) deriving from the framework's module base, found by module name:
        nothing is imported to ask."""
        cls = obj if inspect.isclass(obj) else type(obj)
        return any(getattr(c, "__module__", "").startswith(self.modules) for c in getattr(cls, "__mro__", ()))

    def require(self) -> None:
        """Import the framework, or a TargetError naming the extra that installs it (exit 2)."""
        for module in self.imports:
            try:
                importlib.import_module(module)
            except ImportError as exc:
                install = self.install_command()
                raise TargetError(f"the target is a {self.name} module, but {module} cannot be imported here "
                                  f"({exc}); install it with {install}") from None

    def install_command(self) -> str:
        """What installs it: the packages parity's extra for it names (never parity's own name, which is someone
        else's on the public index), or the framework's own distribution."""
        if self.extra is None:
            return f"pip install {self.distribution}"
        return install_command(self.extra, fallback=self.distribution)

    def label(self) -> str:
        """'mlx 0.32.4'; 'onnx (onnxruntime 1.32.0)' where the package is not the framework's name."""
        if self.distribution == self.name:
            return f"{self.name} {self.version()}"
        return f"{self.name} ({self.distribution} {self.version()})"

    def version(self) -> str:
        try:
            return importlib.metadata.version(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            return "?"

    # -- building --------------------------------------------------------------------------------------------
    def float32(self) -> Any:
        """The framework's float32, which a config's ``dtype`` answers when parity builds its module (None:
        torch's)."""
        return None

    def constructor_extras(self, parameters: dict[str, inspect.Parameter]) -> dict[str, Any]:
        """Arguments the framework's constructors take that no config answers (Flax NNX's ``rngs``)."""
        return {}

    def projection(self, in_features: int, out_features: int, bias: bool) -> Any:
        """What a constructor that takes a projection itself is given (torchtune's ``FeedForward(gate_proj=...)``,
        llama3.np's ``FeedForward(up_weight, ...)``), sized from the checkpoint; None: a torch nn.Linear."""
        return None

    def open(self, obj: Any) -> Any:
        """The target for what --target named, where nothing is constructed (a NumPy function, an ONNX file)."""
        raise NotImplementedError

    def copy(self, native: Any) -> Any:
        """An instance given to ``parity.check`` is never modified: parity fills and runs a copy of it."""
        import copy

        return copy.deepcopy(native)

    # -- what the engine asks of every target ----------------------------------------------------------------
    def parameters(self, native: Any, facts: CheckpointFacts | None) -> list[ForeignParameter]:
        raise NotImplementedError

    def load(self, native: Any, values: dict[str, torch.Tensor]) -> None:
        """Set each parameter (by its dotted name) to ``values[name]``, exactly, in the value's dtype."""
        raise NotImplementedError

    def call(self, native: Any, x: torch.Tensor) -> torch.Tensor:
        """Run on ``x`` (parity's inputs, in the target's dtype) and hand the output back as a CPU tensor."""
        raise NotImplementedError

    def set_training(self, native: Any, mode: bool) -> None:
        """parity runs a target in eval mode (dropout off), as it does a PyTorch module."""

    def verify(self, native: Any, tensors: dict[str, torch.Tensor]) -> tuple[list[str], bool]:
        """For a framework that does not fill (``fills = False``): notes saying which of its own weights are
        ``tensors`` (a checkpoint layer's), and whether they are exactly those."""
        return [], False


def torch_dtype(name: str) -> torch.dtype:
    """'float32', 'bfloat16', ... (a framework's dtype name) -> the torch dtype; TargetError for another."""
    found = getattr(torch, str(name), None)
    if not isinstance(found, torch.dtype):
        raise TargetError(f"a target parameter has dtype {name}, which parity cannot compare")
    return found


def to_numpy(tensor: torch.Tensor) -> Any:
    """A CPU tensor as a NumPy array in its own precision; bfloat16, which NumPy lacks, as float32 (every
    bfloat16 value is exactly a float32 one): the framework casts it back to its own bfloat16."""
    tensor = tensor.detach().cpu()
    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()


def numpy_output(out: Any, what: str = "") -> torch.Tensor:
    """What a NumPy target returned as a CPU tensor: a floating array (a tuple's first element); TypeError else."""
    import numpy as np

    said = f"{what} returned" if what else "returned"
    if isinstance(out, tuple) and out:
        out = out[0]
    if not isinstance(out, np.ndarray):
        raise TypeError(f"{said} {type(out).__name__}, not a numpy.ndarray")
    if out.dtype.kind != "f":
        raise TypeError(f"{said} an array of {out.dtype}; an FFN returns floating-point hidden states")
    return torch.from_numpy(np.array(out))
