"""Experts kept flattened: a module's own matrices, each every expert's rows one after another ([E·ff, d]).

Not every family keeps its experts in transformers 5's fused module (``gate_up_proj``/``down_proj`` stacked as
[E, ...], ``layout.experts``): DBRX's ``DbrxExperts`` holds a ``DbrxExpertGLU`` whose three parameters ``w1``,
``v1``, ``w2`` are each [E·ff, d], viewed as [E, ff, d] and called with one expert's three matrices.  Which matrix
is the gate, which the up and which the down projection, and in which orientation each is read, is not said by any
attribute or name transformers gives: it is measured here, once, on transformers' own experts module holding one
expert of random values and called with every token routed to it, against every way of reading its matrices as
``down(act(gate(x)) * up(x))``.  Exactly one way must reproduce it (float64, to 1e-9 of the output); anything else
is refused.  The checkpoint holds the module's own tensors (transformers converts nothing), found through its
load-time renaming as every derived tensor is.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

AGREES = 1e-9  # of the output, float64: the way transformers' module reads its matrices, not a near miss
PROBE_ROWS = 1 << 22  # one expert's matrices larger than this are probed at a small d and d_ff (see shrunk)


@dataclass(frozen=True)
class FlatExperts:
    """A layer's experts kept as flattened matrices: ``path`` (relative to the layer) is the module called with the
    routing (x, top_k_index, top_k_weights), ``holder`` the path under it of the module owning the matrices;
    ``roles``: each matrix's name -> (gate | up | down, whether one expert's slice is stored [in, out])."""

    path: str
    module: nn.Module
    holder: str
    count: int
    width: int
    roles: tuple[tuple[str, str, bool], ...]

    def role_of(self, role: str) -> tuple[str, bool]:
        return next((name, transposed) for name, r, transposed in self.roles if r == role)


def flat_stacks(module: nn.Module, count: int, d: int) -> dict[str, nn.Parameter]:
    """The module's own 2-D parameters that hold ``count`` experts' rows one after another, each row d wide."""
    return {name: p for name, p in module.named_parameters(recurse=False)
            if p.dim() == 2 and p.shape[1] == d and p.shape[0] % count == 0 and p.shape[0] > count}


def router_counts(layer: nn.Module, d: int) -> set[int]:
    """The expert counts a router of the layer scores: a projection's weight [E, d] (nn.Linear d -> E)."""
    return {int(m.weight.shape[0]) for m in layer.modules() if isinstance(m, nn.Linear) and m.weight.shape[1] == d
            and m.weight.shape[0] < d}


def holds_flat_experts(layer: nn.Module, d: int) -> bool:
    """Whether some module of the layer holds three matrices flattened over as many experts as a router scores."""
    return any(len(stacks := flat_stacks(m, count, d)) == 3 and len({p.shape for p in stacks.values()}) == 1
               for count in router_counts(layer, d) for m in layer.modules())


def find_flat_experts(layer: nn.Module, d: int, activation: Callable[[nn.Module], nn.Module | None]
                      ) -> FlatExperts | None | str:
    """The layer's flattened experts (None: it holds none), their roles measured; a string: why they cannot be read
    (no way of reading them reproduces transformers' module, or more than one does).  ``activation``: the
    activation module of a module (parity.engine.reference.activation_module; passed in, so that this module,
    which structure.has_experts reads, imports no other of parity's)."""
    for count in sorted(router_counts(layer, d)):
        for holder_path, holder in layer.named_modules():
            stacks = flat_stacks(holder, count, d)
            if len(stacks) != 3 or len({p.shape for p in stacks.values()}) != 1:
                continue
            owner_path = holder_path.rpartition(".")[0]  # the experts module that routes tokens to the holder
            owner = layer.get_submodule(owner_path)
            width = next(iter(stacks.values())).shape[0] // count
            roles = measured_roles(owner, holder_path[len(owner_path):].lstrip("."), stacks, d, width,
                                   activation(holder))
            if isinstance(roles, str):
                return roles
            return FlatExperts(owner_path, owner, holder_path[len(owner_path):].lstrip("."), count, width, roles)
    return None


def one_expert(owner: nn.Module, holder: str, tensors: dict[str, torch.Tensor]) -> nn.Module:
    """A copy of transformers' (meta-device) experts module holding only these matrices (one expert's)."""
    module = copy.deepcopy(owner)
    target = module.get_submodule(holder)
    for name, tensor in tensors.items():
        setattr(target, name, nn.Parameter(tensor.contiguous(), requires_grad=False))
    return module.eval()


def routed_call(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The experts module on tokens [n, d], every token routed to expert 0 at weight 1."""
    index = torch.zeros(x.shape[0], 1, dtype=torch.long)
    return module(x, index, torch.ones(x.shape[0], 1, dtype=x.dtype)).reshape(x.shape)


def measured_roles(owner: nn.Module, holder: str, stacks: dict[str, nn.Parameter], d: int, width: int,
                   act: nn.Module | None) -> tuple[tuple[str, str, bool], ...] | str:
    """Each matrix's role and orientation: the one reading of them as a gated FFN that transformers' module
    computes, measured in float64 on random values (at d = 8, d_ff = 24 for a large module; its own size
    attributes with them).  ``act``: the holder's activation module."""
    if act is None:
        return f"its experts' {type(owner.get_submodule(holder)).__name__} holds no activation module"
    probe, d, width = shrunk(owner, d, width)
    generator = torch.Generator().manual_seed(0)
    values = {n: torch.randn(width, d, generator=generator, dtype=torch.float64) * 0.3 for n in stacks}
    x = torch.randn(5, d, generator=generator, dtype=torch.float64)
    try:
        with torch.no_grad():
            got = routed_call(one_expert(probe, holder, values).double(), x)
    except Exception as error:  # noqa: BLE001 - a forward that cannot run so is not read as experts
        return f"its experts module could not be run with one expert and every token routed to it ({error})"
    act = copy.deepcopy(act).double()
    found = []
    for names in itertools.permutations(stacks):
        for flips in itertools.product((False, True), repeat=3):
            gate, up, down = (values[n].t() if flip else values[n] for n, flip in zip(names, flips, strict=True))
            if gate.shape[0] != width or up.shape[0] != width or down.shape[1] != width:
                continue  # each read as nn.Linear's [out, in]: gate and up [ff, d], down [d, ff]
            with torch.no_grad():
                want = (act(x @ gate.t()) * (x @ up.t())) @ down.t()
            if float((got - want).abs().max()) <= AGREES * float(want.abs().max()):
                found.append(tuple(zip(names, ("gate", "up", "down"), flips, strict=True)))
    if len(found) != 1:
        return (f"{'no' if not found else 'more than one'} reading of its experts' matrices "
                f"({', '.join(stacks)}) as down(act(gate(x)) * up(x)) reproduces transformers' module (measured on "
                "random values)")
    return found[0]


def shrunk(owner: nn.Module, d: int, width: int) -> tuple[nn.Module, int, int]:
    """The module as probed: itself, or for a large one a copy whose integer settings equal to d or d_ff read
    8 and 24 (DbrxExperts views its matrices by its own hidden_size and ffn_hidden_size)."""
    if width * d <= PROBE_ROWS or d == width:
        return owner, d, width
    probe = copy.deepcopy(owner)
    for module in probe.modules():
        for key, value in list(vars(module).items()):
            if type(value) is int and value in (d, width):
                setattr(module, key, 8 if value == d else 24)
    return probe, 8, 24


_MEASURED: dict[tuple, tuple[tuple[str, str, bool], ...] | str] = {}


def reference_roles(owner: nn.Module, d: int, width: int, activation: Callable[[nn.Module], nn.Module | None]
                    ) -> tuple[str, tuple[tuple[str, str, bool], ...] | str]:
    """(holder path, roles) of a flattened experts module as a reference is built from it: measured once per kind
    of module and size (every expert of every layer asks)."""
    for holder_path, holder in owner.named_modules():
        stacks = {n: p for n, p in holder.named_parameters(recurse=False)
                  if p.dim() == 2 and p.shape[1] == d and p.shape[0] % width == 0}
        if len(stacks) == 3:
            key = (type(owner), holder_path, tuple(stacks), d, width)
            if key not in _MEASURED:
                _MEASURED[key] = measured_roles(owner, holder_path, stacks, d, width, activation(holder))
            return holder_path, _MEASURED[key]
    return "", f"{type(owner).__name__} holds no three matrices of {width}-row experts, each {d} wide"
