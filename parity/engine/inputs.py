"""The inputs both modules see: seeded, identical, and scaled to sweep the activation's range.

Each batch row is scaled so the activation's input reaches a different magnitude (about 1,
3 and 8): exact and tanh GELU differ most near |z| = 2.7, SiLU and GELU far from 0, so all
of that range is swept.  The scale is measured on transformers' own MLP (its activation's
pre-hook), not assumed from the weights.
"""

from __future__ import annotations

import torch
from torch import nn

from parity.engine.reference import activation_module
from parity.engine.sliced import SlicedMLP

ROW_TARGETS = (1.0, 3.0, 8.0)  # max |pre-activation| aimed at by each batch row
TOKENS = 16


def make_inputs(reference: nn.Module, hidden_size: int, seed: int, layer: int,
                expert: int | None = None) -> torch.Tensor:
    """[len(ROW_TARGETS), TOKENS, hidden_size] float32, reproducible from (seed, layer, expert)."""
    generator = torch.Generator().manual_seed(seed * 100_003 + layer + (0 if expert is None else 7919 * (expert + 1)))
    base = torch.randn(len(ROW_TARGETS), TOKENS, hidden_size, generator=generator)
    base = base / base.pow(2).mean(-1, keepdim=True).sqrt()  # unit RMS rows, as after a norm layer
    with torch.no_grad():
        z_base = preactivation(reference, base)
        z_zero = preactivation(reference, torch.zeros(1, 1, hidden_size))
    if z_base is None:
        return base * torch.tensor(ROW_TARGETS).view(-1, 1, 1)
    reach = (z_base - z_zero).abs().flatten(1).amax(1).clamp_min(1e-12)
    return base * (torch.tensor(ROW_TARGETS) / reach).view(-1, 1, 1)


class _Stop(Exception):
    """Raised by the activation's pre-hook: the rest of the forward is not needed."""


def preactivation(module: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """The input the module's activation sees for ``x`` (None when it has no activation child).

    The forward stops at the activation: the projections after it would be computed for nothing.
    """
    if isinstance(module, SlicedMLP):  # each slice's share of the units, in order
        parts = [preactivation(part, x) for part in module.slices()]
        return None if any(p is None for p in parts) else torch.cat(parts, dim=-1)
    act = activation_module(module)
    if act is None:
        return None
    seen = []

    def grab(_module, args):
        seen.append(args[0].detach())
        raise _Stop

    handle = act.register_forward_pre_hook(grab)
    try:
        module(x)
    except _Stop:
        pass
    finally:
        handle.remove()
    if not seen:
        return None
    z = seen[0]
    rows = x.numel() // x.shape[-1]
    if z.dim() == 2 and z.shape[0] > rows and z.shape[0] % rows == 0:  # each token in several slots (an expert
        z = z[:rows]  # routed twice: engine.experts.ExpertReference): the first slot's, every token in order
    if z.dim() == 2 and x.dim() == 3:  # experts see tokens flattened, in order: one row per batch item again
        z = z.reshape(x.shape[0], -1, z.shape[-1])
    return z
