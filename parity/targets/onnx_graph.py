"""ONNX targets: ``--target layer.onnx``, an exported FFN graph run with ONNX Runtime on the CPU.

The weights are inside the graph, so parity does not fill it (``fills = False``): it checks the graph's
initializers against the checkpoint layer's tensors instead, by shape and value, as stored or transposed
(torch's exporter folds transposes and renames initializers ``val_N``: names say nothing), and says which it
matched and which it could not.  Then the output is judged like any target's, so an export that baked another
layer, a swapped gate/up or the exact GELU is named by the same diagnoses.

An FFN is position-wise: each token's output depends on that token alone.  A graph exported with a fixed
input shape is run on parity's tokens in batches of its own token count (the last one padded), which computes
exactly what one call would.  The declared shape is read before anything is allocated: a rank other than
[tokens, d] or [batch, tokens, d], a fixed d that is not the checkpoint's, or a fixed token count beyond
``MAX_FIXED_TOKENS`` (a batch that would be almost all padding: [1, 2^26, d] is 20 GiB) is exit 2 naming the
input and its shape.  The graph's input type is its compute dtype: float32 and float16 run on the CPU provider;
its bfloat16 MatMul does not.

A graph can compute for ever (a ``Loop`` of 2^62 trips): ONNX Runtime's ``run`` holds the thread that calls it,
so Python's Ctrl-C handler would never run.  Each run goes on a worker thread while the calling thread waits,
where a KeyboardInterrupt reaches it; it then sets the run's ``RunOptions.terminate``, which ONNX Runtime checks
between kernels and Loop iterations, and the interrupt goes on (exit 130).
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

# A graph exported with a fixed token count is fed parity's tokens padded to that count; beyond this many tokens
# per call (a sequence length no FFN export uses: 2048-8192 are usual) the batch is refused rather than allocated.
MAX_FIXED_TOKENS = 1 << 16
RANKS = (2, 3)  # [tokens, d] and [batch, tokens, d]: the inputs an FFN graph takes
TERMINATE_WAIT_S = 10.0  # how long an interrupted run may take to see its terminate flag (it takes milliseconds)


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
        fixed = feedable(native, d, math.prod(x.shape[:-1]))  # before anything is allocated
        tokens = to_numpy(x).reshape(-1, d).astype(native.dtype)
        if fixed is None:  # dynamic: parity's tokens in the graph's own rank ([N, d] or [B, T, d])
            feed = [tokens if len(native.input_shape) == 2 else tokens.reshape(x.shape)]
        else:  # fixed: batches of the graph's own token count, the last padded
            count = math.prod(fixed[:-1])
            padded = np.zeros((math.ceil(len(tokens) / count) * count, d), dtype=tokens.dtype)
            padded[:len(tokens)] = tokens
            feed = [chunk.reshape(fixed) for chunk in np.split(padded, len(padded) // count)]
        outputs = [stoppable_run(native.session, {native.input_name: chunk})[0] for chunk in feed]
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


def feedable(native: Graph, d: int, tokens: int) -> list[int] | None:
    """The shape of one call's input when the graph fixes its token count (None: dynamic, fed as one call), from
    the graph's declared input shape alone; a TargetError (exit 2) naming the input and its shape when parity
    cannot feed it: a rank other than 2 or 3, a fixed width that is not the checkpoint's d, or a fixed token
    count beyond MAX_FIXED_TOKENS (its padded batch would be that many rows of d, mostly zeros)."""
    declared = ["?" if n is None else n for n in native.input_shape]
    where = f"--target {shown(native.path)}: the graph's input '{native.input_name}' has shape {declared}"
    if len(native.input_shape) not in RANKS:
        raise TargetError(f"{where}, rank {len(native.input_shape)}; parity feeds an FFN [tokens, d] or "
                          f"[batch, tokens, d] hidden states: export it with one of those input ranks")
    if native.input_shape[-1] not in (None, d):
        raise TargetError(f"{where}: its width is {native.input_shape[-1]}, the checkpoint's hidden size is {d}; "
                          "export the layer of this checkpoint")
    fixed = native.input_shape[:-1]
    if all(n is None for n in fixed):
        return None
    count = math.prod(n or 1 for n in fixed)
    if count > max(MAX_FIXED_TOKENS, tokens):
        raise TargetError(f"{where}: {count} tokens per call, fixed; parity feeds {tokens} and pads up to "
                          f"{MAX_FIXED_TOKENS} per call, no more (a batch of {count} x {d} would be allocated for "
                          "them): export it with a dynamic token axis (dynamic_shapes / dynamic_axes) or a smaller "
                          "fixed one")
    return [n or 1 for n in fixed] + [d]


def stoppable_run(session: Any, feed: dict[str, Any]) -> list[Any]:
    """``session.run(None, feed)`` that Ctrl-C stops: run on a worker thread while this one waits (a wait that a
    KeyboardInterrupt reaches); on the interrupt the run's ``terminate`` flag is set, the worker given
    TERMINATE_WAIT_S to stop, and the interrupt raised on.  A daemon thread: a worker that never stops does not
    hold the process open.

    The wait is on an Event the worker sets when its run has returned, not on ``Thread.join``: a join that a
    KeyboardInterrupt breaks marks a thread that is still running as stopped (CPython 3.11's ``_wait_for_tstate_lock``
    releases the thread's own lock when it finds it locked), so the interrupted join returned at once, the interpreter
    began to exit while ONNX Runtime's run was still on the worker, and when that run returned the worker was ended by
    ``pthread_exit`` inside ONNX Runtime's C++ frames: "terminate called without an active exception", SIGABRT
    (2 of 8 runs of tests/test_targets_redteam.py's Ctrl-C test under load; seen in the core's backtrace)."""
    import threading

    import onnxruntime

    options = onnxruntime.RunOptions()
    options.log_severity_level = 4  # the terminated run's error is parity's doing, not the graph's: not logged
    result: dict[str, Any] = {}

    returned = threading.Event()

    def work() -> None:
        try:
            result["outputs"] = session.run(None, feed, options)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread, raised there
            result["error"] = exc
        finally:
            returned.set()

    threading.Thread(target=work, name="parity-onnx-run", daemon=True).start()
    try:
        while not returned.wait(0.25):
            pass
    except KeyboardInterrupt:
        options.terminate = True
        returned.wait(TERMINATE_WAIT_S)
        raise
    if "error" in result:
        raise result["error"]
    return result["outputs"]
