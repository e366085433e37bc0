"""ONNX targets: ``--target layer.onnx``, an exported FFN graph run with ONNX Runtime on the CPU.

The weights are inside the graph, so parity does not fill it (``fills = False``): it checks the graph's
initializers against the checkpoint layer's tensors instead, by shape and value, as stored or transposed
(torch's exporter folds transposes and renames initializers ``val_N``: names say nothing), and says which it
matched and which it could not.  Then the output is judged like any target's, so an export that baked another
layer, a swapped gate/up or the exact GELU is named by the same diagnoses.

An FFN is position-wise: each token's output depends on that token alone.  A graph exported with a fixed
input shape is run on parity's tokens in batches of its own token count (the last one padded), which computes
exactly what one call would.  The graph's input type is its compute dtype: float32 and float16 run on the CPU
provider; its bfloat16 MatMul does not.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from parity.definitions.files import shown
from parity.errors import TargetError, UsageError
from parity.targets.base import CheckpointFacts, ForeignParameter, Framework, to_numpy

# onnx TensorProto element types -> the dtype names parity uses


@dataclass
class Graph:
    path: Path
    session: Any
    input_name: str
    input_shape: list[int | None]  # None: a dynamic dimension
    dtype: str
    compute: str = "float32"  # the run's --dtype (set by the session)
    _initializers: list | None = None

    def initializers(self) -> list[tuple[str, Any]]:
        """(name, array) of every initializer, read from the file once."""
        if self._initializers is None:
            import onnx
            from onnx import numpy_helper

            model = onnx.load(str(self.path))
            self._initializers = [(i.name, numpy_helper.to_array(i)) for i in model.graph.initializer]
        return self._initializers


class ONNXGraph(Framework):
    name = "onnx"
    imports = ("onnxruntime", "onnx")
    distribution = "onnxruntime"
    extra = "onnx"
    immutable_arrays = True
    dtypes = ("float32", "float16")
    fills = False

    def __init__(self) -> None:
        self._opened: dict[tuple, Graph] = {}

    def owns(self, obj: Any) -> bool:
        return isinstance(obj, (str, Path)) and str(obj).lower().endswith(".onnx")

    def open(self, obj: Any) -> Graph:
        """The graph's session, made once per file as it is on disk (a check builds its target for every layer)."""
        path = Path(obj)
        if not path.is_file():
            raise TargetError(f"--target {shown(path)}: no such ONNX file")
        stat = path.stat()
        key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size)
        if key not in self._opened:
            self._opened.clear()  # one graph at a time: a session holds the graph's weights
            self._opened[key] = self._load(path)
        graph = self._opened[key]
        return dataclasses.replace(graph, compute="float32")

    def _load(self, path: Path) -> Graph:
        import onnxruntime

        try:
            session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        except Exception as exc:  # noqa: BLE001 - a graph ONNX Runtime refuses is the user's file to fix
            raise TargetError(f"--target {shown(path)}: ONNX Runtime cannot load it: {type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
        inputs = session.get_inputs()
        if len(inputs) != 1:
            raise TargetError(f"--target {shown(path)}: the graph takes {len(inputs)} inputs "
                              f"({', '.join(i.name for i in inputs)}); an FFN takes one, the hidden states")
        dtype = inputs[0].type.removeprefix("tensor(").removesuffix(")")
        dtype = {"float": "float32", "double": "float64"}.get(dtype, dtype)
        shape = [d if isinstance(d, int) and d > 0 else None for d in inputs[0].shape]
        return Graph(path, session, inputs[0].name, shape, dtype)

    def copy(self, native: Any) -> Any:
        return native

    def parameters(self, native: Any, facts: CheckpointFacts | None) -> list[ForeignParameter]:
        return []

    def load(self, native: Any, values: dict[str, torch.Tensor]) -> None:
        pass

    def call(self, native: Graph, x: torch.Tensor) -> torch.Tensor:
        import numpy as np

        where = shown(native.path)
        if native.dtype not in ("float32", "float16", "bfloat16"):
            raise TargetError(f"--target {where}: the graph's input '{native.input_name}' is {native.dtype}; parity "
                              "checks an FFN computing in float32, float16 or bfloat16: export it in float32")
        if native.dtype != native.compute:
            raise UsageError(f"--target {where}: the graph computes in {native.dtype} (its input "
                             f"'{native.input_name}' is {native.dtype}); run it with --dtype {native.dtype}")
        if native.dtype == "bfloat16":
            raise UsageError(f"--target {where}: ONNX Runtime's CPU provider has no bfloat16 MatMul; export the "
                             "graph in float32 or float16")
        d = x.shape[-1]
        if native.input_shape and native.input_shape[-1] not in (None, d):
            raise TargetError(f"--target {where}: the graph's input '{native.input_name}' has width "
                              f"{native.input_shape[-1]}, the checkpoint's hidden size is {d}")
        tokens = to_numpy(x).reshape(-1, d).astype(native.dtype)
        fixed = [n for n in native.input_shape[:-1]]
        if all(n is None for n in fixed):  # dynamic: parity's tokens in the graph's own rank ([N, d] or [B, T, d])
            feed = [tokens if len(native.input_shape) == 2 else tokens.reshape(x.shape)]
            shape = None
        else:  # fixed: batches of the graph's own token count, the last padded
            shape = [n or 1 for n in fixed] + [d]
            count = math.prod(shape[:-1])
            padded = np.zeros((math.ceil(len(tokens) / count) * count, d), dtype=tokens.dtype)
            padded[:len(tokens)] = tokens
            feed = [chunk.reshape(shape) for chunk in np.split(padded, len(padded) // count)]
        outputs = [native.session.run(None, {native.input_name: chunk})[0] for chunk in feed]
        pairs = zip(outputs, feed, strict=True)
        if any(np.ndim(o) < 1 or o.shape[-1] != d or o.size != chunk.size for o, chunk in pairs):
            shapes = sorted({str(list(np.shape(o))) for o in outputs})
            raise TargetError(f"--target {where}: the graph's first output has shape {', '.join(shapes)} for an "
                              f"input of shape {list(feed[0].shape)}; an FFN returns one of its input's shape")
        if np.asarray(outputs[0]).dtype.kind != "f":
            raise TargetError(f"--target {where}: the graph's first output is {outputs[0].dtype}; an FFN returns "
                              "floating-point hidden states")
        out = np.concatenate([o.reshape(-1, o.shape[-1]) for o in outputs])[:len(tokens)]
        return torch.from_numpy(out.astype(np.float64 if out.dtype == np.float64 else np.float32)).reshape(x.shape)

    def identify(self, native: Graph, tensors: dict[str, torch.Tensor]) -> Identified:
        """Each floating initializer of at least the smallest tensor's size (not a shape, an axis or a constant of
        the activation), identified with one of ``tensors`` by shape and value, as stored or transposed, at the
        graph's precision."""
        import numpy as np

        stored = {name: to_numpy(t).astype(np.float64) for name, t in tensors.items() if t.dim() in (1, 2)}
        smallest = min((t.size for t in stored.values()), default=2)
        found = Identified()
        for init_name, array in native.initializers():
            if array.dtype.kind != "f" or array.ndim not in (1, 2) or array.size < smallest:
                continue
            value = array.astype(np.float64)
            match = next(((name, how) for name, tensor in stored.items()
                          for how, candidate in (("as stored", tensor), ("transposed", tensor.T))
                          if candidate.shape == value.shape
                          and np.array_equal(candidate.astype(array.dtype).astype(np.float64), value)), None)
            if match:
                found.matched[init_name] = (list(array.shape), *match)
            else:
                found.unmatched[init_name] = list(array.shape)
        found.missing = sorted(set(stored) - {name for _, name, _ in found.matched.values()})
        return found

    def verify(self, native: Graph, tensors: dict[str, torch.Tensor]) -> tuple[list[str], bool]:
        found = self.identify(native, tensors)
        notes = [f"ONNX initializer '{init}' {shape} is the checkpoint's '{name}' ({how})"
                 for init, (shape, name, how) in found.matched.items()]
        notes += [f"ONNX initializer '{init}' {shape} is none of this layer's checkpoint tensors, as stored or "
                  "transposed: the export may hold another layer's or altered weights"
                  for init, shape in found.unmatched.items()]
        if found.missing:
            notes.append(f"ONNX graph: no initializer holds the checkpoint's {', '.join(found.missing)}")
        # every weight of the graph is one of ``tensors``, and every one of them is in the graph
        return notes, bool(found.matched) and not found.unmatched and not found.missing


@dataclass
class Identified:
    matched: dict[str, tuple[list[int], str, str]] = field(default_factory=dict)  # initializer -> shape, tensor, how
    unmatched: dict[str, list[int]] = field(default_factory=dict)  # initializer -> shape
    missing: list[str] = field(default_factory=list)  # checkpoint tensors no initializer holds
