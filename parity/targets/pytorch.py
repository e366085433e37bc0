"""PyTorch targets (``torch.nn.Module``): parity's own kind.  A PyTorch module is what the engine fills and runs,
so it needs no proxy (``native``): built by its constructor, its ``named_parameters`` listed, ``copy_`` filled,
called on the inputs where ``--device`` and ``--dtype`` place it.  It is registered beside the other frameworks
so that one table says what a --target may be."""

from __future__ import annotations

import copy
from typing import Any

from parity.targets.base import Framework


class PyTorch(Framework):
    name = "torch"
    modules = ("torch.",)
    imports = ("torch",)
    distribution = "torch"
    native = True  # the engine's own kind: checked as it is, not behind parity.targets.proxy

    def copy(self, native: Any) -> Any:
        return copy.deepcopy(native)
