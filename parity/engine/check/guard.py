"""The target cannot bend the oracle: torch's global state is checked around every call into user code.

transformers' MLP looks its activation up at call time (``nn.functional.silu``, ``torch.tanh``, a
``transformers.activations`` class's ``forward``) and builds its tensors in the default dtype.  A target
that replaces one of those, or calls ``torch.set_default_dtype(torch.float64)``, would change the reference
of every later layer, so that a wrong module passes against a patched reference, or parity's own matmuls
fail on mixed dtypes.  Around each construction, fill and forward of the target the guard takes a
snapshot, and afterwards restores whatever changed and returns what it was: the layer then fails with
``global_state_modified`` naming it, and the next layer's reference runs on the real torch.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

# Namespaces whose attributes transformers' activations and MLPs reach at call time (modules and classes).
WATCHED = ("torch", "torch.nn.functional", "torch.Tensor", "torch.nn.Linear", "transformers.activations",
           "torch._C._nn", "torch._C._VariableFunctions", "torch._C.TensorBase")  # the kernels F.* and torch.* call
# Process-wide switches a reference computation depends on: (name, read, write).
SWITCHES: tuple[tuple[str, Callable[[], Any], Callable[[Any], None]], ...] = (
    ("torch.get_default_dtype()", torch.get_default_dtype, torch.set_default_dtype),
    ("torch.is_grad_enabled()", torch.is_grad_enabled, torch.set_grad_enabled),
    ("torch.are_deterministic_algorithms_enabled()", torch.are_deterministic_algorithms_enabled,
     lambda on: torch.use_deterministic_algorithms(on)),
    ("torch.backends.cuda.matmul.allow_tf32", lambda: torch.backends.cuda.matmul.allow_tf32,
     lambda on: setattr(torch.backends.cuda.matmul, "allow_tf32", on)),
    ("torch.get_float32_matmul_precision()", torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
)


@functools.cache
def _namespace(name: str) -> Any:
    module, _, attribute = name.rpartition(".")
    try:
        return importlib.import_module(name)
    except ImportError:
        return getattr(importlib.import_module(module), attribute)


@functools.cache
def _classes_in(namespace: Any) -> tuple[type, ...]:
    """The activation classes of transformers.activations (their ``forward`` is what the reference calls)."""
    if getattr(namespace, "__name__", "") != "transformers.activations":
        return ()
    return tuple(value for value in vars(namespace).values() if isinstance(value, type)
                 and issubclass(value, torch.nn.Module) and value.__module__ == namespace.__name__)


class Snapshot:
    """The watched attributes (by identity) and switches (by value) at one moment."""

    def __init__(self):
        self.owners: dict[str, Any] = {}
        self.attributes: dict[str, dict[str, Any]] = {}
        for name in WATCHED:
            namespace = _namespace(name)
            self._take(name, namespace)
            for cls in _classes_in(namespace):
                self._take(f"{name}.{cls.__name__}", cls)
        self.switches = {name: read() for name, read, _ in SWITCHES}

    def _take(self, name: str, owner: Any) -> None:
        """A module's public names (its private ones and lazily imported submodules come and go on their own);
        a class's every method, dunders included (``torch.Tensor.__mul__``)."""
        self.owners[name] = owner
        if not hasattr(owner, "__dict__"):  # a C object with attributes only (torch._C._VariableFunctions)
            self.attributes[name] = {k: getattr(owner, k, None) for k in dir(owner) if not k.startswith("_")}
            return
        items = vars(owner).items()
        self.attributes[name] = dict(items) if isinstance(owner, type) else {
            k: v for k, v in items if not k.startswith("_")}

    def restore_changes(self) -> list[str]:
        """Put back everything that differs from this snapshot; returns what differed ('torch.tanh replaced').
        Names added since are left alone: torch and transformers add attributes lazily on first use."""
        changed = []
        for name, before in self.attributes.items():
            owner = self.owners[name]
            now = vars(owner) if hasattr(owner, "__dict__") else {k: getattr(owner, k, None) for k in before}
            for key, value in before.items():
                if key not in now or now[key] is not value:
                    changed.append(f"{name}.{key} {'removed' if key not in now else 'replaced'}")
                    with contextlib.suppress(AttributeError, TypeError):
                        setattr(owner, key, value)
        for name, read, write in SWITCHES:
            now = read()
            if now != self.switches[name]:
                changed.append(f"{name} changed from {self.switches[name]} to {now}")
                with contextlib.suppress(Exception):
                    write(self.switches[name])
        return changed


@contextlib.contextmanager
def guarded(changes: list[str]) -> Iterator[None]:
    """Run user code; afterwards (also when it raised) restore torch's state and append what it had changed."""
    snapshot = Snapshot()
    try:
        yield
    finally:
        changes.extend(change for change in snapshot.restore_changes() if change not in changes)
