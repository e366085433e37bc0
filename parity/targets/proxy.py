"""A framework's module behind a torch ``nn.Module``, so the whole engine checks it unchanged.

The proxy's parameters mirror the framework module's: the same dotted names, shapes and dtypes, held by
submodules named after the framework's layer classes that say how their weights are stored
(``parity_layout``, read by ``parity.engine.check.routes.owner_layout``).  Routes are inferred from those names,
``fill_target`` copies the checkpoint's tensors into the mirror, ``place`` casts it for a ``--dtype`` run,
and the first forward after any change loads the mirror into the framework's module (exact values, in the
mirror's dtype, converted by the framework).  The output comes back as a CPU tensor; the engine takes it from
there.  The mirror costs one copy of the layer's weights beside the framework's own.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from parity.errors import UsageError
from parity.targets.base import CheckpointFacts, ForeignParameter, Framework


class ForeignLayer(nn.Module):
    """A submodule of the mirror: holds the parameters of one framework layer.  Its class is named after that
    layer's class (``Linear``), as templates and notes name owners; ``parity_layout`` is how it stores weights."""

    parity_layout: str | None = None

    def forward(self, *args: Any) -> Any:  # never called: the framework's module computes
        raise RuntimeError("a mirror of a framework layer is not run")


_LAYER_CLASSES: dict[tuple[str, str | None], type[ForeignLayer]] = {}


def layer_class(owner: str, layout: str | None) -> type[ForeignLayer]:
    key = (owner or "ForeignLayer", layout)
    if key not in _LAYER_CLASSES:
        _LAYER_CLASSES[key] = type(key[0], (ForeignLayer,), {"parity_layout": layout, "__module__": __name__})
    return _LAYER_CLASSES[key]


class ForeignModule(nn.Module):
    """The mirror of ``native``, a module (or function, or graph) of ``framework``."""

    def __init__(self, framework: Framework, native: Any, facts: CheckpointFacts | None = None):
        super().__init__()
        self.parity_framework = framework
        self.parity_native = native
        self.parity_loaded: tuple | None = None
        self.parity_holds_layer: bool | None = None  # a graph's own weights are the layer's (set when checked)
        self.parity_layout = None
        for parameter in framework.parameters(native, facts):
            self._mirror(parameter)

    def _mirror(self, parameter: ForeignParameter) -> None:
        *path, leaf = parameter.name.split(".")
        holder: nn.Module = self
        for depth, part in enumerate(path):
            child = holder._modules.get(part)
            if child is None:
                last = depth == len(path) - 1
                child = layer_class(parameter.owner if last else "", parameter.layout if last else None)()
                holder.add_module(part, child)
            holder = child
        if holder is self and parameter.layout:
            self.parity_layout = parameter.layout  # bare parameters (a NumPy function's arrays) say it here
        holder.register_parameter(leaf, nn.Parameter(torch.empty(parameter.shape, dtype=parameter.dtype),
                                                     requires_grad=False))

    @property
    def parity_fills(self) -> bool:
        return self.parity_framework.fills

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        framework = self.parity_framework
        params = dict(self.named_parameters())
        if any(p.device.type != "cpu" for p in params.values()) or x.device.type != "cpu":
            raise UsageError(f"--device: a {framework.name} target runs where {framework.name} puts it (here, the "
                             "CPU); --device places PyTorch targets. Leave it out for this target")
        dtype = next(iter(params.values())).dtype if params else x.dtype
        name = str(dtype).removeprefix("torch.")
        if name not in framework.dtypes and name != "float64":
            raise UsageError(f"--dtype {name}: a {framework.name} target computes in "
                             f"{', '.join(framework.dtypes)}")
        state = tuple((n, p.data_ptr(), p._version, p.dtype) for n, p in params.items())
        if state != self.parity_loaded:  # filled or cast since the last call: the framework gets the new values
            framework.load(self.parity_native, {n: p.detach() for n, p in params.items()})
            self.parity_loaded = state
        return framework.call(self.parity_native, x)

    def train(self, mode: bool = True) -> ForeignModule:
        super().train(mode)
        self.parity_framework.set_training(self.parity_native, mode)
        return self
