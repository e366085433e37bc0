"""A check session: everything resolved once, then one layer at a time.

One layer's check, in order: read its tensors as stored and build transformers' MLP from them (what
``engine.side.Side``, which a session extends, does for a compare too), build the target (``build.py``,
``fill.py``), make the inputs (``inputs.py``), run both, judge (``verdict.py``), and replay known mistakes when
it failed (``diagnose.py``).  This module only puts those steps in order.
"""

from __future__ import annotations

import contextlib
import gc
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from parity import __version__
from parity.definitions.families import configured_activation
from parity.definitions.mapping import is_builtin
from parity.definitions.mistakes import MistakeId, diagnosis
from parity.definitions.reference_routes import reference_routes
from parity.definitions.selection import Selection, parse_selection
from parity.definitions.values import check_atol, check_compute
from parity.engine.check.block_check import BlockCheck, holds_block
from parity.engine.check.build import build_target, target_label
from parity.engine.check.diagnose import diagnose, separability
from parity.engine.check.fill import fill_target
from parity.engine.check.guard import guarded
from parity.engine.check.routes import TargetRoutes
from parity.engine.check.run import place, run_module, run_target, skip_init, torch_device, user_code
from parity.engine.inputs import make_inputs
from parity.engine.layer import LayerOnDisk, weights_fingerprint
from parity.engine.memory import young_objects_only
from parity.engine.reference import ReferenceModel, activation_name
from parity.engine.results import LayerResult, Report
from parity.engine.side import Side, Truth, run_reference
from parity.engine.sliced import SlicedMLP
from parity.engine.verdict import LOW_PRECISION_FACTOR, Runs, judge, own_tolerance, shape_failure
from parity.errors import LayerRangeError, ShapeMismatchError, TargetError
from parity.sources.skeleton import reference_label

if TYPE_CHECKING:  # the session is given what resolve found; it never resolves anything itself
    from parity.engine.layout.resolve import Resolved

SYNTHETIC_BUDGET_BYTES = 2 * 2**30  # synthetic FFN weights written for a default run


class Session(Side):
    """A check of one resolved checkpoint (a ``Side``) against a target: what the check adds to reading layers and
    building transformers' module (the target, its routes, device, dtype, tolerance, diagnosis); ``run_layer`` then
    works on one layer at a time."""

    def __init__(self, resolved: Resolved, target: str | Any | None = None, seed: int = 0, atol: float | None = None,
                 diagnose: bool = True, device: str = "cpu", dtype: str = "float32",
                 reference: ReferenceModel | None = None):
        # where and in what the target computes; the truth stays transformers' MLP in float64 on the CPU
        self.device_name, self.dtype_name = check_compute(device, dtype)
        self.device = torch_device(self.device_name)
        self.compute_dtype: torch.dtype = getattr(torch, self.dtype_name)
        self.low_precision = self.compute_dtype != torch.float32
        self.target_spec = target
        # a user's target with a built-in mapping: routes read off its parameter names when [tensors] do not fit
        self.routes = TargetRoutes(resolved.mapping, target, infer=target is not None and is_builtin(resolved.mapping))
        self.seed = seed
        self.atol = None if atol is None else check_atol(atol, "atol")
        self.diagnose = diagnose
        self.target_notes: list[str] = []  # what loading the target had to work around, once each
        self.framework = None  # the target's framework when not PyTorch (parity.targets), once built
        super().__init__(resolved, reference)

    def part(self, resolved: Resolved) -> Session:
        """A further layout of the checkpoint, checked against the same target, alike."""
        return Session(resolved, self.target_spec, self.seed, self.atol, self.diagnose, self.device_name,
                       self.dtype_name, self.reference)

    def replay_builder(self, layer: int) -> Callable[..., nn.Module]:
        """``build(tensors, dtype=float32, on_call=False)``: transformers' MLP for replays (diagnose.py).  In the
        run's low-precision dtype it computes on the run's device, as the target did; float32 stays on the CPU."""
        def build(tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                  on_call: bool = False) -> nn.Module:
            module = self.reference_from(layer, tensors, on_call, dtype)
            return module.to(self.device) if self.low_precision and dtype == self.compute_dtype else module
        return build

    def build_target(self, tensors: dict[str, torch.Tensor] | LayerOnDisk,
                     changes: list[str] | None = None, layer: int | None = None) -> tuple[nn.Module, str]:
        """The target, built on the run's device and cast to a low-precision compute dtype before it is filled
        (float32 runs leave the module's own dtype alone), then filled with the checkpoint's tensors.
        ``changes``: what the target's code changed in torch's global state (restored; engine.check.guard)."""
        changes = [] if changes is None else changes
        where = f" on {self.device} in {self.dtype_name}" if self.device.type != "cpu" or self.low_precision else ""
        on_device = torch.device(self.device) if self.device.type != "cpu" else contextlib.nullcontext()
        with guarded(changes), skip_init(), user_code(f"target {self.target_name()} could not be built{where}"), \
                on_device:
            module, name, args, built_notes = build_target(self.mapping, self.config, self.target_spec, layer=layer)
            place(module, self.device, self.compute_dtype if self.low_precision else None)
        framework = getattr(module, "parity_framework", None)
        if framework is not None:
            self.framework = framework
        if framework is not None and not framework.fills:  # its weights are inside it: checked, not filled
            module.parity_native.compute = self.dtype_name
            stored = self.read_layer(layer, None, dtype=None) if isinstance(tensors, LayerOnDisk) else tensors
            checked, module.parity_holds_layer = framework.verify(module.parity_native, stored)
            notes = [*built_notes, *(f"layer {layer}: {note}" if layer is not None else note for note in checked)]
            self.target_notes.extend(n for n in notes if n not in self.target_notes)
            return module.eval(), name
        with guarded(changes), user_code(f"target {name} could not be filled with the checkpoint's tensors",
                                         exceptions=False):
            shapes = tensors.meta if isinstance(tensors, LayerOnDisk) else tensors  # routes are chosen by shape
            routes = self.routes.choose(module, shapes, self.hidden_size, args)
            try:
                notes = [*built_notes, *self.routes.notes, *fill_target(module, routes, tensors, self.config)]
            except ShapeMismatchError as exc:
                supplied = [n.removeprefix("target config: ") for n in built_notes if n.startswith("target config:")]
                if not supplied:
                    raise
                # built from values parity chose, not the user: a wrong size is parity's guess, not their mistake
                raise TargetError(f"target {name} was built with config values parity supplied ({'; '.join(supplied)})"
                                  f" and its shapes do not fit the checkpoint ({exc}). One of those values likely "
                                  "means something else to your constructor (a hidden_dim it reduces by 2/3, say): "
                                  "write a factory that passes what it expects: --target mymodel:make_ffn with "
                                  "def make_ffn(config): return YourFFN(...)") from None
        for note in notes:
            if note not in self.target_notes:
                self.target_notes.append(note)
        return module.eval(), name

    # -- one layer -------------------------------------------------------------------------
    def run_layer(self, layer: int, expert: int | None = None) -> tuple[LayerResult, str]:
        """Check one layer (one expert of it, for MoE).  The reference runs first, on the stored tensors
        (upcast one projection at a time, ``engine.upcast``; a very large layer in slices along d_ff,
        ``engine.sliced``); then the target is built and run.  For a sliced layer the stored tensors are not
        kept beside the float32 target: it is filled by reading them again one at a time."""
        tensors = self.read_layer(layer, expert, dtype=None)
        fingerprint = weights_fingerprint(tensors, self.reader.facts)
        # what the read's one pass found, under the reference's names (a chunk of a fused tensor has no facts)
        facts = {r.target: self.reader.facts.get(r.source) for r in self.reader.reference_routes(layer)
                 if r.chunk is None}
        # The reference first: a checkpoint that disagrees with its own config is bad input (exit 2);
        # only then is a tensor that does not fit the target the module's mistake (a failed layer).
        routed = self.reference_tensors(layer, tensors)  # views of ``tensors``: no copy
        reference = self.reference_from(layer, routed)
        x = make_inputs(reference, self.hidden_size, self.seed, layer, expert)
        low = ((lambda x: run_module(self.replay_builder(layer)(routed, self.compute_dtype), x))
               if self.low_precision else None)
        truth = run_reference(reference, x, low)
        large = isinstance(reference, SlicedMLP)
        del reference
        if large:
            tensors = LayerOnDisk(self.reader, layer, expert, tensors)
            del routed
        changes: list[str] = []  # what the target's code did to torch's global state (restored after each call)
        try:
            target, target_name = self.build_target(tensors, changes, layer)
        except ShapeMismatchError as exc:
            return shape_failure(layer, expert, exc, self.checkpoint.weights), self.target_name()
        del tensors
        notes: list[str] = []
        runs = run_target_twice(truth, target, target_name, x, notes, changes)
        runs.dtype = self.dtype_name
        self.target_notes.extend(n for n in dict.fromkeys(notes) if n not in self.target_notes)
        # a graph that is not this layer's (its initializers said so when it was built): whose is it?
        held = target.parity_native if getattr(target, "parity_holds_layer", True) is False else None
        del target
        gc.collect()
        if large:
            routed = self.reference_tensors(layer, self.read_layer(layer, expert, dtype=None))
        result = judge(layer, expert, runs, routed, truth.z, self.atol, self.checkpoint.weights, facts)
        result.fingerprint = fingerprint
        if changes:  # the module reached outside itself: whatever it computed, it is not a module to trust
            result.passed = False
            result.diagnosis = diagnosis(MistakeId.GLOBAL_STATE_MODIFIED, None, None, "; ".join(changes[:6]))
            return result, target_name
        if (self.low_precision or self.atol is not None) and result.unverifiable is None:
            own = own_tolerance(runs) if self.atol is not None else None
            result.separability = separability(self.replay_builder(layer), routed, self.config, x, runs.reference64,
                                               result.tolerance, result.reference_error, self.dtype_name, self.atol,
                                               own)
        if result.diagnosis is None and not result.passed and held is not None and expert is None:
            other = self.layer_held(held, layer)
            if other is not None:
                result.diagnosis = diagnosis(MistakeId.OTHER_LAYERS_WEIGHTS, None, None,
                                             f"its weights are layer {other}'s checkpoint tensors, not layer {layer}'s")
        if result.diagnosis is None and not result.passed and result.unverifiable is None and self.diagnose:
            result.diagnosis = self.explain(layer, routed, x, runs.target, runs.reference64, result.tolerance)
        return result, target_name

    def layer_held(self, native: Any, layer: int, reach: int = 8) -> int | None:
        """The layer whose checkpoint tensors a target that holds its own weights (an ONNX graph) holds, searched
        nearest first within ``reach`` layers of the one checked; None when none is."""
        nearest = sorted((j for j in range(self.num_layers)
                          if j != layer and abs(j - layer) <= reach and self.mapping.serves(j)),
                         key=lambda j: abs(j - layer))
        return next((j for j in nearest if self.framework.verify(native, self.read_layer(j, None, dtype=None))[1]),
                    None)

    def explain(self, layer: int, routed: dict[str, torch.Tensor], x: torch.Tensor, got: torch.Tensor,
                out64: torch.Tensor, tolerance: float) -> dict:
        """Replay known mistakes on transformers' MLP for this layer (``routed``: its stored tensors under the
        reference's names), in the dtype the target ran in (see diagnose.py)."""
        return diagnose(self.replay_builder(layer), routed, self.config, x, got, out64, tolerance, self.compute_dtype)

    def report(self) -> Report:
        import transformers

        probe = self.reference.meta_module(self.mapping.reference_path(self.mapping.first_layer))
        return Report(
            model=self.resolved.model,
            checkpoint=self.checkpoint.location,
            weights=self.checkpoint.weights,
            weights_note=self.checkpoint.weights_note,
            mapping=self.mapping.name,
            target=self.target_name(),
            reference=reference_label(probe),
            reference_activation=activation_name(probe, configured_activation(self.config)),
            versions={"parity": __version__, "transformers": transformers.__version__, "torch": torch.__version__},
            seed=self.seed,
            notes=list(self.resolved.notes) + self.compute_notes(),
            device=str(self.device),
            dtype=self.dtype_name,
            atol=self.atol,
            reference_routes=reference_routes(self.reader.reference_routes(self.mapping.first_layer)),
            units=self.unit_names(),
        )

    def describe_framework(self, report: Report) -> None:
        """The report names the target's framework and its version once the target is built (parity.targets)."""
        if self.framework is not None:
            report.framework = self.framework.name
            report.versions.update(self.framework.versions())

    def compute_notes(self) -> list[str]:
        if not self.low_precision and self.device.type == "cpu":
            return []
        truth = "the truth is transformers' MLP in float64 on the CPU"
        if not self.low_precision:
            return [f"the target runs on {self.device} in float32; {truth}, the tolerance the float32 one"]
        rule = ("--atol" if self.atol is not None else
                f"{LOW_PRECISION_FACTOR:g} x the reference's own {self.dtype_name} error (transformers' MLP cast to "
                f"{self.dtype_name} on {self.device}, same inputs)")
        return [f"the target runs on {self.device} in {self.dtype_name}; {truth}; a layer passes when max|Δ| <= "
                f"{rule}"]

    def synthetic_layers(self, notes: list[str]) -> list[int] | None:
        """All layers, unless the synthetic model would be large: then first, middle and last.

        Random weights are the same kind of tensor at every depth; writing gigabytes of them
        proves nothing more than three layers do.
        """
        shapes = self.reference.tensor_shapes(self.mapping.reference_path(self.mapping.first_layer)).values()
        layer_bytes = sum(math.prod(shape) for shape in shapes) * 2
        if layer_bytes * self.num_layers <= SYNTHETIC_BUDGET_BYTES:
            return None
        chosen = sorted({0, self.num_layers // 2, self.num_layers - 1})
        notes.append(f"synthetic weights of this size: checking layers {chosen} of {self.num_layers}; "
                            "--layers all checks every one")
        return chosen

    def target_name(self) -> str:
        return target_label(self.target_spec if self.target_spec is not None else self.mapping.target_class)


def run_target_twice(truth: Truth, target: nn.Module, target_name: str, x: torch.Tensor,
                     notes: list[str] | None = None, changes: list[str] | None = None) -> Runs:
    """The target twice (determinism), each run on its own copy of the inputs: a module that writes into
    its input must not change what the other run sees; what it changes in torch's global state is put back
    after each run and appended to ``changes``."""
    changes = [] if changes is None else changes
    with torch.no_grad():
        with guarded(changes):
            got, changed = run_target(target, target_name, x, truth.out32.shape, notes)
        with guarded(changes):
            again, changed_again = run_target(target, target_name, x, truth.out32.shape, notes)
    return Runs(truth.out64, truth.out32, got, again, changed or changed_again, truth.low)


def run_session(session: Session, layers: Selection = None,
                on_layer: Callable[[Report, LayerResult], None] | None = None, experts: Selection = None,
                block: bool | None = None) -> Report:
    """Check the selected layers (default: all; first, middle and last of a large synthetic model).  ``block``:
    each MoE layer's whole sparse block is the unit (engine.check.block_check); None: when the target holds more
    than one expert's tensors (it is a block, not an expert's FFN)."""
    report = session.report()
    report.layout = session.mapping if session.mapping.derived else None  # --save-mapping writes it in full
    if layers is None and session.checkpoint.weights == "synthetic":
        layers = session.synthetic_layers(report.notes)
    session.expert_indices(experts)  # a selection of experts a dense model lacks: refused before any layer runs
    blocks = block_check(session, block, report)
    with young_objects_only():  # the per-layer gc.collect() then costs milliseconds, not 0.5 s
        for layer in parse_selection(layers, session.num_layers):
            units = session.units(layer, experts) if blocks is None else blocks.units(layer)
            for unit, expert in units:
                result, report.target = unit.run_layer(layer, expert)
                result.unit = result.unit or unit.mapping.unit
                report.routes = session.routes.describe() if blocks is None else blocks.describe()
                unit.describe_framework(report)
                report.notes.extend(n for n in unit.target_notes if n not in report.notes)
                report.layers.append(result)
                if on_layer is not None:
                    on_layer(report, result)
    if blocks is not None:
        blocks.note_skipped(report)
    return report


def block_check(session: Session, block: bool | None, report: Report) -> Any:
    """The block units' check (engine.check.block_check.BlockCheck) where the run checks whole blocks, else None."""
    routed = next((s for s in (session, *session.parts) if s.num_experts is not None), None)
    if block is None:
        block = routed is not None and session.target_spec is not None and holds_block(routed)
    if not block:
        return None
    if routed is None:
        raise LayerRangeError(f"--block: {session.mapping.name} describes no mixture-of-experts layer (no experts)")
    if session.target_spec is None:
        from parity.errors import UsageError

        raise UsageError("--block checks your own MoE block: pass it with --target mymodel:MoEBlock (parity's own "
                         "modules hold one expert's FFN, not a whole block)")
    blocks = BlockCheck(routed)
    blocks.describe_report(report)
    return blocks
