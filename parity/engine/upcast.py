"""Run a module in float32 / float64 while its weights stay in their stored dtype.

The reference MLP of a 1B model holds ~70 MB of bfloat16 weights, 140 MB in float32 and
280 MB in float64; converting the whole module puts the float64 copy on top of everything
else.  Instead each submodule that owns parameters gets its weights upcast (into a reused
scratch buffer) just before it runs, and its stored tensors back right after, so at most
one projection exists in the compute dtype at a time.  Values are identical: bfloat16/float16/float32
values are exact in the wider dtype.

Hooks hold no reference to the module (no reference cycles: everything is freed by
reference counting the moment the caller drops the module, without ``gc.collect``).
"""

from __future__ import annotations

import copy
from functools import partial

import torch
from torch import nn

_STORED = "_parity_stored"  # submodule attribute: {name: tensor as stored} of its own parameters / buffers
_MODE = "_parity_compute"  # root attribute: the shared _Compute


class _Compute:
    """The dtype submodules compute in, and scratch buffers for the upcast weights; shared
    by every hook of one module.  Reusing a buffer (one per dtype, unless submodules nest)
    spares the page faults of a fresh 50-100 MB allocation on every call."""

    __slots__ = ("dtype", "_free")

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self._free: dict[torch.dtype, list[torch.Tensor]] = {}

    def upcast(self, stored: torch.Tensor) -> torch.Tensor:
        """``stored`` in the compute dtype, or wider if it is stored wider (never a downcast)."""
        if not stored.is_floating_point():
            return stored
        dtype = torch.promote_types(self.dtype, stored.dtype)
        if dtype == stored.dtype:
            return stored
        free = self._free.setdefault(dtype, [])
        fits = sorted((buf.numel(), i) for i, buf in enumerate(free) if buf.numel() >= stored.numel())
        buf = free.pop(fits[0][1]) if fits else torch.empty(stored.numel(), dtype=dtype, device=stored.device)
        return buf[:stored.numel()].view(stored.shape).copy_(stored)

    def give_back(self, used: torch.Tensor, stored: torch.Tensor) -> None:
        if used is not stored and used.dtype != stored.dtype:
            whole = torch.empty(0, dtype=used.dtype, device=used.device).set_(used.untyped_storage())  # flat, whole
            self._free.setdefault(used.dtype, []).append(whole)


def _own_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    tensors = {name: p for name, p in module.named_parameters(recurse=False)}
    tensors.update({name: b for name, b in module.named_buffers(recurse=False)
                    if b is not None and b.is_floating_point()})
    return tensors


def _put(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    if name in module._parameters:
        module._parameters[name] = nn.Parameter(tensor, requires_grad=False)
    else:
        module._buffers[name] = tensor


def _current(module: nn.Module, name: str) -> torch.Tensor:
    return module._parameters[name] if name in module._parameters else module._buffers[name]


def _materialize(mode: _Compute, module: nn.Module, _args) -> None:
    kept = getattr(module, _STORED)
    for name, stored in kept.items():
        current = _current(module, name)
        if current.dtype != stored.dtype or current.data_ptr() != stored.data_ptr():
            # converted or reassigned since (module.double(), load_state_dict): that is the stored tensor now
            stored = kept[name] = current.detach()
        _put(module, name, mode.upcast(stored))


def _release(mode: _Compute, module: nn.Module, _args, _output) -> None:
    for name, stored in getattr(module, _STORED).items():
        used = _current(module, name)
        _put(module, name, stored)
        mode.give_back(used.detach(), stored)


def upcast_on_call(module: nn.Module, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Hook ``module`` (in place) so each parameter-owning submodule computes in ``dtype``."""
    mode = _Compute(dtype)
    setattr(module, _MODE, mode)
    for sub in module.modules():
        own = _own_tensors(sub)
        if not own:
            continue
        setattr(sub, _STORED, {name: t.detach() for name, t in own.items()})
        sub.register_forward_pre_hook(partial(_materialize, mode))
        sub.register_forward_hook(partial(_release, mode), always_call=True)
    return module


def compute_in(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Switch a hooked module to ``dtype``; an unhooked one is converted as a whole (``module.to``)."""
    mode = getattr(module, _MODE, None)
    if mode is None:
        return module.to(dtype)
    mode.dtype = dtype
    mode._free.clear()  # buffers of the previous dtype are not needed any more
    return module


def works_on_call(meta_module: nn.Module, stored_dtype: torch.dtype, hidden_size: int) -> bool:
    """Whether per-call upcasting computes this module entirely in the compute dtype.

    A forward that reads a child's weight dtype before calling it (T5's ``wo.weight.dtype``
    check) would hand that child an input in the stored dtype.  Checked on the meta device
    (free and instant): every parameter-owning submodule must get float64 inputs and the
    output must be float64.
    """
    if stored_dtype == torch.float64:
        return False  # nothing to save
    probe = copy.deepcopy(meta_module).to(stored_dtype)
    upcast_on_call(probe, torch.float64)
    inputs: set[torch.dtype] = set()
    for sub in probe.modules():
        if hasattr(sub, _STORED):
            sub.register_forward_pre_hook(
                lambda _m, args: inputs.update(a.dtype for a in args
                                               if isinstance(a, torch.Tensor) and a.is_floating_point()))
    try:
        with torch.no_grad():
            out = probe(torch.empty(1, 2, hidden_size, dtype=torch.float64, device="meta"))
    except Exception:
        return False
    out = out[0] if isinstance(out, tuple) else out
    return isinstance(out, torch.Tensor) and out.dtype == torch.float64 and inputs <= {torch.float64}
