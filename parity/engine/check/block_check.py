"""`parity CKPT --target mymodel:MoEBlock`: a user's whole sparse block against transformers' block, layer by layer.

The unit is the block (router, top-k, weights, experts, shared experts and their gate) instead of one expert at a
time (engine.check.session).  transformers' block for the layer, filled with its tensors, runs in float64 (the truth,
with whatever transformers itself keeps in float32: DeepSeek's router) and float32 (the noise floor); the user's
block runs twice in float32 on the same inputs (engine.block.block_inputs).  Tokens whose choice of experts moves
within float32 noise are set aside: the verdict is on the others, and the report counts them and says whether the
block's output on them matches one of the choices transformers' block makes there.
"""

from __future__ import annotations

import gc
import math
from typing import Any

import torch
from torch import nn

from parity.definitions.mistakes import Candidate, Diagnosis, MistakeId, diagnosis
from parity.engine.block import (
    BLOCK_UNIT,
    NUDGE,
    BlockInputs,
    BlockSite,
    block_inputs,
    block_output,
    block_tensors,
    filled_block,
    fused_experts,
    reference_block,
)
from parity.engine.check.block_fill import fill_block
from parity.engine.check.build import build_target
from parity.engine.check.fill import route_tensor
from parity.engine.check.guard import guarded
from parity.engine.check.run import place, run_module, skip_init, user_code
from parity.engine.results import LayerResult
from parity.engine.routing_mistakes import replay_fits
from parity.engine.verdict import Runs, judge, shape_failure
from parity.errors import ShapeMismatchError, TargetError


class BlockCheck:
    """The block units of a session whose layout has routed experts (``session.mapping.experts``)."""

    def __init__(self, session: Any):
        self.session = session
        self.mapping = session.mapping
        self.site = BlockSite.of(session.mapping.reference_module)
        self.sources: dict[str, str] = {}  # how the user's block was filled (its first layer), for the report
        self.target_notes: list[str] = []
        self.stored: dict[str, torch.dtype] = {}  # the last layer read: each tensor's dtype as stored
        self.skipped: list[int] = []  # layers selected that hold no sparse block (dense ones before MoE ones)

    def units(self, layer: int) -> list[tuple[BlockCheck, None]]:
        """The layer's one block unit; none for a layer without a sparse block (recorded: the report says so)."""
        if self.mapping.serves(layer):
            return [(self, None)]
        self.skipped.append(layer)
        return []

    def describe_report(self, report: Any) -> None:
        """The report names the unit checked: transformers' block class, and what a block unit covers."""
        probe = self.session.reference.meta_module(self.site.path.format(layer=self.mapping.first_layer))
        report.reference = f"{type(probe).__name__} (whole sparse block)"
        report.units = [BLOCK_UNIT]
        report.reference_routes = None  # one expert's routes into the experts module: not how the block is filled
        report.notes.append("each MoE layer's whole sparse block is checked as one unit 'block' (router, top-k, "
                            "routing weights, experts, shared experts and their gate) against transformers' "
                            f"{type(probe).__name__}; --experts checks one expert at a time instead")

    def note_skipped(self, report: Any) -> None:
        if self.skipped:
            report.notes.append(f"layers {', '.join(map(str, self.skipped))} hold no sparse block (dense FFN): not "
                                "checked by a block target; check them with a target of their FFN")

    def describe(self) -> dict | None:
        """How the user's block was filled: its parameter -> the tensor it got (report.routes)."""
        if not self.sources:
            return None
        return {"inferred": True, "extends": f"derived from transformers' {self.site.path} (whole block)",
                "args": None, "tensors": dict(self.sources)}

    def describe_framework(self, report: Any) -> None:
        """Block targets are torch modules: nothing to add."""

    def layer_tensors(self, layer: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor],
                                                 list[dict[str, torch.Tensor]]]:
        """(transformers' names -> tensor, the checkpoint's names relative to the block -> tensor, each expert's
        gate/up/down/biases [out, in]), all float64; ``self.stored`` then holds each of transformers' names' stored
        dtype (an expert's: its gate's)."""
        session = self.session
        keys = block_tensors(session.checkpoint, session.reference.skeleton, self.site.at(layer), layer)
        stored = session.checkpoint.read(list(keys.values()))
        self.stored = {name: stored[key].dtype for name, key in keys.items()}
        own = {name: stored[key].double() for name, key in keys.items()}
        prefix = _disk_prefix(keys)
        disk = {key.removeprefix(prefix): own[name] for name, key in keys.items()}
        experts = []
        for expert in range(session.num_experts):
            tensors = session.read_layer(layer, expert, dtype=None)
            routed = {r.target: route_tensor(r, tensors[r.source]) for r in session.reader.reference_routes(layer)}
            experts.append({role: tensor.double() for role, tensor in routed.items()})
            if not session.mapping.experts.stacked and prefix:
                base = session.mapping.layer_prefix(layer, expert).removeprefix(prefix)
                disk |= {f"{base}.{source}": tensor.double() for source, tensor in tensors.items()}
        meta = session.reference.meta_module(f"{self.site.path}.{self.site.experts}".format(layer=layer))
        fused = fused_experts(meta, experts, self.site.path.format(layer=layer))
        own |= {f"{self.site.experts}.{n}": t for n, t in fused.items()}
        self.stored |= {f"{self.site.experts}.{n}": routed["gate"].dtype for n in fused}
        return own, disk, experts

    def run_layer(self, layer: int, expert: None = None) -> tuple[LayerResult, str]:
        session = self.session
        own, disk, experts = self.layer_tensors(layer)
        path = self.site.path.format(layer=layer)
        meta_block = session.reference.meta_module(path)
        with reference_block(type(meta_block).__name__, layer):
            block64 = filled_block(meta_block, self.site, own, torch.float64)
            block32 = filled_block(meta_block, self.site, own, torch.float32)
            inputs = block_inputs(block64, block32, self.site, [e["gate"] for e in experts], seed=session.seed,
                                  layer=layer)
            out64 = block_output(block64, inputs.x.double())
            out32 = block_output(block32, inputs.x).double()
        changes: list[str] = []
        try:
            target, name = self.build(layer, own, disk, experts, changes)
        except ShapeMismatchError as exc:  # the block's own sizes do not hold the layer: its mistake, not bad input
            result = shape_failure(layer, None, exc, session.checkpoint.weights)
            result.unit = BLOCK_UNIT
            return result, session.target_name()
        got, again = (self.run_target(target, name, inputs.x, changes) for _ in range(2))
        del target, block32
        gc.collect()
        kept = ~inputs.tied
        runs = Runs(*(t.reshape(-1, t.shape[-1])[kept].unsqueeze(0) for t in (out64, out32, got, again)))
        result = judge(layer, None, runs, own, None, session.atol, session.checkpoint.weights)
        result.unit = BLOCK_UNIT
        result.coverage = inputs.coverage() | {"set_aside_agree": self.agreeing(block64, inputs, got,
                                                                                result.tolerance)}
        if not bool(kept.any()):
            result.passed = False
            result.unverifiable = ("every token's choice of experts moves within float32 noise: no token decides "
                                   "the routing, so no output can be judged")
        if not result.passed and result.unverifiable is None and result.diagnosis is None and session.diagnose:
            result.diagnosis = named_mistake(block64, inputs.x.double(), got, result, kept)
        if changes:
            result.passed = False
            result.diagnosis = diagnosis(MistakeId.GLOBAL_STATE_MODIFIED, None, None, "; ".join(changes[:6]))
        return result, name

    def build(self, layer: int, own: dict, disk: dict, experts: list, changes: list[str]) -> tuple[nn.Module, str]:
        """The user's block, built from the checkpoint's config and filled with the layer's tensors (float32)."""
        session = self.session
        with guarded(changes), skip_init(), user_code(f"target {session.target_name()} could not be built"):
            module, name, _, _ = build_target(session.mapping, session.config, session.target_spec)
            place(module, torch.device("cpu"), None)
        with guarded(changes), user_code(f"target {name} could not be filled with layer {layer}'s block",
                                         exceptions=False):
            spellings = {"transformers": {n: t.float() for n, t in own.items()},
                         "checkpoint": {n: t.float() for n, t in disk.items()}}
            sources = fill_block(module, spellings, lambda e: {k: v.float() for k, v in experts[e].items()},
                                 len(experts), f"target {name}")
        self.sources = self.sources or sources
        return module.eval(), name

    def run_target(self, target: nn.Module, name: str, x: torch.Tensor, changes: list[str]) -> torch.Tensor:
        """The user's block on its own copy of ``x``, shaped like ``x`` (a tuple's first element; [batch·tokens, d]
        reshaped, as transformers' Llama 4 block returns it)."""
        with torch.no_grad(), guarded(changes), \
                user_code(f"target {name} failed on an input of shape {list(x.shape)}"):
            out = run_module(target, x.clone())
        if out.numel() != x.numel():
            raise TargetError(f"target {name}: forward on an input of shape {list(x.shape)} returned shape "
                              f"{list(out.shape)}; transformers' block returns {list(x.shape)}")
        return out.reshape(x.shape)

    def agreeing(self, block64: nn.Module, inputs: BlockInputs, got: torch.Tensor, tolerance: float | None) -> int:
        """How many set-aside tokens the user's block computes as transformers' block does for one of the choices
        float32 noise allows (its output on the inputs nudged by NUDGE)."""
        tied = inputs.tied
        if not bool(tied.any()) or tolerance is None:
            return 0
        flat = got.reshape(-1, got.shape[-1])[tied]
        generator = torch.Generator().manual_seed(7)
        best = torch.full((int(tied.sum()),), float("inf"), dtype=torch.float64)
        for _ in range(4):
            moved = inputs.x.double() * (1 + NUDGE * torch.randn(inputs.x.shape, generator=generator,
                                                                  dtype=torch.float64))
            out = block_output(block64, moved).reshape(-1, got.shape[-1])[tied]
            best = torch.minimum(best, (flat - out).abs().amax(-1))
        return int((best <= 2 * tolerance).sum())


def _disk_prefix(keys: dict[str, str]) -> str:
    """The checkpoint's prefix of the block ('model.layers.1.block_sparse_moe.'), read off a tensor whose stored
    name ends in its name in transformers' block; '' where none does."""
    for name, key in keys.items():
        if key.endswith("." + name):
            return key[: -len(name)]
    return ""



def holds_block(session: Any) -> bool:
    """Whether the session's target holds more than one expert's tensors: a whole block, not an expert's FFN.  Its
    constructor runs once here on the meta device (nothing allocated)."""
    shapes = session.reference.tensor_shapes(session.mapping.reference_path(session.mapping.first_layer))
    one_expert = sum(math.prod(shape[1:]) for shape in shapes.values())
    try:
        with torch.device("meta"), skip_init():
            module, _, _, _ = build_target(session.mapping, session.config, session.target_spec)
    except Exception:  # its own errors surface where the target is built for real, in the user's terms
        return False
    if not isinstance(module, nn.Module):
        return False
    count, d = session.num_experts, session.hidden_size
    router = any(tuple(p.shape) in ((count, d), (d, count)) for p in module.parameters())  # an [E, d] router
    return router or sum(p.numel() for p in module.parameters()) > 1.5 * one_expert


def named_mistake(block64: nn.Module, x: torch.Tensor, got: torch.Tensor, result: LayerResult,
                  kept: torch.Tensor) -> Diagnosis:
    """The routing mistake whose replay on transformers' block reproduces the user's output (engine.routing_mistakes);
    replays that fit equally are all said, each a candidate with its distance; none fitting is ``unexplained``."""
    found = replay_fits(block64, x, got, tolerance=result.tolerance, tokens=kept)
    if not found:
        return diagnosis(MistakeId.UNEXPLAINED, None, result.max_abs_diff)
    first, detail, distance, reference = found[0]
    equally = "; ".join(f"equally {other}: {why}" for other, why, _, _ in found[1:])
    return diagnosis(first, distance, reference, detail + (f"; {equally}" if equally else ""),
                     [Candidate(str(mistake), why, fit) for mistake, why, fit, _ in found])
