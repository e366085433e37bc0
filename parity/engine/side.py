"""One checkpoint as its resolved layout reads it, one layer at a time, with transformers' module for each layer.

Both flows start here once ``engine.layout`` has resolved a checkpoint: a check (``engine.check.session.Session``
extends a ``Side`` with its target, device, dtype and tolerance) and a compare (``engine.compare.comparison``
holds one ``Side`` per checkpoint and builds no target).  A ``Side`` reads a layer's FFN tensors as stored
(``engine.layer``), routes them to transformers' own parameter names, builds transformers' module holding them
(``engine.reference``, ``engine.experts``) and runs it as the truth (``run_reference``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from parity.definitions.mapping import ConfigValue, Mapping, check_reference_routes
from parity.definitions.reference_routes import check_reference_roles
from parity.definitions.registry import builtin_mappings
from parity.definitions.selection import Selection, parse_selection
from parity.engine.inputs import preactivation
from parity.engine.layer import LayerReader, route_tensor
from parity.engine.reference import ReferenceModel
from parity.engine.upcast import compute_in
from parity.errors import CheckpointError, LayerRangeError

if TYPE_CHECKING:  # a side is given what resolve found; it never resolves anything itself
    from parity.engine.layout.resolve import Resolved


class Side:
    """One resolved checkpoint: its layout, config and reader, transformers' module for any of its layers, and its
    further layouts (dense layers before MoE ones, shared experts) as ``parts``, each a Side of its own."""

    def __init__(self, resolved: Resolved, reference: ReferenceModel | None = None):
        self.resolved = resolved
        self.mapping: Mapping = resolved.mapping
        self.checkpoint = resolved.checkpoint
        self.config = resolved.config
        self.reference = reference or ReferenceModel(self.config)
        self.num_layers = self.config_int(self.mapping.num_layers, "num_layers")
        self.hidden_size = self.config_int(self.mapping.hidden_size, "hidden_size")
        experts = self.mapping.experts
        self.num_experts = None if experts is None else self.config_int(experts.count, "experts.count")
        self.reader = LayerReader(self.mapping, self.checkpoint, self.reference, self.num_experts)
        if experts is None:  # a [reference.tensors] name the MLP lacks would silently route nothing
            names = self.reference.tensor_shapes(self.mapping.reference_path(self.mapping.first_layer))
            check_reference_routes(self.mapping, names)
            check_reference_roles(self.mapping, names, builtin_mappings().values())  # nor may a mapping bend it
        # the checkpoint's further layouts (dense layers before MoE ones, shared experts): each its own units
        self.parts = [self.part(dataclasses.replace(resolved, mapping=part)) for part in self.mapping.parts]

    def part(self, resolved: Resolved) -> Side:
        """A further layout of this checkpoint (``resolved`` with its mapping), sharing transformers' model."""
        return Side(resolved, self.reference)

    def config_int(self, size: Any, key: str) -> int:
        """A mapping size (num_layers, hidden_size, experts.count) read from the config: a config.json may hold
        anything."""
        value = ConfigValue(self.config, self.mapping.path)(size, key)
        if (isinstance(value, bool)
                or not isinstance(value, int) and not (isinstance(value, float) and value.is_integer())):
            raise CheckpointError(f"{self.checkpoint.location}: {size} (mapping key '{key}') is {value!r}, "
                                  "not an integer; fix config.json")
        return int(value)

    def read_layer(self, layer: int, expert: int | None = None,
                   dtype: torch.dtype | None = torch.float32) -> dict[str, torch.Tensor]:
        """The layer's FFN tensors, relative names, upcast to ``dtype`` (None: as stored)."""
        return self.reader.read(layer, expert, dtype)

    # -- transformers' module ----------------------------------------------------------------------
    def build_reference(self, layer: int, tensors: dict[str, torch.Tensor]) -> nn.Module:
        return self.reference_from(layer, self.reference_tensors(layer, tensors))

    def reference_tensors(self, layer: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Checkpoint tensors routed to the reference's own parameter names."""
        return {r.target: route_tensor(r, tensors[r.source]) for r in self.reader.reference_routes(layer)}

    def reference_from(self, layer: int, routed: dict[str, torch.Tensor], on_call: bool = True,
                       dtype: torch.dtype = torch.float32) -> nn.Module:
        """transformers' MLP for the layer (or its experts module holding one expert) with these tensors;
        ``on_call=False``: a plain float32 module; another ``dtype``: a plain module in that dtype
        (see ReferenceModel.build)."""
        if self.mapping.experts is not None:
            from parity.engine.experts import expert_reference

            path = self.mapping.reference_path(layer)
            module = expert_reference(self.reference.meta_module(path), self.config,
                                      {role: tensor.float() for role, tensor in routed.items()}, path)
            return module if dtype == torch.float32 else module.to(dtype)
        return self.reference.build(self.mapping.reference_path(layer), routed, self.hidden_size, on_call, dtype)

    # -- the units of a layer --------------------------------------------------------------------------
    def expert_indices(self, selection: str | int | Iterable[int] | None) -> list[int | None]:
        """[None] for a dense model; the selected experts (default: all) for MoE."""
        if self.num_experts is None:
            if selection is not None and selection != "all":
                raise LayerRangeError(f"--experts {selection!r}: mapping '{self.mapping.name}' describes a dense model "
                                      "(no experts)")
            return [None]
        return parse_selection(selection, self.num_experts, "expert")

    def units(self, layer: int, experts: Selection = None) -> list[tuple[Side, int | None]]:
        """What is checked of a layer, in order: each layout serving it (this one, then its parts) as a unit, or
        each selected expert of one with experts (``--experts`` selects among routed experts only)."""
        return [(side, expert) for side in (self, *self.parts) if side.mapping.serves(layer)
                for expert in side.expert_indices(experts if side.num_experts is not None else None)]

    def unit_names(self) -> list[str]:
        """The names of the units beside routed experts (a shared expert, dense layers before MoE ones), in order."""
        return list(dict.fromkeys(s.mapping.unit for s in (self, *self.parts) if s.mapping.unit))


@dataclass
class Truth:
    """What the reference computed for one layer's inputs, before the target exists."""

    z: torch.Tensor | None  # the activation's input (the range the inputs reached)
    out32: torch.Tensor
    out64: torch.Tensor
    low: torch.Tensor | None


def run_reference(reference: nn.Module, x: torch.Tensor,
                  low: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Truth:
    """transformers' MLP on its own copies of the inputs, in float32 and float64; ``low`` runs it in a check's
    low-precision dtype on its device (built only when its turn comes, and dropped after it ran)."""
    with torch.no_grad():
        z = preactivation(reference, x.clone())
        out32 = reference(x.clone()).double()
        out64 = compute_in(reference, torch.float64)(x.double())  # one projection (or slice) at a time
        out_low = None if low is None else low(x.clone())
    return Truth(z, out32, out64, out_low)
