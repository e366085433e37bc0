"""`parity CKPT --target mymodel:MoEBlock`: a user's whole sparse block against transformers' block, layer by layer.

The unit is the block (router, top-k, weights, experts, shared experts and their gate) instead of one expert at a
time (engine.check.session).  transformers' block for the layer, filled with its tensors, runs in float64 (the truth,
with whatever transformers itself keeps in float32: DeepSeek's router) and float32 (the noise floor); the user's
block runs twice in float32 on the same inputs (engine.block.block_inputs).  Tokens whose choice of experts moves
within float32 noise are set aside: the verdict is on the others, and the report counts them and says whether the
block's output on them matches one of the choices transformers' block makes there.  A failing block is named by the
routing mistakes replayed on transformers' block (engine.routing_mistakes); one too large to hold has the same
replays run on a few of its failing tokens around engine.check.block_replay.ExpertsOnDemand (``streamed_mistake``).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
from collections.abc import Callable, Iterator
from collections.abc import Mapping as MappingABC
from typing import Any

import torch
from torch import nn

from parity.definitions.mistakes import MistakeId, diagnosis, fit_diagnosis
from parity.definitions.records import Diagnosis
from parity.engine.block import (
    BLOCK_UNIT,
    NUDGE,
    BlockInputs,
    BlockReader,
    Precomputed,
    block_inputs,
    block_output,
    chosen_in,
    experts_call,
    filled_block,
    first_projection,
    gate_reach,
    reference_block,
    streamed,
)
from parity.engine.check.block_fill import fill_block
from parity.engine.check.block_precision import HalfSeen, experts_in, low_precision_mistake
from parity.engine.check.block_replay import ExpertsOnDemand, expert_builder, failing_tokens
from parity.engine.check.build import build_target
from parity.engine.check.guard import guarded
from parity.engine.check.run import place, run_module, skip_init, user_code
from parity.engine.experts import expert_reference, sliced_expert, slices_agree
from parity.engine.results import LayerResult
from parity.engine.routing_mistakes import replay_fits, replay_search, suspect_pairs
from parity.engine.verdict import Runs, judge, shape_failure
from parity.errors import ParityError, ShapeMismatchError, TargetError, UsageError

HELD_BYTES = 2 * 2**30  # a block whose experts take more in float64 is streamed: one expert held at a time
REACH_SAMPLE = 4  # a streamed block's inputs are scaled on this many experts' gates
REPEAT_TOKENS = 2  # a streamed block's determinism is checked on this many tokens, run twice
UNREPLAYABLE = ("this block is too large to hold whole and hands its experts neither each token's chosen experts and "
                "their weights nor its tokens once per expert, so no mistake was replayed on it; check a smaller "
                "layer of the same family, or one expert at a time (--experts)")


class BlockCheck(BlockReader):
    """The block units of a session whose layout has routed experts (``session.mapping.experts``): a user's block
    checked against transformers', the layer's block read as ``engine.block.BlockReader`` reads it."""

    def __init__(self, session: Any):
        super().__init__(session)
        asked = [f"--dtype {session.dtype_name}"] * session.low_precision \
            + [f"--device {session.device}"] * (session.device.type != "cpu")
        if asked:  # the block is built, filled and run on the CPU in float32: a report saying otherwise would lie
            raise UsageError(f"a whole MoE block is checked in float32 on the CPU only (transformers' block in float64 "
                             f"is its truth, float32 its noise floor), not with {' '.join(asked)}: run it without "
                             f"{'them' if len(asked) > 1 else 'it'}, or check one expert at a time there (--experts)")
        self.session = session
        self.sources: dict[str, str] = {}  # how the user's block was filled (its first layer), for the report
        self.target_notes: list[str] = []
        self.half = ""  # the block's half-precision parameters, said where it fails (low_precision_compute)
        self.flat_input = False  # the block takes its tokens flattened, [batch·tokens, d] (run_target)
        self.skipped: list[int] = []  # layers selected that hold no sparse block (dense ones before MoE ones)
        self.sliced: dict[int, bool] = {}  # streamed layers whose experts are computed sliced (``expert_runs``)

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
        with HalfSeen() as seen:  # what it computes in, where its parameters do not say (torchtitan's experts)
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
        inside = seen.dtype() is not None and not self.half  # half precision inside a float32 block's forward
        if not result.passed and result.unverifiable is None and result.diagnosis is None and session.diagnose:
            result.diagnosis = (
                streamed_mistake(self, layer, block64, inputs.x, out64, got, result=result, kept=kept) if large
                else self.low_precision(block64, inputs.x, out64, got, kept, seen, result) if inside
                else named_mistake(block64, inputs.x.double(), got, result, kept))
        if result.diagnosis is not None and result.diagnosis.id == MistakeId.UNEXPLAINED:
            half = self.half or (f"it computes in {seen.said()} inside its forward, its parameters float32; build "
                                 "it computing in float32 to check its routing and experts" if inside and large
                                 else "")  # held: low_precision_mistake measured it against the precision already
            result.diagnosis = residual_included(inputs.x, out64, got, kept, result) or (
                diagnosis(MistakeId.LOW_PRECISION_COMPUTE, None, result.max_abs_diff, half) if half
                else result.diagnosis)
        if changes:
            result.passed = False
            result.diagnosis = diagnosis(MistakeId.GLOBAL_STATE_MODIFIED, None, None, "; ".join(changes[:6]))
        return result, name

    def low_precision(self, block64: nn.Module, x: torch.Tensor, out64: torch.Tensor, got: torch.Tensor,
                      kept: torch.Tensor, seen: HalfSeen, result: LayerResult) -> Diagnosis:
        """A held block seen computing in half precision, judged against transformers' block with its experts in
        that dtype (engine.check.block_precision), its routing mistakes replayed at that precision's tolerance."""
        with experts_in(block64, self.site.experts, seen.dtype()):
            low = block_output(block64, x.double())
        fits = functools.partial(replay_fits, block64, x.double(), got, tokens=kept)
        return low_precision_mistake(low, out64, got, kept, seen, fits, max_abs_diff=result.max_abs_diff)

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
        inputs = block_inputs(block64, block32, self.site, _sampled_reach(gate_reach(lambda: sample)), count=count,
                              d=session.hidden_size,
                              seed=session.seed, layer=layer)
        sample.clear()  # REACH_SAMPLE experts' gates in float32: not held through the streamed pass
        x64 = inputs.x.double()
        calls = [experts_call(block64, self.site, x64), experts_call(block32, self.site, inputs.x)]
        meta = self.meta_experts(layer)
        where = self.site.path.format(layer=layer)
        used = [e for e in range(count) if any(bool(chosen_in(call, count)[:, e].any()) for call in calls)]
        with ReadAhead(functools.partial(self.stored_expert, layer), used,
                       functools.partial(self.side.reader.will_need, layer)) as ahead, one_compute_thread():
            outs = streamed(calls, count, self.expert_runs(layer, meta, where, ahead, used))
        out = []
        for block, x, call_out in ((block64, x64, outs[0]), (block32, inputs.x, outs[1])):
            block.get_submodule(self.site.experts).outputs = [call_out]
            out.append(block_output(block, x).double())
        return block64, inputs, out[0], out[1]

    def expert_runs(self, layer: int, meta: nn.Module, where: str, ahead: ReadAhead, used: list[int]
                    ) -> Callable[[int, torch.dtype, bool], nn.Module]:
        """``one`` for engine.block.streamed: expert e in transformers' experts module, in a dtype, from its stored
        values; sliced (engine.experts.SlicedExpert: the float64 and float32 copies made a cache-sized slice at a
        time) where the module, measured on the first expert used, computes an expert sliced as it does whole."""
        config = self.session.config
        slicing = bool(used) and slices_agree(meta, config, self.routed(layer, ahead(used[0], last=False), None),
                                              where)
        self.sliced[layer] = slicing

        def one(expert: int, dtype: torch.dtype, last: bool) -> nn.Module:
            # sliced, no whole copy of the expert is made: the next one's read may start at its first use
            routed = self.routed(layer, ahead(expert, last=last or slicing), None)
            sliced = sliced_expert(meta, config, routed, where, dtype) if slicing else None
            return sliced if sliced is not None else expert_reference(meta, config, routed, where).experts.to(dtype)
        return one

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
        self.half = half_precision(module)
        return module.eval(), name

    def run_target(self, target: nn.Module, name: str, x: torch.Tensor, changes: list[str]) -> torch.Tensor:
        """The user's block on its own copy of ``x``, shaped like ``x`` (a tuple's first element; [batch·tokens, d]
        reshaped, as transformers' Llama 4 block returns it).  A block that fails on [batch, tokens, d] is run on the
        tokens flattened to [batch·tokens, d], as its model calls it (mistral-inference's MoeLayer unpacks
        ``batch_idx, nth_expert = torch.where(...)``); if that fails too, the error is the one of the first call."""
        if self.flat_input:
            return self.run_flat(target, name, x, changes)
        try:
            with torch.no_grad(), guarded(changes), \
                    user_code(f"target {name} failed on an input of shape {list(x.shape)}"):
                out = run_module(target, x.clone())
        except TargetError as first:
            if x.dim() < 3:
                raise
            try:
                out = self.run_flat(target, name, x, changes)
            except TargetError:
                if len(by_dtype(target)) > 1:  # DeepSeek-V3's Linear defaults to bfloat16 beside a float32 gate
                    raise TargetError(f"{first}. {mixed_dtypes(target)}") from None
                raise first from None
            self.flat_input = True
            self.target_notes.append(f"{name} fails on an input of shape {list(x.shape)} and runs on the tokens "
                                     f"flattened, [batch·tokens, d]: it is called so")
            return out
        return _shaped_as(x, out, given=x, name=name)

    def run_flat(self, target: nn.Module, name: str, x: torch.Tensor, changes: list[str]) -> torch.Tensor:
        """The user's block on [batch·tokens, d], its output reshaped to ``x``'s shape."""
        flat = x.reshape(-1, x.shape[-1])
        with torch.no_grad(), guarded(changes), \
                user_code(f"target {name} failed on an input of shape {list(flat.shape)}"):
            out = run_module(target, flat.clone())
        return _shaped_as(x, out, given=flat, name=name)

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
    copy, the largest, is gone by then), or at its first use where it is computed sliced (no whole copy is made), so
    the peak grows by one expert's stored size at most; ``hint`` (the reader's ``will_need``) is told of the expert
    after that one as its read starts, so the disk reads on while the thread copies the next from the page cache."""

    def __init__(self, read: Callable[[int], dict[str, torch.Tensor]], order: list[int],
                 hint: Callable[[int], None] | None = None):
        from concurrent.futures import ThreadPoolExecutor

        self.read, self.next, self.hint = read, dict(zip(order, order[1:], strict=False)), hint
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
            after = self.next.get(following)
            if self.hint is not None and after is not None:  # the disk reads on while ``following`` is copied
                self.hint(after)
        return self.current[1]


@contextlib.contextmanager
def one_compute_thread() -> Iterator[None]:
    """torch computes on one thread while a streamed block's experts are run: on a few tokens an expert is many
    small operations, where a second intra-op thread mostly waits on the first (spinning, on a loaded machine) while
    the read-ahead thread needs a core of its own; restored after (the user's block runs with the user's setting).
    32-expert DeepSeek-V3-width block on 2 busy cores: the streamed pass 7.8 -> 7.1 CPU s; and the float32 noise
    floor no longer depends on the thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _sampled_reach(sampled: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
                   ) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]:
    """A streamed block's reach, measured on REACH_SAMPLE experts: a row none of whose tokens is routed to one of
    them is scaled on the sample's gates unmasked, instead of by 1/0 (64 experts, top-8 of 4 groups in 8: a row
    routed to none of experts 0-3 was scaled by 1e12 and the float32 truth overflowed)."""
    def reach(x: torch.Tensor, chosen: torch.Tensor | None) -> torch.Tensor:
        best = sampled(x, chosen)
        return best if chosen is None or bool((best > 0).all()) else torch.where(best > 0, best, sampled(x, None))
    return reach


def _judged_weights(own: MappingABC, experts: str, *, large: bool) -> dict[str, torch.Tensor]:
    """What the verdict checks for all-zero or identical weight matrices: the block's matrices, not its vectors.
    A stacked experts tensor is a matrix per expert only when it has three dimensions: [E, 2I] is every expert's
    bias, and a selection bias kept as [1, E] is a vector too; an all-zero bias (transformers initialises them so)
    leaves the function judgeable, as a single FFN's does.  A streamed block's experts are not held at all."""
    inside = experts + "."
    return {name: own[name] for name in own if not (large and name.startswith(inside))
            and (own[name].dim() >= 3 if name.startswith(inside) else sum(n > 1 for n in own[name].shape) >= 2)}


def _shaped_as(x: torch.Tensor, out: torch.Tensor, *, given: torch.Tensor, name: str) -> torch.Tensor:
    """The user's block's output (on ``given``: ``x`` or its tokens flattened) in ``x``'s shape, or a TargetError
    saying what it returned where transformers' block returns ``given``'s shape."""
    if out.numel() != x.numel():
        raise TargetError(f"target {name}: forward on an input of shape {list(given.shape)} returned shape "
                          f"{list(out.shape)}; transformers' block returns {list(given.shape)}")
    return out.reshape(x.shape)


def residual_included(x: torch.Tensor, out64: torch.Tensor, got: torch.Tensor, kept: torch.Tensor,
                      result: LayerResult) -> Diagnosis | None:
    """The block returning x + its output (the decoder layer's residual inside it): its output minus its input is
    transformers' block's, within the tolerance, on every judged token."""
    width = x.shape[-1]
    less = (got.double() - x.double()).reshape(-1, width)[kept]
    distance = float((less - out64.reshape(-1, width)[kept]).abs().max()) if bool(kept.any()) else math.inf
    if result.tolerance is None or distance > result.tolerance:
        return None
    return diagnosis(MistakeId.BLOCK_RESIDUAL_INCLUDED, distance, result.max_abs_diff,
                     "your block's output minus its input is transformers' block's output")


def by_dtype(module: nn.Module) -> dict[torch.dtype, list[str]]:
    """The module's floating parameters and buffers, by dtype."""
    found: dict[torch.dtype, list[str]] = {}
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if tensor.is_floating_point():
            found.setdefault(tensor.dtype, []).append(name)
    return found


def _listed(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def half_precision(module: nn.Module) -> str:
    """What says a block computes in half precision, where it holds parameters in it ("" where none): a float32 check
    runs a module as it was built, so a block built in bfloat16 (DeepSeek-V3's inference Linear, generate.py's
    default dtype) is judged against float32 noise and fails; the report names that instead of 'unexplained'."""
    half = {dtype: names for dtype, names in by_dtype(module).items() if dtype in (torch.bfloat16, torch.float16)}
    return "; ".join(f"the block holds {str(dtype).removeprefix('torch.')} parameters ({_listed(names)}): it computes "
                     "in it, judged here against float32 noise; build it in float32 (torch.set_default_dtype, or "
                     ".float() on the block) to check its routing and experts" for dtype, names in half.items())


def mixed_dtypes(module: nn.Module) -> str:
    """The hint for a block that fails holding parameters of more than one dtype."""
    listed = "; ".join(f"{str(dtype).removeprefix('torch.')}: {_listed(names)}"
                       for dtype, names in by_dtype(module).items())
    return (f"The block holds parameters of more than one dtype ({listed}): build it in one dtype, float32 for this "
            "check (torch.set_default_dtype(torch.float32) and the module's own default dtype, or .float() on it)")


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
    """The routing mistake whose replay on transformers' block reproduces the user's output (engine.routing_mistakes),
    or two made at once where none alone does; replays that fit equally are all said, each a candidate with its
    distance; none fitting is ``unexplained``, saying what was replayed."""
    search = replay_search(block64, x, got, tolerance=result.tolerance, tokens=kept)
    found = search.fits
    if not found:
        return diagnosis(MistakeId.UNEXPLAINED, None, result.max_abs_diff, search.untold())
    return fit_diagnosis(found)


def streamed_mistake(reader: Any, layer: int, block64: nn.Module, x: torch.Tensor, out64: torch.Tensor,
                     got: torch.Tensor, *, result: Any, kept: torch.Tensor) -> Diagnosis:
    """The routing mistake whose replay on transformers' streamed block (``block64``, its experts module replaced by
    ``ExpertsOnDemand`` reading through ``reader``, an engine.block.BlockReader) reproduces the user's output
    ``got`` on a few of the tokens of ``x`` where it fails, by ``result``'s tolerance; the pairs of experts to
    replay exchanged are found from every judged token; the replays inside an expert change each expert the stand-in
    builds.  None fitting is ``unexplained``."""
    site, count, tolerance = reader.site, reader.side.num_experts, result.tolerance
    x64 = x.double()
    call = experts_call(block64, site, x64)
    routed = len(call) == 3 and sum(not a.is_floating_point() for a in call) == 1
    if not routed and (len(call) != 1 or call[0].shape[0] % count):  # neither the choice nor the tokens per expert
        return diagnosis(MistakeId.UNEXPLAINED, None, result.max_abs_diff, UNREPLAYABLE)
    width = x.shape[-1]
    tokens = failing_tokens(out64, got, kept, tolerance)
    wrong = (got.double().reshape(-1, width) - out64.reshape(-1, width)).abs().amax(-1) > tolerance
    pairs = suspect_pairs(chosen_in(call, count), wrong & kept, kept)
    block64.set_submodule(site.experts, ExpertsOnDemand(count, expert_builder(
        reader, layer, sliced=getattr(reader, "sliced", {}).get(layer, False)), template=reader.meta_experts(layer),
        routed=routed))
    few_x = x64.reshape(-1, width)[tokens].unsqueeze(0)
    few_got = got.double().reshape(-1, width)[tokens].unsqueeze(0)
    try:
        with one_compute_thread():  # a few tokens: many small operations, as in the streamed pass
            search = replay_search(block64, few_x, few_got, tolerance=tolerance, exchanged=pairs)
    except ParityError:  # the checkpoint's defect in an expert only a replay chose: said as the streamed pass says it
        raise
    except Exception as exc:  # noqa: BLE001 - the verdict stands; only its explanation is missing, and said so
        return diagnosis(MistakeId.UNEXPLAINED, None, result.max_abs_diff, "this block is too large to hold whole and "
                         f"its replays could not run around experts read on demand ({type(exc).__name__}: "
                         f"{exc})")
    found = search.fits
    if not found:
        return diagnosis(MistakeId.UNEXPLAINED, None, result.max_abs_diff,
                         f"this block is too large to hold whole: its mistakes were replayed on {len(tokens)} of the "
                         "tokens where it fails, none reproduces it"
                         + (f" ({search.untold()})" if search.untold() else "") + "; check a smaller layer of the "
                         "same family, or one expert at a time: --experts")
    return fit_diagnosis(found, note=f", replayed on {len(tokens)} of the tokens where it fails")
