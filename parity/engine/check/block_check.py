"""`parity CKPT --target mymodel:MoEBlock`: a user's whole sparse block against transformers' block, layer by layer.

The unit is the block (router, top-k, weights, experts, shared experts and their gate) instead of one expert at a
time (engine.check.session).  transformers' block for the layer, filled with its tensors, runs in float64 (the truth,
with whatever transformers itself keeps in float32: DeepSeek's router) and float32 (the noise floor); the user's
block runs twice in float32 on the same inputs (engine.block.block_inputs).  Tokens whose choice of experts moves
within float32 noise are set aside: the verdict is on the others, and the report counts them and says whether the
block's output on them matches one of the choices transformers' block makes there.
"""

from __future__ import annotations

import functools
import gc
import math
from collections.abc import Callable
from collections.abc import Mapping as MappingABC
from typing import Any

import torch
from torch import nn

from parity.definitions.mistakes import Candidate, Diagnosis, MistakeId, diagnosis
from parity.engine.block import (
    BLOCK_UNIT,
    NUDGE,
    BlockInputs,
    BlockSite,
    Precomputed,
    block_inputs,
    block_output,
    block_tensors,
    chosen_in,
    experts_call,
    filled_block,
    first_projection,
    fused_experts,
    gate_reach,
    reference_block,
    streamed,
)
from parity.engine.check.block_fill import fill_block
from parity.engine.check.build import build_target
from parity.engine.check.fill import route_tensor
from parity.engine.check.guard import guarded
from parity.engine.check.run import place, run_module, skip_init, user_code
from parity.engine.experts import expert_reference
from parity.engine.results import LayerResult
from parity.engine.routing_mistakes import replay_fits
from parity.engine.verdict import Runs, judge, shape_failure
from parity.errors import ShapeMismatchError, TargetError

HELD_BYTES = 2 * 2**30  # a block whose experts take more in float64 is streamed: one expert held at a time
REACH_SAMPLE = 4  # a streamed block's inputs are scaled on this many experts' gates
REPEAT_TOKENS = 2  # a streamed block's determinism is checked on this many tokens, run twice
LARGE_UNEXPLAINED = ("this block is too large to hold whole, so no routing mistake was replayed on it; check a smaller "
                     "layer of the same family, or one expert at a time (--experts)")


class BlockCheck:
    """The block units of a session whose layout has routed experts (``session.mapping.experts``)."""

    def __init__(self, session: Any):
        self.session = session
        self.mapping = session.mapping
        self.site = BlockSite.of(session.mapping.reference_module)
        self.sources: dict[str, str] = {}  # how the user's block was filled (its first layer), for the report
        self.target_notes: list[str] = []
        self.stored: dict[str, torch.dtype] = {}  # the last layer read: each tensor's dtype as stored
        self.keys: dict[str, str] = {}  # the last layer read: the block's own names -> the checkpoint's keys
        self._last: tuple = (None, {})  # the last expert read, as stored
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

    def layer_tensors(self, layer: int, *, wanted: bool = True) -> tuple[MappingABC, MappingABC, list[dict]]:
        """(transformers' names -> tensor, the checkpoint's names relative to the block -> tensor, each expert's
        gate/up/down/biases [out, in] float64 (``wanted``; else [] and each expert read only when asked for));
        ``self.stored`` then holds each of transformers' names' stored dtype (the fused experts': an expert's)."""
        session = self.session
        keys = block_tensors(session.checkpoint, session.reference.skeleton, self.site.at(layer), layer)
        stored = session.checkpoint.read(list(keys.values()))
        self.keys = keys
        self.stored = {name: stored[key].dtype for name, key in keys.items()}
        own = {name: stored[key].double() for name, key in keys.items()}
        stacked = self.stacked_keys(layer)
        prefix = _disk_prefix(keys, stacked)
        disk: dict[str, Callable[[], torch.Tensor]] = {key.removeprefix(prefix): _given(own[name])
                                                       for name, key in keys.items()}
        disk |= {key.removeprefix(prefix): functools.partial(self.stored_stack, key) for key in stacked}
        if not session.mapping.experts.stacked and prefix:  # a port may use the checkpoint's own per-expert names
            for expert in range(session.num_experts):
                base = session.mapping.layer_prefix(layer, expert).removeprefix(prefix)
                for source in self.stored_expert(layer, 0):
                    disk[f"{base}.{source}"] = functools.partial(self.stored_tensor, layer, expert, source)
        meta = self.meta_experts(layer)
        where = self.site.path.format(layer=layer)
        experts = [self.expert(layer, e) for e in range(session.num_experts)] if wanted else []
        fused = {f"{self.site.experts}.{n}" for n in meta.state_dict()}
        self.stored |= dict.fromkeys(fused, next(iter(self.stored_expert(layer, 0).values())).dtype)
        if experts:
            own |= {f"{self.site.experts}.{n}": t for n, t in fused_experts(meta, experts, where).items()}
            return own, Lazy(disk), experts
        every = functools.cache(functools.partial(self.fused, layer, meta, where))  # too large: only if asked for
        return Lazy({**{n: _given(t) for n, t in own.items()},
                     **{n: functools.partial(lambda n: every()[n.split(".")[-1]], n) for n in fused}}), Lazy(disk), []

    def stacked_keys(self, layer: int) -> list[str]:
        """The checkpoint keys of the layer's experts stacked as stored ([E, ...] each), for a port holding them under
        the checkpoint's names; [] where each expert is stored apart."""
        stacked = self.session.mapping.experts.stacked or ()
        keys = [f"{self.session.mapping.layer_prefix(layer)}.{source}" for source in stacked]
        return [key for key in keys if key in self.session.checkpoint.weight_map]

    def stored_stack(self, key: str) -> torch.Tensor:
        """Every expert's tensor as the checkpoint stacks them, float64 (read only when a port asks for it)."""
        return self.session.checkpoint.read([key])[key].double()

    def stored_expert(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """One expert's tensors as stored, under the checkpoint's names (the last one read is kept)."""
        if self._last[0] != (layer, expert):
            self._last = ((layer, expert), self.session.read_layer(layer, expert, dtype=None))
        return self._last[1]

    def stored_tensor(self, layer: int, expert: int, source: str) -> torch.Tensor:
        return self.stored_expert(layer, expert)[source].double()

    def expert(self, layer: int, expert: int, *, dtype: torch.dtype | None = torch.float64) -> dict[str, torch.Tensor]:
        """One expert's gate, up, down (and biases) [out, in], in ``dtype`` (``routed``)."""
        return self.routed(layer, self.stored_expert(layer, expert), dtype)

    def routed(self, layer: int, stored: dict[str, torch.Tensor], dtype: torch.dtype | None
               ) -> dict[str, torch.Tensor]:
        """An expert's tensors as stored -> its gate, up, down (and biases) [out, in] in ``dtype`` (None: as stored,
        for a copy made in the dtype wanted straight from the stored values: one pass, no float64 copy on the way
        to float32; exact either way, every stored float dtype converting exactly into float64)."""
        return {r.target: route_tensor(r, stored[r.source]) if dtype is None else
                route_tensor(r, stored[r.source]).to(dtype) for r in self.session.reader.reference_routes(layer)}

    def fused(self, layer: int, meta: nn.Module, where: str) -> dict[str, torch.Tensor]:
        """Every expert stacked in transformers' fused layout (for a port holding them so)."""
        return fused_experts(meta, (self.expert(layer, e) for e in range(self.session.num_experts)), where)

    def run_layer(self, layer: int, expert: None = None) -> tuple[LayerResult, str]:
        session = self.session
        path = self.site.path.format(layer=layer)
        meta_block = session.reference.meta_module(path)
        large = self.experts_bytes(layer) > HELD_BYTES
        own, disk, experts = self.layer_tensors(layer, wanted=not large)
        with reference_block(type(meta_block).__name__, layer):
            truth = (self.streamed_truth if large else self.held_truth)(layer, meta_block, own, experts)
        block64, inputs, out64, out32 = truth
        changes: list[str] = []
        try:
            target, name = self.build(layer, own, disk, experts, changes)
        except ShapeMismatchError as exc:  # the block's own sizes do not hold the layer: its mistake, not bad input
            result = shape_failure(layer, None, exc, session.checkpoint.weights)
            result.unit = BLOCK_UNIT
            return result, session.target_name()
        got = self.run_target(target, name, inputs.x, changes)
        # determinism: a second identical run; a streamed block's reads all its experts again, so it is two on a few
        # tokens instead (what a dropout or a train-mode switch moves shows on any token)
        few = inputs.x[:1, :REPEAT_TOKENS]
        repeated = tuple(self.run_target(target, name, few, changes) for _ in range(2)) if large else None
        again = got if large else self.run_target(target, name, inputs.x, changes)
        del target
        gc.collect()
        kept = ~inputs.tied
        runs = Runs(*(t.reshape(-1, t.shape[-1])[kept].unsqueeze(0) for t in (out64, out32, got, again)),
                    repeated=repeated)
        weights = _judged_weights(own, self.site.experts, large=large)
        result = judge(layer, None, runs, weights, None, session.atol, session.checkpoint.weights)
        result.unit = BLOCK_UNIT
        agree = 0 if large else self.agreeing(block64, inputs, got, out32, result.tolerance)
        result.coverage = inputs.coverage() | {"set_aside_agree": agree}
        if not bool(kept.any()):
            result.passed = False
            result.unverifiable = ("every token's choice of experts moves within float32 noise: no token decides "
                                   "the routing, so no output can be judged")
        if not result.passed and result.unverifiable is None and result.diagnosis is None and session.diagnose:
            result.diagnosis = (diagnosis(MistakeId.UNEXPLAINED, None, result.max_abs_diff, LARGE_UNEXPLAINED)
                                if large else named_mistake(block64, inputs.x.double(), got, result, kept))
        if changes:
            result.passed = False
            result.diagnosis = diagnosis(MistakeId.GLOBAL_STATE_MODIFIED, None, None, "; ".join(changes[:6]))
        return result, name

    def meta_experts(self, layer: int) -> nn.Module:
        """transformers' experts module of the layer's block, on the meta device."""
        return self.session.reference.meta_module(f"{self.site.path}.{self.site.experts}".format(layer=layer))

    def experts_bytes(self, layer: int) -> int:
        """The float64 size of the layer's experts held at once (transformers' fused parameters)."""
        return 8 * sum(t.numel() for t in self.meta_experts(layer).state_dict().values())

    def held_truth(self, layer: int, meta_block: nn.Module, own: dict, experts: list) -> tuple:
        """(block64, inputs, out64, out32): transformers' block holding every expert, run whole."""
        block64, block32 = (filled_block(meta_block, self.site, own, dtype) for dtype in (torch.float64, torch.float32))
        reach = gate_reach(lambda: enumerate(first_projection(e) for e in experts))
        inputs = block_inputs(block64, block32, self.site, reach, count=len(experts), d=self.session.hidden_size,
                              seed=self.session.seed, layer=layer)
        return block64, inputs, block_output(block64, inputs.x.double()), block_output(block32, inputs.x).double()

    def streamed_truth(self, layer: int, meta_block: nn.Module, own: dict, _experts: list) -> tuple:
        """(block64, inputs, out64, out32) of a block too large to hold: transformers' block runs its routing and
        shared experts around a ``Precomputed`` stand-in; each expert is read and run once, for both dtypes
        (engine.block.streamed), the inputs' scale measured on a few of them."""
        session, count = self.session, self.session.num_experts
        block64, block32 = (filled_block(meta_block, self.site, own, dtype, experts=Precomputed())
                            for dtype in (torch.float64, torch.float32))
        sample = [(e, first_projection(self.expert(layer, e, dtype=torch.float32)))
                  for e in range(min(REACH_SAMPLE, count))]
        reach = gate_reach(lambda: sample)
        inputs = block_inputs(block64, block32, self.site, reach, count=count, d=session.hidden_size,
                              seed=session.seed, layer=layer)
        sample.clear()  # REACH_SAMPLE experts' gates in float32: not held through the streamed pass
        x64 = inputs.x.double()
        calls = [experts_call(block64, self.site, x64), experts_call(block32, self.site, inputs.x)]
        meta = self.meta_experts(layer)
        where = self.site.path.format(layer=layer)
        used = [e for e in range(count) if any(bool(chosen_in(call, count)[:, e].any()) for call in calls)]
        with ReadAhead(functools.partial(self.stored_expert, layer), used) as ahead:
            outs = streamed(calls, count, lambda e, dtype, last: expert_reference(
                meta, session.config, self.routed(layer, ahead(e, last=last), None), where).experts.to(dtype))
        out = []
        for block, x, call_out in ((block64, x64, outs[0]), (block32, inputs.x, outs[1])):
            block.get_submodule(self.site.experts).outputs = [call_out]
            out.append(block_output(block, x).double())
        return block64, inputs, out[0], out[1]

    def build(self, layer: int, own: dict, disk: dict, experts: list, changes: list[str]) -> tuple[nn.Module, str]:
        """The user's block, built from the checkpoint's config and filled with the layer's tensors (float32)."""
        session = self.session
        with guarded(changes), skip_init(), user_code(f"target {session.target_name()} could not be built"):
            module, name, _, _ = build_target(session.mapping, session.config, session.target_spec)
            place(module, torch.device("cpu"), None)
        with guarded(changes), user_code(f"target {name} could not be filled with layer {layer}'s block",
                                         exceptions=False):
            sources = fill_block(module, {"transformers": own, "checkpoint": disk},
                                 lambda e: experts[e] if experts else self.expert(layer, e),
                                 self.session.num_experts, f"target {name}")
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

    def agreeing(self, block64: nn.Module, inputs: BlockInputs, got: torch.Tensor, out32: torch.Tensor,
                 tolerance: float | None) -> int:
        """How many set-aside tokens the user's block computes as transformers' block does for one of the choices
        float32 noise allows: its float32 run's, or its float64 run's on the inputs nudged by NUDGE."""
        tied = inputs.tied
        if not bool(tied.any()) or tolerance is None:
            return 0
        width = got.shape[-1]
        flat = got.reshape(-1, width)[tied]
        best = (flat - out32.reshape(-1, width)[tied]).abs().amax(-1)
        generator = torch.Generator().manual_seed(7)
        for _ in range(4):
            moved = inputs.x.double() * (1 + NUDGE * torch.randn(inputs.x.shape, generator=generator,
                                                                  dtype=torch.float64))
            out = block_output(block64, moved).reshape(-1, width)[tied]
            best = torch.minimum(best, (flat - out).abs().amax(-1))
        return int((best <= 2 * tolerance).sum())


class ReadAhead:
    """A streamed block's experts as stored, in the order they are used, each read by a worker thread while the one
    before it is computed: a block larger than memory waits on the disk for every expert, and that wait overlaps the
    computing instead of adding to it.  The next read starts at an expert's last use (its float32 run: the float64
    copy, the largest, is gone by then), so the peak grows by one expert's stored size at most."""

    def __init__(self, read: Callable[[int], dict[str, torch.Tensor]], order: list[int]):
        from concurrent.futures import ThreadPoolExecutor

        self.read, self.next = read, dict(zip(order, order[1:], strict=False))
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="parity-read-ahead")
        self.pending: dict[int, Any] = {}
        self.current: tuple[int | None, dict[str, torch.Tensor]] = (None, {})

    def __enter__(self) -> ReadAhead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    def __call__(self, expert: int, *, last: bool = True) -> dict[str, torch.Tensor]:
        """Expert ``expert``'s tensors (asked for again: the same ones); at its ``last`` use the next one's read is
        started."""
        if self.current[0] != expert:
            future = self.pending.pop(expert, None) or self.pool.submit(self.read, expert)
            self.current = (None, {})  # the previous expert's tensors are let go before this one's arrive
            self.current = (expert, future.result())
        following = self.next.get(expert)
        if last and following is not None and following not in self.pending:
            self.pending[following] = self.pool.submit(self.read, following)
        return self.current[1]


def _judged_weights(own: MappingABC, experts: str, *, large: bool) -> dict[str, torch.Tensor]:
    """What the verdict checks for all-zero or identical weight matrices: the block's matrices, not its vectors.
    A stacked experts tensor is a matrix per expert only when it has three dimensions: [E, 2I] is every expert's
    bias, and a selection bias kept as [1, E] is a vector too; an all-zero bias (transformers initialises them so)
    leaves the function judgeable, as a single FFN's does.  A streamed block's experts are not held at all."""
    inside = experts + "."
    return {name: own[name] for name in own if not (large and name.startswith(inside))
            and (own[name].dim() >= 3 if name.startswith(inside) else sum(n > 1 for n in own[name].shape) >= 2)}


def _disk_prefix(keys: dict[str, str], stacked: list[str]) -> str:
    """The checkpoint's prefix of the block ('model.layers.1.block_sparse_moe.'), read off a tensor whose stored
    name ends in its name in transformers' block; where none does (a checkpoint storing 'input_linear.weight' for
    'experts.gate_up_proj' and 'router.layer.weight' for 'router.weight'), the dotted prefix all the block's stored
    names share (its own tensors' and its ``stacked`` experts'), so a port named as the checkpoint is still filled;
    '' where there is none."""
    for name, key in keys.items():
        if key.endswith("." + name):
            return key[: -len(name)]
    parts = [key.split(".") for key in [*keys.values(), *stacked]]
    if len(parts) < 2:
        return ""
    common = next((at for at, words in enumerate(zip(*parts, strict=False)) if len(set(words)) > 1),
                  min(map(len, parts)) - 1)
    return ".".join(parts[0][:common]) + "." if common else ""


def holds_block(session: Any) -> bool:
    """Whether the session's target holds more than one expert's tensors: a whole block, not an expert's FFN.  Its
    constructor runs once here on the meta device (nothing allocated)."""
    shapes = session.reference.tensor_shapes(session.mapping.reference_path(session.mapping.first_layer))
    one_expert = sum(math.prod(shape) for shape in shapes.values()) / session.num_experts  # fused or flattened
    try:
        with torch.device("meta"), skip_init():
            module, _, _, _ = build_target(session.mapping, session.config, session.target_spec)
    except Exception:  # its own errors surface where the target is built for real, in the user's terms
        return False
    if not isinstance(module, nn.Module):
        return False
    count, d = session.num_experts, session.hidden_size
    params = list(module.parameters())
    # an [E, d] router beside more parameters than one FFN's (three weights and their biases)
    router = len(params) > 6 and any(tuple(p.shape) in ((count, d), (d, count)) for p in params)
    return router or sum(p.numel() for p in params) > 1.5 * one_expert


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


class Lazy(MappingABC):
    """Tensors by name, each read only when asked for (a large block's experts)."""

    def __init__(self, loaders: dict[str, Callable[[], torch.Tensor]]):
        self.loaders = loaders

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.loaders[name]()

    def __iter__(self):
        return iter(self.loaders)

    def __len__(self) -> int:
        return len(self.loaders)


def _given(tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: tensor
