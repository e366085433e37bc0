"""Name the routing mistake behind a mixture-of-experts block that disagrees with transformers' block.

Each mistake that applies to the block (engine.routing_replays) is replayed on transformers' own sparse block for the
layer; the replay whose output reproduces the user's block within the tolerance, and clearly closer than the correct
block does, names the mistake; where two replays reproduce it equally both are named.  Where none alone does, two
mistakes made at once (DeepSeek-V3's inference Gate scoring with a softmax also skips the renormalisation) are
replayed together and named together.  Experts exchanged are replayed pairwise among the experts the mismatching
tokens use (every token routed only to other experts matches), so a block of 256 experts replays a handful of pairs,
not 32,640.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from parity.definitions.mistakes import MistakeId
from parity.engine.routing_parts import Parts, find_parts, outputs, routing_mask, stands_in
from parity.engine.routing_replays import Replay, paired, replays_of

CLEARLY = 4.0  # a replay names the mistake when the block is at least this x farther from the correct block
MAX_SUSPECTS = 12  # at most this many suspect experts are replayed pairwise (66 pairs)


def _flat(out, width: int) -> torch.Tensor:
    """A block's hidden output as [tokens, d] in float64 on the CPU (GPT-OSS and Llama 4 return a tuple; Llama 4
    flattens the tokens)."""
    hidden = outputs(out)[0]
    return hidden.detach().reshape(-1, width).cpu().double()


def _reference(parts: Parts, x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The correct block's output, and which experts it routed each token to."""
    captured: list = []
    hook = parts.router.register_forward_hook(lambda module, args, out: captured.append(out))
    try:
        out = _flat(parts.block(x), width)
    finally:
        hook.remove()
    return out, (routing_mask(captured[-1], parts) if captured else None)


def suspect_pairs(uses: torch.Tensor | None, wrong: torch.Tensor,
                  judged: torch.Tensor) -> list[tuple[int, int]] | None:
    """Pairs among the experts only mismatching tokens use (and experts no token uses): a token routed to
    neither of two exchanged experts comes out right.  None: no evidence narrows it (replay the default)."""
    if uses is None or not bool(wrong.any()):
        return None
    clean = uses[judged & ~wrong].any(0)
    suspects = ((uses[wrong].any(0) & ~clean) | ~uses.any(0)).nonzero().flatten().tolist()
    if not 2 <= len(suspects) <= MAX_SUSPECTS:
        return None
    return list(itertools.combinations(suspects, 2))


def _distance(block: nn.Module, replay: Replay, x: torch.Tensor, got: torch.Tensor, width: int,
              judged: torch.Tensor) -> float | None:
    """How far ``got`` is from the block run under ``replay``, over the judged tokens."""
    try:
        with replay.apply():
            out = _flat(block(x), width)
    except Exception:  # noqa: BLE001 - a replay the block cannot run (a top-k its router refuses) is not the mistake
        return None
    distance = (out - got)[judged].abs().max()
    return float(distance) if bool(torch.isfinite(distance)) else None


def name_mistake(block: nn.Module, x: torch.Tensor, got: torch.Tensor | tuple, *, tolerance: float,
                 tokens: torch.Tensor | None = None) -> list[tuple[MistakeId, str]]:
    """The routing mistakes whose replay on ``block`` (transformers' block for the layer, filled with its tensors)
    reproduces ``got``, the user's block's output on ``x``, each with its evidence in words (``replay_fits``)."""
    name = type(block).__name__
    return [(mistake, f"{detail}: the block's output is {distance:.3g} from this replay and {reference:.3g} from "
             f"transformers' {name} (tolerance {tolerance:.3g})")
            for mistake, detail, distance, reference in replay_fits(block, x, got, tolerance=tolerance, tokens=tokens)]


def replay_fits(block: nn.Module, x: torch.Tensor, got: torch.Tensor | tuple, *, tolerance: float,
                tokens: torch.Tensor | None = None, exchanged: Iterable[tuple[int, int]] | None = None
                ) -> list[tuple[MistakeId | str, str, float, float]]:
    """(id, what the replay changes, the output's distance from the replay, its distance from the correct block) of
    each replay reproducing ``got`` (``replay_search``'s ``fits``)."""
    return replay_search(block, x, got, tolerance=tolerance, tokens=tokens, exchanged=exchanged).fits


@dataclass
class Search:
    """What naming a block's mistake replayed and found."""

    fits: list[tuple[MistakeId | str, str, float, float]] = field(default_factory=list)
    tried: list[str] = field(default_factory=list)  # the ids replayed alone, each once, in order
    pairs: int = 0  # the pairs of mistakes replayed together (none where one alone fits)
    stopped: str = ""  # why some pairs were not replayed

    def untold(self) -> str:
        """What was replayed, for a failure none of it explains."""
        if not self.tried:
            return ""
        pairs = f"; {self.pairs} pairs of them in distinct places of the block, together" if self.pairs else ""
        return f"replayed alone: {', '.join(self.tried)}{pairs}{'; ' + self.stopped if self.stopped else ''}"


def replay_search(block: nn.Module, x: torch.Tensor, got: torch.Tensor | tuple, *, tolerance: float,
                  tokens: torch.Tensor | None = None, exchanged: Iterable[tuple[int, int]] | None = None) -> Search:
    """The replays reproducing ``got``: within ``tolerance`` (max abs) and at least CLEARLY times closer than the
    correct block is.  Closest first; those that fit equally (within CLEARLY of the closest, or all within tolerance /
    CLEARLY) are all returned.  Where no replay alone fits, two made at once (``paired``) are replayed, and those that
    fit named together; on a stand-in for the experts (``stands_in``) the pairs stop once they have built as many
    experts as the replays alone did.  No fits when the block agrees, no replay fits, or ``got`` is not the block's
    shape.  ``tokens``: a bool mask over the flattened tokens, the ones judged (near-tied tokens, whose choice of
    experts may flip legitimately, set aside).  ``exchanged``: the pairs of experts to replay exchanged, found from
    more tokens than ``x`` holds (default: ``suspect_pairs`` on ``x``'s own evidence)."""
    parts = find_parts(block)
    if parts is None:
        return Search()
    width, got = parts.width, outputs(got)[0]  # a block may return (hidden, router_logits)
    got = _flat(got, width) if isinstance(got, torch.Tensor) and got.numel() == x.numel() else None
    if got is None:
        return Search()
    stand_in = parts.experts if stands_in(parts.experts) else None
    with torch.no_grad():
        reference, uses = _reference(parts, x, width)
        judged = torch.ones(len(got), dtype=torch.bool) if tokens is None else tokens.reshape(-1).cpu()
        got = torch.where(judged[:, None], got, reference)  # a token set aside counts as agreeing
        wrong = (reference - got).abs().amax(-1) > tolerance
        reference_distance = float((reference - got).abs().max())
        if not reference_distance > tolerance:
            return Search()
        pairs = suspect_pairs(uses, wrong, judged) if exchanged is None else exchanged
        singles = replays_of(parts, pairs)
        search = Search(tried=list(dict.fromkeys(str(replay.id) for replay in singles)))
        reads = getattr(stand_in, "reads", 0)
        fits = _fitting(block, singles, x, got, width, judged, tolerance, reference_distance)
        if not fits:
            budget = getattr(stand_in, "reads", 0) - reads  # the experts the replays alone built
            reads += budget
            together = paired(singles)
            if stand_in is not None:  # each such pair runs the experts on new inputs: every expert chosen built again
                costly = [r for r in together if MistakeId.ROUTER_SCORE_ON_INPUT in str(r.id).split(" + ")]
                together = [r for r in together if r not in costly]
                if costly:
                    search.stopped = (f"the {len(costly)} pairs with {MistakeId.ROUTER_SCORE_ON_INPUT} not replayed "
                                      "around experts read on demand: each would build every expert it chooses again")
            for done, replay in enumerate(together):
                if stand_in is not None and stand_in.reads - reads > budget:
                    search.stopped = "; ".join(filter(None, [search.stopped, (
                        f"the other {len(together) - done} pairs not replayed: those replayed had built as many "
                        f"experts as the replays alone ({budget})")]))
                    break
                search.pairs += 1
                fits += _fitting(block, [replay], x, got, width, judged, tolerance, reference_distance, order=done)
    # replays that compute the same function (top-k before the softmax, and renormalising after it) land within float
    # noise of each other in either order: at or below tolerance / CLEARLY they are one distance, so the first named
    # is the same on every layer and seed instead of whichever rounding favoured
    fits.sort(key=lambda fit: (max(fit[0], tolerance / CLEARLY), fit[1]))
    bound = max(min(distance for distance, _, _ in fits) * CLEARLY, tolerance / CLEARLY) if fits else 0.0
    search.fits = [(replay.id, replay.detail, distance, reference_distance)
                   for distance, _, replay in fits if distance <= bound]
    return search


def _fitting(block: nn.Module, replays: list[Replay], x: torch.Tensor, got: torch.Tensor, width: int,
             judged: torch.Tensor, tolerance: float, reference_distance: float, *, order: int = 0
             ) -> list[tuple[float, int, Replay]]:
    """(distance, order, replay) of each of ``replays`` within ``tolerance`` of ``got`` and CLEARLY closer than the
    correct block."""
    fits = []
    for at, replay in enumerate(replays, start=order):
        distance = _distance(block, replay, x, got, width, judged)
        if distance is not None and distance <= tolerance and distance * CLEARLY <= reference_distance:
            fits.append((distance, at, replay))
    return fits
