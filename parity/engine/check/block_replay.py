"""Naming the routing mistake of a block too large to hold (engine.check.block_check's streamed blocks).

A held block's mistakes are replayed on transformers' block whole (engine.routing_mistakes).  A streamed block's
experts are never held together, so its replays run on a few of the tokens where the user's block failed, around
``ExpertsOnDemand``: a stand-in for the experts module that computes each (token, expert) pair the block asks for
from that expert's stored values, read one expert at a time through the same reader the streamed pass uses, and
keeps each pair's output, so that replays choosing the same experts do not read them again.  The replays that
change the routing, or move the score onto an expert's input, run (routing_mistakes.NOT_REPLAYED_ON_STAND_IN says
which do not); the verdict on the few tokens
uses the held path's rule and tolerance (routing_mistakes.replay_fits, from block_check.streamed_mistake).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from parity.engine.experts import expert_reference, sliced_expert

REPLAY_TOKENS = 8  # a streamed block's mistakes are replayed on this many of the tokens where it failed


class ExpertsOnDemand(nn.Module):
    """transformers' experts module of a streamed block, each (token, expert) pair computed when asked for, in
    float64: ``build(e)`` is expert e alone in transformers' experts module (built from its stored values, dropped
    once its pairs are computed); a pair's output (at routing weight 1) is kept by the token's values and the expert
    computed, so another replay choosing it again costs nothing.  ``reads`` counts the experts built.  Its
    ``exchanged`` makes it a stand-in engine.routing_mistakes runs only the routing replays on (``stands_in``)."""

    def __init__(self, count: int, build: Callable[[int], nn.Module]):
        super().__init__()
        self.num_experts, self.build = count, build
        self.order = list(range(count))  # an exchange replay: asked for one expert, compute the other
        self.cache: dict[tuple[bytes, int], torch.Tensor] = {}
        self.reads = 0

    @contextlib.contextmanager
    def exchanged(self, first: int, second: int) -> Iterator[None]:
        self.order[first], self.order[second] = second, first
        try:
            yield
        finally:
            self.order = list(range(self.num_experts))

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The experts' output for what the block hands them, (tokens, chosen experts, their weights), positional
        or by any names (as engine.block.experts_call reads the call)."""
        hidden, index, weights = [a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)][:3]
        if index.is_floating_point():
            index, weights = weights, index
        flat = hidden.detach().reshape(-1, hidden.shape[-1]).double()
        keys = [hashlib.blake2b(row.contiguous().numpy().tobytes(), digest_size=16).digest() for row in flat]
        index = index.reshape(len(flat), -1).long()
        weights = weights.reshape(len(flat), -1).double()
        pairs = [(token, slot, self.order[int(e)]) for token in range(len(flat))
                 for slot, e in enumerate(index[token].tolist()) if 0 <= e < self.num_experts]
        self.compute(flat, keys, {(token, expert) for token, _, expert in pairs})
        out = torch.zeros_like(flat)
        for token, slot, expert in pairs:
            out[token] += weights[token, slot] * self.cache[(keys[token], expert)]
        return out.to(hidden.dtype).reshape(hidden.shape)

    def compute(self, flat: torch.Tensor, keys: list[bytes], wanted: set[tuple[int, int]]) -> None:
        """The pairs not kept yet, each expert built once for all the tokens that need it, one expert at a time."""
        missing: dict[int, list[int]] = {}
        for token, expert in sorted(wanted):
            if (keys[token], expert) not in self.cache and token not in missing.get(expert, []):
                missing.setdefault(expert, []).append(token)
        for expert, tokens in sorted(missing.items()):
            module = self.build(expert)
            self.reads += 1
            rows = flat[tokens]
            with torch.no_grad():
                outs = module(rows, torch.zeros(len(tokens), 1, dtype=torch.long),
                              torch.ones(len(tokens), 1, dtype=rows.dtype))
            del module
            for token, out in zip(tokens, outs, strict=True):
                self.cache[(keys[token], expert)] = out.double()


def failing_tokens(out64: torch.Tensor, got: torch.Tensor, kept: torch.Tensor, tolerance: float) -> torch.Tensor:
    """The flattened indices of at most REPLAY_TOKENS judged tokens where the user's block is farthest from the
    truth beyond ``tolerance`` (the worst first)."""
    width = out64.shape[-1]
    error = (got.double().reshape(-1, width) - out64.reshape(-1, width)).abs().amax(-1)
    error = torch.where(kept & (error > tolerance), error, torch.full_like(error, -1.0))
    order = error.argsort(descending=True)[:REPLAY_TOKENS]
    return order[error[order] > 0]


def expert_builder(reader: Any, layer: int, *, sliced: bool = False) -> Callable[[int], nn.Module]:
    """Expert e alone in transformers' experts module, float64, from its stored values (the reader keeps only the
    last expert read); ``sliced`` (the streamed pass measured the module computing an expert sliced as it does
    whole: engine.experts.slices_agree): computed a cache-sized slice at a time (engine.experts.SlicedExpert), as
    the streamed pass computes it, instead of from a whole float64 copy of the expert (DeepSeek V3's: 0.33 GiB
    beside the stored one, per expert a replay reads)."""
    meta = reader.meta_experts(layer)
    where = reader.site.path.format(layer=layer)
    config = reader.side.config

    def build(expert: int) -> nn.Module:
        routed = reader.routed(layer, reader.stored_expert(layer, expert), None)
        part = sliced_expert(meta, config, routed, where, torch.float64) if sliced else None
        return part if part is not None else expert_reference(meta, config, routed, where).experts.to(torch.float64)
    return build
