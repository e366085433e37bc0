"""Whether a derived FFN computes what its structure says, measured rather than assumed.

A gated FFN's projections and activation say ``down(act(gate(x)) * up(x))``; a module may do more in its own forward
(Gemma 3n's early layers keep only the largest gate activations: activation sparsity).  Before a repository module is
chosen as the default target for it, transformers' module is run once on random weights and inputs and held to that
formula, in float32 at the layer's real size (about a second for a 2048 x 16384 MLP; measured, float32's rounding of
the same formula departs ~1e-6 of the output, Gemma 3n's sparsity 0.98).  A module that does more is one no
repository module expresses (the default target refuses in one line), never a false alarm on every layer of a
correct checkpoint.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

PROBE_PARAMETERS = 2**27  # a module larger than this (float32: 512 MiB) is not probed: its structure is trusted
DEPARTS = 1e-3  # of the output: far beyond float32's rounding of the same formula (~1e-6), far below a changed step
FUNCTIONS = {"silu": F.silu, "gelu_tanh": lambda z: F.gelu(z, approximate="tanh")}


def gated_formula_gap(module: nn.Module, ins: tuple, out, act: str, d: int) -> str | None:
    """Why transformers' gated ``module`` is not ``out(act(gate(x)) * up(x))`` on random values (None: it is, or
    it is too large to probe).  ``ins``: its input projections (gate, up; or one fused [gate; up]), ``out`` the
    down projection, as ``layout.structure.Projection``s; ``act``: 'silu' or 'gelu_tanh'.  Measured once per kind
    of module (its class, structure and settings): a compare derives A's layout and B's, of one model."""
    if sum(p.numel() for p in module.parameters()) > PROBE_PARAMETERS or act not in FUNCTIONS:
        return None
    key = (type(module), repr(module), repr(settings(module)), tuple(p.name for p in (*ins, out)), act, d)
    if key not in _MEASURED:
        _MEASURED[key] = _measure(module, ins, out, act, d)
    return _MEASURED[key]


_MEASURED: dict[tuple, str | None] = {}


def settings(module: nn.Module) -> list[tuple[str, float]]:
    """The module's own real-valued settings (Gemma 3n's per-layer activation_sparsity): modules of one class set
    differently compute differently, and are units of their own (an integer is more often a layer's index)."""
    return sorted((k, v) for k, v in vars(module).items() if not k.startswith("_") and type(v) is float)


def _measure(module: nn.Module, ins: tuple, out, act: str, d: int) -> str | None:
    generator = torch.Generator().manual_seed(0)
    probe = copy.deepcopy(module).to_empty(device="cpu").float().eval()
    with torch.no_grad():
        for param in probe.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
        x = torch.randn(2, 8, d, generator=generator)
        try:
            got = probe(x)
        except Exception:  # noqa: BLE001 - a forward that needs more than x is judged by the check itself
            return None
        branches = [probe.get_submodule(p.name)(x) for p in ins]
        gate, up = branches if len(branches) == 2 else branches[0].chunk(2, dim=-1)
        want = probe.get_submodule(out.name)(FUNCTIONS[act](gate) * up)
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return None
    deviation = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
    if deviation <= DEPARTS:
        return None
    return (f"its forward computes more than down(act(gate) * up) of its projections (measured on random "
            f"values: {deviation:.2g} of the output away; Gemma 3n's activation sparsity is such a step)")
