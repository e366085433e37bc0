"""Naming the mistake of a block too large to hold (engine.check.block_check's streamed blocks).

A held block's mistakes are replayed on transformers' block whole (engine.routing_mistakes).  A streamed block's
experts are never held together, so its replays run on a few of the tokens where the user's block failed, around
``ExpertsOnDemand``: a stand-in for the experts module that computes each (token, expert) pair the block asks for
from that expert's stored values, read one expert at a time through the same reader the streamed pass uses, and
keeps each pair's output, so that replays choosing the same experts do not read them again.  Every replay the held
block gets runs: those that change the routing, or where the score is applied, change what the block asks of the
stand-in; those inside an expert (a clamp, alpha, up + 1, gate and up exchanged or their layout misread) change each
expert it builds, their pairs kept apart.  Two mistakes at once (where none alone fits) are replayed the same way,
but for those with the score on the experts' input, which run every expert chosen on new inputs.  The verdict on
the few tokens uses the held path's rule and tolerance (routing_mistakes.replay_search, from
block_check.streamed_mistake).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from parity.engine.experts import SlicedExpert, expert_reference, sliced_expert

REPLAY_TOKENS = 8  # a streamed block's mistakes are replayed on this many of the tokens where it failed


class ExpertsOnDemand(nn.Module):
    """transformers' experts module of a streamed block, each (token, expert) pair computed when asked for, in
    float64: ``build(e)`` is expert e alone in transformers' experts module (built from its stored values, dropped
    once its pairs are computed); a pair's output (at routing weight 1) is kept by the replay it was computed under,
    the token's values and the expert computed, so another replay choosing it again costs nothing.  ``reads`` counts
    the experts built.  Its ``exchanged`` and ``each`` make it a stand-in engine.routing_replays replays on
    (``stands_in``): the routing replays change what the block asks of it, the replays inside an expert change each
    expert it builds (``each``), their settings read off ``template`` (the layer's experts module, on the meta
    device).  ``routed``: the block hands it each token's chosen experts and their weights; otherwise (Llama 4's) its
    tokens repeated once per expert, scaled by the routing weight, zero where the expert is not chosen (such a row's
    output is zero, as the streamed pass computes it: engine.block.streamed)."""

    def __init__(self, count: int, build: Callable[..., nn.Module], *, template: nn.Module | None = None,
                 routed: bool = True):
        super().__init__()
        self.num_experts, self.build = count, build
        self.templates, self.routed = (template,), routed  # in a tuple: not a submodule (none of the block's values)
        self.order = list(range(count))  # an exchange replay: asked for one expert, compute the other
        self.cache: dict[tuple[str, bytes, int], torch.Tensor] = {}
        self.reads = 0
        self.key: str | None = ""  # the replay the pairs are computed under ("": none; None: a probe, not kept)
        self.change: Callable[[nn.Module], contextlib.AbstractContextManager] | None = None
        self.stored: Callable[[dict], dict] | None = None  # ``each``

    @property
    def template(self) -> nn.Module | None:
        return self.templates[0]

    @contextlib.contextmanager
    def exchanged(self, first: int, second: int) -> Iterator[None]:
        self.order[first], self.order[second] = second, first
        try:
            yield
        finally:
            self.order = list(range(self.num_experts))

    @contextlib.contextmanager
    def each(self, key: str | None, change: Callable[[nn.Module], contextlib.AbstractContextManager] | None = None,
             *, stored: Callable[[dict], dict] | None = None) -> Iterator[None]:
        """Every expert built runs under ``change(module)`` (a replay inside an expert, acting on each intermediate
        unit alone: on each slice of an expert computed sliced), or is built from its stored tensors rearranged by
        ``stored`` (one that moves rows between units); its pairs kept under ``key``, apart from the correct
        experts' (None: not kept, so a probe sees every expert it asks for run)."""
        self.key, self.change, self.stored = key, change, stored
        try:
            yield
        finally:
            self.key, self.change, self.stored = "", None, None

    def changed(self, module: nn.Module) -> contextlib.AbstractContextManager:
        """``module`` (one expert built) under the active replay's change: on each slice of a sliced expert."""
        if self.change is None:
            return contextlib.nullcontext()
        return module.under(self.change) if isinstance(module, SlicedExpert) else self.change(module)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The experts' output for what the block hands them, (tokens, chosen experts, their weights), positional
        or by any names (as engine.block.experts_call reads the call); or (tokens repeated per expert and scaled,)."""
        tensors = [a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)]
        if not self.routed:
            return self.per_expert(tensors[0])
        hidden, index, weights = tensors[:3]
        if index.is_floating_point():
            index, weights = weights, index
        flat = hidden.detach().reshape(-1, hidden.shape[-1]).double()
        index = index.reshape(len(flat), -1).long()
        weights = weights.reshape(len(flat), -1).double()
        pairs = [(token, slot, self.order[int(e)]) for token in range(len(flat))
                 for slot, e in enumerate(index[token].tolist()) if 0 <= e < self.num_experts]
        outs = self.compute(flat, {(token, expert) for token, _, expert in pairs})
        out = torch.zeros_like(flat)
        for token, slot, expert in pairs:
            out[token] += weights[token, slot] * outs[(token, expert)]
        return out.to(hidden.dtype).reshape(hidden.shape)

    def per_expert(self, hidden: torch.Tensor) -> torch.Tensor:
        """[count x tokens, d]: each expert's block of rows computed by that expert, its zero rows left zero."""
        flat = hidden.detach().reshape(-1, hidden.shape[-1]).double()
        rows = len(flat) // self.num_experts
        pairs = [(row, self.order[row // rows]) for row in range(len(flat)) if bool(flat[row].ne(0).any())]
        outs = self.compute(flat, set(pairs))
        out = torch.zeros_like(flat)
        for pair in pairs:
            out[pair[0]] = outs[pair]
        return out.to(hidden.dtype).reshape(hidden.shape)

    def compute(self, flat: torch.Tensor, wanted: set[tuple[int, int]]) -> dict[tuple[int, int], torch.Tensor]:
        """Each (row, expert) pair's output, computing those not kept yet: each expert built once for all the rows
        that need it, one expert at a time (under the replay's ``change``, where one is active)."""
        keys = {row: hashlib.blake2b(flat[row].contiguous().numpy().tobytes(), digest_size=16).digest()
                for row, _ in wanted}
        found = {(row, e): self.cache[(self.key, keys[row], e)] for row, e in wanted
                 if self.key is not None and (self.key, keys[row], e) in self.cache}
        missing: dict[int, list[int]] = {}
        for row, expert in sorted(set(wanted) - set(found)):
            missing.setdefault(expert, []).append(row)
        for expert, rows in sorted(missing.items()):
            module = self.build(expert, stored=self.stored)
            self.reads += 1
            with torch.no_grad(), self.changed(module):
                outs = self.run(module, flat[rows])
            del module
            for row, out in zip(rows, outs, strict=True):
                found[(row, expert)] = out.double()
                if self.key is not None:
                    self.cache[(self.key, keys[row], expert)] = found[(row, expert)]
        return found

    def run(self, module: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        """One expert's module on its rows: every row routed to it at weight 1, or (not ``routed``) the rows alone."""
        if not self.routed:
            return module(rows)
        return module(rows, torch.zeros(len(rows), 1, dtype=torch.long), torch.ones(len(rows), 1, dtype=rows.dtype))


def failing_tokens(out64: torch.Tensor, got: torch.Tensor, kept: torch.Tensor, tolerance: float) -> torch.Tensor:
    """The flattened indices of at most REPLAY_TOKENS judged tokens where the user's block is farthest from the
    truth beyond ``tolerance`` (the worst first)."""
    width = out64.shape[-1]
    error = (got.double().reshape(-1, width) - out64.reshape(-1, width)).abs().amax(-1)
    error = torch.where(kept & (error > tolerance), error, torch.full_like(error, -1.0))
    order = error.argsort(descending=True)[:REPLAY_TOKENS]
    return order[error[order] > 0]


def expert_builder(reader: Any, layer: int, *, sliced: bool = False) -> Callable[..., nn.Module]:
    """Expert e alone in transformers' experts module, float64, from its stored values (the reader keeps only the
    last expert read); ``sliced`` (the streamed pass measured the module computing an expert sliced as it does
    whole: engine.experts.slices_agree): computed a cache-sized slice at a time (engine.experts.SlicedExpert), as
    the streamed pass computes it, instead of from a whole float64 copy of the expert (DeepSeek V3's: 0.33 GiB
    beside the stored one, per expert a replay reads)."""
    meta = reader.meta_experts(layer)
    where = reader.site.path.format(layer=layer)
    config = reader.side.config

    def build(expert: int, *, stored: Callable[[dict], dict] | None = None) -> nn.Module:
        routed = reader.routed(layer, reader.stored_expert(layer, expert), None)
        routed = routed if stored is None else stored(routed)
        part = sliced_expert(meta, config, routed, where, torch.float64) if sliced else None
        return part if part is not None else expert_reference(meta, config, routed, where).experts.to(torch.float64)
    return build
