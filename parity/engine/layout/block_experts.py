"""Experts that are no module of their own: a mixture-of-experts block whose forward takes x alone and routes it
itself (JetMoE's ``JetMoeMoE``: a router, ``input_linear`` [E, 2·ff, d] and ``output_linear`` [E, d, ff], each a
``JetMoeParallelExperts`` holding one stack, an activation, and a bias of the block's own).

No module of transformers computes one expert alone, so the reference is the block itself built from the config
with one expert chosen per token out of one (a router over one expert gives it weight 1 whatever its scores), and
everything of the block that is no expert's zeroed (its router, its own bias: the whole block's, not an expert's).
How the two stacks hold an expert's gate, up and down (gate first or second in the fused one, concatenated or
interleaved, each stored [out, in] or [in, out]) is measured, once, on that very block holding random values:
exactly one reading of them as ``down(act(gate(x)) * up(x))`` must reproduce it (float64, to 1e-9 of the output),
or the block is refused.  This module imports none of parity's (structure.has_experts and derive read it).
"""

from __future__ import annotations

import copy
import inspect
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

AGREES = 1e-9


@dataclass(frozen=True)
class Reading:
    """How an expert sits in a block's two stacks: the fused input stack (``fused``) holds gate and up, gate first or
    not, as halves or alternate rows; ``down`` the output one; each stored [out, in] or transposed."""

    fused: str
    gate_first: bool
    interleaved: bool
    fused_transposed: bool
    down: str
    down_transposed: bool

    def join(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """One expert's fused stack, [out, in] ([2·ff, d]) as this reading stores it (before any transpose)."""
        first, second = (gate, up) if self.gate_first else (up, gate)
        return torch.stack([first, second], dim=1).flatten(0, 1) if self.interleaved else torch.cat([first, second])

    def split(self, fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate, up) out of one expert's fused stack as [2·ff, d]."""
        first, second = (fused[0::2], fused[1::2]) if self.interleaved else fused.chunk(2, dim=0)
        return (first, second) if self.gate_first else (second, first)


@dataclass(frozen=True)
class BlockExperts:
    """A layer's experts block: ``path`` relative to the layer; ``reading``: where an expert is in its stacks;
    ``others``: its parameters that are no expert's (zeroed in the reference)."""

    path: str
    module: nn.Module
    count: int
    width: int
    reading: Reading
    others: tuple[str, ...]


def stacks_of(block: nn.Module) -> dict[str, nn.Parameter]:
    """The block's 3-D parameters (each stacked over experts), by name relative to it."""
    return {name: p for name, p in block.named_parameters() if p.dim() == 3}


def takes_x_alone(module: nn.Module) -> bool:
    takes = [p for p in inspect.signature(module.forward).parameters.values()
             if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(takes) == 1


def one_expert_config(config: Any, count: int) -> Any:
    """The config with one expert, chosen for every token: each setting that counts the ``count`` experts (its name
    says experts) or the experts per token set to 1."""
    single = copy.deepcopy(config)
    for attr, value in vars(config).items():
        if type(value) is int and "expert" in attr and (value == count or "per_tok" in attr or "top_k" in attr):
            setattr(single, attr, 1)
    return single


def find_block_experts(layer: nn.Module, d: int, config: Any, activation: Callable[[nn.Module], nn.Module | None]
                       ) -> BlockExperts | None | str:
    """The layer's experts block (None: none; a string: why it cannot be read): a child whose forward takes x alone,
    holding an activation and two stacks over as many experts, one of them fused gate/up (2·ff wide)."""
    for path, block in layer.named_children():
        stacks = stacks_of(block)
        if len(stacks) != 2 or activation(block) is None or not takes_x_alone(block):
            continue
        count = {int(p.shape[0]) for p in stacks.values()}
        if len(count) != 1:
            continue
        widths = sorted(int(s) for p in stacks.values() for s in p.shape[1:] if s != d)
        if len(widths) != 2 or widths[1] != 2 * widths[0]:
            return f"its {type(block).__name__} holds two stacks over experts that are not one fused gate/up and a down"
        reading = measured_reading(block, config, next(iter(count)), d, widths[0], activation)
        if isinstance(reading, str):
            return reading
        others = tuple(n for n, _ in block.named_parameters() if n not in stacks)
        return BlockExperts(path, block, next(iter(count)), widths[0], reading, others)
    return None


def one_expert_block(meta_block: nn.Module, config: Any, count: int) -> nn.Module:
    """transformers' block built anew with one expert, on the CPU, every parameter zero."""
    with torch.device("meta"):
        block = type(meta_block)(one_expert_config(config, count))
    block = block.to_empty(device="cpu").eval()
    with torch.no_grad():
        for tensor in (*block.parameters(), *block.buffers()):
            tensor.zero_()
    return block


def fill(block: nn.Module, reading: Reading, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
    """One expert's gate, up and down ([out, in] each) into the one-expert block's stacks."""
    fused = reading.join(gate, up)
    params = dict(block.named_parameters())
    with torch.no_grad():
        params[reading.fused].copy_((fused.t() if reading.fused_transposed else fused).unsqueeze(0))
        params[reading.down].copy_((down.t() if reading.down_transposed else down).unsqueeze(0))


def readings(stacks: dict[str, nn.Parameter], d: int, width: int) -> list[Reading]:
    """Every way the two stacks could hold an expert, as far as their shapes allow."""
    found = []
    for fused, down in itertools.permutations(stacks):
        f_shape, d_shape = tuple(stacks[fused].shape[1:]), tuple(stacks[down].shape[1:])
        for f_t, d_t, gate_first, interleaved in itertools.product((False, True), repeat=4):
            fits = f_shape == ((d, 2 * width) if f_t else (2 * width, d))
            if fits and d_shape == ((width, d) if d_t else (d, width)):
                found.append(Reading(fused, gate_first, interleaved, f_t, down, d_t))
    return found


def measured_reading(meta_block: nn.Module, config: Any, count: int, d: int, width: int,
                     activation: Callable[[nn.Module], nn.Module | None]) -> Reading | str:
    """The one reading of the block's stacks under which the one-expert block computes down(act(gate) * up)."""
    try:
        block = one_expert_block(meta_block, config, count).double()
    except Exception as error:  # noqa: BLE001 - a block that cannot be built with one expert is not read
        return f"its {type(meta_block).__name__} could not be built with one expert ({error})"
    act = activation(block)
    generator = torch.Generator().manual_seed(0)
    gate, up, down = (torch.randn(shape, generator=generator, dtype=torch.float64) * 0.3
                      for shape in ((width, d), (width, d), (d, width)))
    x = torch.randn(1, 5, d, generator=generator, dtype=torch.float64)
    with torch.no_grad():
        want = (act(x @ gate.t()) * (x @ up.t())) @ down.t()
    found = []
    for reading in readings(stacks_of(block), d, width):
        fill(block, reading, gate, up, down)
        try:
            with torch.no_grad():
                got = block(x)
        except Exception as error:  # noqa: BLE001
            return f"its {type(meta_block).__name__} could not be run with one expert ({error})"
        if isinstance(got, torch.Tensor) and got.shape == want.shape \
                and float((got - want).abs().max()) <= AGREES * float(want.abs().max()):
            found.append(reading)
    if len(found) != 1:
        return (f"{'no' if not found else 'more than one'} reading of its {type(meta_block).__name__}'s stacks as "
                "down(act(gate(x)) * up(x)) reproduces it with one expert (measured on random values)")
    return found[0]


_MEASURED: dict[tuple, Reading | str] = {}


def reference_reading(meta_block: nn.Module, config: Any, d: int, width: int,
                      activation: Callable[[nn.Module], nn.Module | None]) -> Reading | str:
    """``measured_reading`` once per kind of block and size (every expert of every layer asks)."""
    stacks = stacks_of(meta_block)
    count = next(iter(stacks.values())).shape[0] if stacks else 0
    key = (type(meta_block), tuple(stacks), d, width)
    if key not in _MEASURED:
        _MEASURED[key] = measured_reading(meta_block, config, int(count), d, width, activation)
    return _MEASURED[key]


class OneExpertBlock(nn.Module):
    """The one-expert block on tokens [n, d] (it takes [batch, tokens, d])."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.block(tokens.unsqueeze(0)).reshape(tokens.shape)
