"""One layer at a time: read its FFN tensors, fill target and reference, compare.

Inputs are seeded and identical for both modules.  Each batch row is scaled so the
activation's input reaches a different magnitude (about 1, 3 and 8): exact and tanh GELU
differ most near |z| = 2.7, SiLU and GELU far from 0, so all of that range is swept.
The verdict's tolerance comes from the measured noise floor: the reference run in
float32 against the same reference in float64.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import math
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from . import __version__
from .compare import Runs, first_nonfinite, input_change, same_values, tolerance_for, unverifiable_reason
from .diagnose import diagnose
from .mistakes import MistakeId, diagnosis
from .errors import (CheckpointError, LayerRangeError, MissingTensorError, ParityError, ShapeMismatchError,
                     SyntheticWeightsError, TargetError, UsageError, WeightDefectError)
from .mapping import ConfigValue, Mapping, TensorRoute, check_reference_routes
from .memory import young_objects_only
from .reference import ReferenceModel, activation_module, activation_name, configured_activation
from .report import LayerResult, Report
from .resolve import Resolved, resolve
from .selection import Selection, parse_selection
from .target import build_target, fill_target, route_tensor
from .upcast import compute_in

ROW_TARGETS = (1.0, 3.0, 8.0)  # max |pre-activation| aimed at by each batch row
TOKENS = 16
SYNTHETIC_BUDGET_BYTES = 2 * 2**30  # synthetic FFN weights written for a default run


@contextlib.contextmanager
def skip_init() -> Iterator[None]:
    """Constructing a 7B-size target should not spend seconds on random init it will overwrite."""
    names = ("uniform_", "normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
             "trunc_normal_", "constant_", "zeros_", "ones_")
    saved = {name: getattr(nn.init, name) for name in names}
    try:
        for name in names:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


class Session:
    """Everything resolved once for a run; ``run_layer`` then works on one layer at a time."""

    def __init__(self, resolved: Resolved, target: str | Any | None = None, seed: int = 0, atol: float | None = None,
                 diagnose: bool = True):
        self.resolved = resolved
        self.mapping: Mapping = resolved.mapping
        self.checkpoint = resolved.checkpoint
        self.config = resolved.config
        self.target_spec = target
        self.seed = seed
        if atol is not None and (isinstance(atol, bool) or not isinstance(atol, (int, float)) or not 0 < atol < math.inf):
            raise UsageError(f"atol={atol!r}: expected a positive finite number (a tolerance of inf or nan passes anything)")
        self.atol = atol
        self.diagnose = diagnose
        self.target_notes: list[str] = []  # what loading the target had to work around, once each
        self.reference = ReferenceModel(self.config)
        self.num_layers = self.config_int(self.mapping.num_layers, "num_layers")
        self.hidden_size = self.config_int(self.mapping.hidden_size, "hidden_size")
        experts = self.mapping.experts
        self.num_experts = None if experts is None else self.config_int(experts.count, "experts.count")
        self._stacked: tuple[str, dict[str, torch.Tensor]] | None = None  # MoE: the last layer's all-expert tensors
        if experts is None:  # a [reference.tensors] name the MLP lacks would silently route nothing
            check_reference_routes(self.mapping, self.reference.tensor_shapes(self.mapping.reference_path(0)))

    def config_int(self, spec: Any, key: str) -> int:
        """A mapping size (num_layers, hidden_size, experts.count) read from the config: a config.json may hold anything."""
        value = ConfigValue(self.config, self.mapping.path)(spec, key)
        if isinstance(value, bool) or not isinstance(value, int) and not (isinstance(value, float) and value.is_integer()):
            raise CheckpointError(f"{self.checkpoint.location}: {spec} (mapping key '{key}') is {value!r}, "
                                  "not an integer; fix config.json")
        return int(value)

    # -- tensors ---------------------------------------------------------------------------
    def reference_routes(self, layer: int) -> list[TensorRoute]:
        """Reference parameter (HF name) <- checkpoint tensor; by default the same name.  For MoE: the
        expert's gate, up and down tensors, which parity.moe puts into transformers' experts module."""
        if self.mapping.experts is not None:
            return [self.mapping.experts.gate, self.mapping.experts.up, self.mapping.experts.down]
        given = {route.target: route for route in self.mapping.reference_tensors}
        names = self.reference.tensor_shapes(self.mapping.reference_path(layer))
        return [given.get(name, TensorRoute(name, name)) for name in names]

    def layer_prefix(self, layer: int, expert: int | None = None) -> str:
        """The checkpoint key prefix under which this layer's (expert's) FFN tensors are stored."""
        sources = [route.source for route in self.reference_routes(layer)]
        block = self.mapping.layer_prefix(layer, expert)
        for prefix in self.mapping.key_prefixes:
            if all(self.checkpoint.has(f"{prefix}{block}.{name}") for name in sources):
                return f"{prefix}{block}."
        hints = self.checkpoint.missing_hint([f"{self.mapping.key_prefixes[0]}{block}.{name}" for name in sources])
        raise MissingTensorError(
            f"{self.checkpoint.location}: layer {layer}'s FFN tensors are missing (tried key prefixes "
            f"{self.mapping.key_prefixes} from {self.mapping.path.name}): {hints}"
        )

    def read_layer(self, layer: int, expert: int | None = None,
                   dtype: torch.dtype | None = torch.float32) -> dict[str, torch.Tensor]:
        """The layer's FFN tensors under names relative to the layer, upcast to ``dtype`` (None: as stored)."""
        prefix = self.layer_prefix(layer, expert)
        routes = [*self.reference_routes(layer), *self.mapping.tensors]
        wanted = list(dict.fromkeys(r.source for r in routes if not r.optional or self.checkpoint.has(prefix + r.source)))
        raw = self._read(prefix, wanted, expert)
        tensors = {}
        for name in wanted:
            tensor = raw.pop(prefix + name)
            if not tensor.is_floating_point():
                raise CheckpointError(
                    f"{self.checkpoint.location}: tensor '{prefix + name}' is stored as {tensor.dtype}, not floating "
                    "point (a quantized checkpoint?); parity compares float weights: dequantize it first"
                )
            if not all_finite(tensor):
                bad = int((~torch.isfinite(tensor)).sum())
                raise WeightDefectError(
                    f"{self.checkpoint.location}: tensor '{prefix + name}' holds {bad} NaN/Inf values: "
                    "the checkpoint is defective (not a module mismatch)"
                )
            tensors[name] = tensor if dtype is None else tensor.to(dtype)
        return tensors

    def _read(self, prefix: str, names: list[str], expert: int | None) -> dict[str, torch.Tensor]:
        """checkpoint.read, except that MoE tensors stacked over experts are read once per layer and sliced."""
        stacked = set(self.mapping.experts.stacked) if self.mapping.experts is not None else set()
        plain = [prefix + n for n in names if n not in stacked]
        out = self.checkpoint.read(plain) if plain else {}
        wanted = [prefix + n for n in names if n in stacked]
        if wanted:
            if self._stacked is None or self._stacked[0] != prefix:
                self._stacked = None  # release the previous layer's stack first
                self._stacked = (prefix, self.checkpoint.read(wanted))
            for key in wanted:
                tensor = self._stacked[1][key]
                if tensor.shape[0] != self.num_experts:
                    raise ShapeMismatchError(f"{self.checkpoint.location}: '{key}' stacks {tensor.shape[0]} experts, "
                                             f"the config says {self.num_experts}")
                out[key] = tensor[expert]
        return out

    # -- modules ---------------------------------------------------------------------------
    def build_reference(self, layer: int, tensors: dict[str, torch.Tensor]) -> nn.Module:
        return self.reference_from(layer, self.reference_tensors(layer, tensors))

    def reference_tensors(self, layer: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Checkpoint tensors routed to the reference's own parameter names."""
        return {r.target: route_tensor(r, tensors[r.source]) for r in self.reference_routes(layer)}

    def reference_from(self, layer: int, routed: dict[str, torch.Tensor], on_call: bool = True) -> nn.Module:
        """transformers' MLP for the layer (or its experts module holding one expert) with these tensors;
        ``on_call=False``: a plain float32 module (see ReferenceModel.build)."""
        if self.mapping.experts is not None:
            from .moe import expert_reference

            path = self.mapping.reference_path(layer)
            return expert_reference(self.reference.meta_module(path), self.config, routed["gate"].float(),
                                    routed["up"].float(), routed["down"].float(), path)
        return self.reference.build(self.mapping.reference_path(layer), routed, self.hidden_size, on_call)

    def build_target(self, tensors: dict[str, torch.Tensor]) -> tuple[nn.Module, str]:
        with skip_init(), user_code(f"target {self.target_name()} could not be built"):
            module, name = build_target(self.mapping, self.config, self.target_spec)
        with user_code(f"target {name} could not be filled with the checkpoint's tensors", exceptions=False):
            notes = fill_target(module, self.mapping, tensors, self.config)
        for note in notes:
            if note not in self.target_notes:
                self.target_notes.append(note)
        return module.eval(), name

    # -- inputs ----------------------------------------------------------------------------
    def inputs(self, layer: int, reference: nn.Module, expert: int | None = None) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + layer + (0 if expert is None else 7919 * (expert + 1)))
        base = torch.randn(len(ROW_TARGETS), TOKENS, self.hidden_size, generator=generator)
        base = base / base.pow(2).mean(-1, keepdim=True).sqrt()  # unit RMS rows, as after a norm layer
        with torch.no_grad():
            z_base = preactivation(reference, base)
            z_zero = preactivation(reference, torch.zeros(1, 1, self.hidden_size))
        if z_base is None:
            return base * torch.tensor(ROW_TARGETS).view(-1, 1, 1)
        reach = (z_base - z_zero).abs().flatten(1).amax(1).clamp_min(1e-12)
        return base * (torch.tensor(ROW_TARGETS) / reach).view(-1, 1, 1)

    # -- one layer -------------------------------------------------------------------------
    def run_layer(self, layer: int, expert: int | None = None) -> tuple[LayerResult, str]:
        """Check one layer (one expert of it, for MoE).  Peak memory: the layer's weights as stored
        plus the float32 target; the reference upcasts one projection at a time (``parity.upcast``)."""
        tensors = self.read_layer(layer, expert, dtype=None)
        fingerprint = weights_fingerprint(tensors)
        # The reference first: a checkpoint that disagrees with its own config is bad input (exit 2);
        # only then is a tensor that does not fit the target the module's mistake (a failed layer).
        routed = self.reference_tensors(layer, tensors)  # views of ``tensors``: no copy
        reference = self.reference_from(layer, routed)
        try:
            target, target_name = self.build_target(tensors)
        except ShapeMismatchError as exc:
            return shape_failure(layer, expert, exc), self.target_name()
        del tensors
        x = self.inputs(layer, reference, expert)
        with torch.no_grad():  # every run gets its own copy of the inputs: a module that writes into
            z = preactivation(reference, x.clone())  # its input must not change what the others see
            out32 = reference(x.clone()).double()
            got, changed = run_target(target, target_name, x, out32.shape)
            again, changed_again = run_target(target, target_name, x, out32.shape)
            del target
            out64 = compute_in(reference, torch.float64)(x.double())  # one projection at a time in float64
        del reference
        gc.collect()
        runs = Runs(out64, out32, got, again, changed or changed_again)
        result = self.verdict(layer, expert, runs, routed, z)
        result.fingerprint = fingerprint
        if result.diagnosis is None and not result.passed and result.unverifiable is None and self.diagnose:
            result.diagnosis = self.explain(layer, expert, x, got, out64, result.tolerance)
        return result, target_name

    def verdict(self, layer: int, expert: int | None, runs: Runs, weights: dict[str, torch.Tensor],
                z: torch.Tensor | None) -> LayerResult:
        """compare.py's formula on this layer's runs; the findings that need no replay are named here."""
        noise = float((runs.reference32 - runs.reference64).abs().max())
        scale = float(runs.reference64.abs().max())
        tolerance = tolerance_for(noise, scale, self.atol)
        diff = (runs.target - runs.reference64).abs()
        finite = bool(torch.isfinite(runs.target).all())
        max_abs = float(diff.max()) if finite else None
        result = LayerResult(
            layer=layer, passed=False, max_abs_diff=max_abs,
            max_rel_diff=None if max_abs is None else max_abs / scale if scale else float("inf"),
            mean_abs_diff=float(diff.mean()) if finite else None,
            max_at=[int(i) for i in torch.unravel_index(diff.nan_to_num(float("inf")).argmax(), diff.shape)],
            noise_floor=noise, tolerance=tolerance,
            ratio_to_noise=None if max_abs is None else max_abs / noise if noise else float("inf") if max_abs else 0.0,
            preactivation_range=[float(z.min()), float(z.max())] if z is not None else None,
            deterministic=same_values(runs.target, runs.again), expert=expert, weights=self.checkpoint.weights,
        )
        result.unverifiable = unverifiable_reason(weights, runs, tolerance)
        if runs.input_change is not None:  # a definite bug whatever the reference can judge
            result.diagnosis = diagnosis(MistakeId.INPUT_MUTATED, None, max_abs, runs.input_change)
        elif result.unverifiable is not None:
            pass
        elif not finite:
            result.diagnosis = diagnosis(MistakeId.NONFINITE_OUTPUT, None, None, first_nonfinite(runs.target))
        elif not result.deterministic:  # no replay can match a moving target
            moved = float((runs.target - runs.again).abs().nan_to_num(float("inf")).max())
            result.diagnosis = diagnosis(MistakeId.DROPOUT_ACTIVE, moved, max_abs)
        else:
            result.passed = max_abs <= tolerance
        return result

    def explain(self, layer: int, expert: int | None, x: torch.Tensor, got: torch.Tensor, out64: torch.Tensor,
                tolerance: float) -> dict:
        """Replay known mistakes on transformers' MLP for this layer (see diagnose.py)."""
        routed = self.reference_tensors(layer, self.read_layer(layer, expert))
        return diagnose(lambda t: self.reference_from(layer, t, on_call=False), routed, self.config, x, got, out64,
                        tolerance)

    def report(self) -> Report:
        import transformers

        probe = self.reference.meta_module(self.mapping.reference_path(0))
        return Report(
            model=self.resolved.model,
            checkpoint=self.checkpoint.location,
            weights=self.checkpoint.weights,
            weights_note=self.checkpoint.weights_note,
            mapping=self.mapping.name,
            target=self.target_name(),
            reference=f"{type(probe).__module__}.{type(probe).__name__}",
            reference_activation=activation_name(probe, configured_activation(self.config)),
            versions={"parity": __version__, "transformers": transformers.__version__, "torch": torch.__version__},
            seed=self.seed,
            notes=list(self.resolved.notes),
        )

    def synthetic_layers(self, notes: list[str]) -> list[int] | None:
        """All layers, unless the synthetic model would be large: then first, middle and last.

        Random weights are the same kind of tensor at every depth; writing gigabytes of them
        proves nothing more than three layers do.
        """
        shapes = self.reference.tensor_shapes(self.mapping.reference_path(0)).values()
        layer_bytes = sum(math.prod(shape) for shape in shapes) * 2
        if layer_bytes * self.num_layers <= SYNTHETIC_BUDGET_BYTES:
            return None
        chosen = sorted({0, self.num_layers // 2, self.num_layers - 1})
        notes.append(f"synthetic weights of this size: checking layers {chosen} of {self.num_layers}; "
                            "--layers all checks every one")
        return chosen

    def expert_indices(self, spec: str | int | Iterable[int] | None) -> list[int | None]:
        """[None] for a dense model; the selected experts (default: all) for MoE."""
        if self.num_experts is None:
            if spec is not None and spec != "all":
                raise LayerRangeError(f"--experts {spec!r}: mapping '{self.mapping.name}' describes a dense model (no experts)")
            return [None]
        return parse_selection(spec, self.num_experts, "expert")

    def target_name(self) -> str:
        spec = self.target_spec if self.target_spec is not None else self.mapping.target_class
        return spec if isinstance(spec, str) else f"{spec.__module__}:{spec.__qualname__}"


def shape_failure(layer: int, expert: int | None, error: ShapeMismatchError) -> LayerResult:
    """A layer whose module cannot hold the checkpoint's tensors: failed, with the likely cause."""
    result = LayerResult(layer=layer, passed=False, max_abs_diff=None, max_rel_diff=None, mean_abs_diff=None,
                         max_at=None, noise_floor=None, tolerance=None, ratio_to_noise=None, preactivation_range=None,
                         expert=expert)
    result.diagnosis = diagnosis(error.mistake_id, None, None, str(error))
    return result


def weights_fingerprint(tensors: dict[str, torch.Tensor]) -> str:
    """A short hash of a layer's stored FFN tensors: a baseline of other weights must not be
    compared as if it were this checkpoint's (blake2b runs at ~1 GB/s: ~70 ms for a 1B layer)."""
    digest = hashlib.blake2b(digest_size=8)
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{list(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy())  # the buffer itself: no copy
    return digest.hexdigest()


def all_finite(tensor: torch.Tensor) -> bool:
    """No NaN/Inf.  aminmax propagates NaN and returns any Inf: one pass, ~100x faster on
    bfloat16 than ``isfinite(t).all()`` (0.4 s per 1B-model layer)."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    lo, hi = torch.aminmax(tensor)
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


class _Stop(Exception):
    """Raised by the activation's pre-hook: the rest of the forward is not needed."""


def preactivation(module: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """The input the module's activation sees for ``x`` (None when it has no activation child).

    The forward stops at the activation: the projections after it would be computed for nothing.
    """
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
    if z.dim() == 2 and x.dim() == 3:  # experts see tokens flattened, in order: one row per batch item again
        z = z.reshape(x.shape[0], -1, z.shape[-1])
    return z


def module_dtype(module: nn.Module, fallback: torch.dtype) -> torch.dtype:
    param = next(module.parameters(), None)
    return param.dtype if param is not None and param.is_floating_point() else fallback


def run_module(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Run a target in its own parameter dtype (a bf16 target computes in bf16) -> float64."""
    out = module(x.to(module_dtype(module, x.dtype)))
    if isinstance(out, tuple):
        out = out[0]
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"forward returned {type(out).__name__}, not a torch.Tensor")
    return out.double()


@contextlib.contextmanager
def user_code(what: str, exceptions: bool = True) -> Iterator[None]:
    """The module under test is the user's code: what it raises (even SystemExit) is a target error
    naming it, never a parity crash or an exit code of its choosing.  Ctrl-C stays Ctrl-C.
    ``exceptions=False`` where parity's own code runs too: only SystemExit and the like are the target's."""
    try:
        yield
    except (KeyboardInterrupt, ParityError):
        raise
    except BaseException as exc:  # noqa: BLE001 - SystemExit(0) from a target must not end parity with 0
        if isinstance(exc, Exception) and not exceptions:
            raise
        raise TargetError(f"{what}: {type(exc).__name__}: {exc}") from exc


def run_target(module: nn.Module, name: str, x: torch.Tensor, expected: torch.Size) -> tuple[torch.Tensor, str | None]:
    """``run_module`` on the target's own copy of ``x``; returns the output and what the target did to
    that copy (None: nothing).  Its failures are the user's to fix, not a parity crash."""
    fed = x.to(module_dtype(module, x.dtype), copy=True)
    before = fed.clone()
    with user_code(f"target {name} failed on an input of shape {list(x.shape)}"):
        out = run_module(module, fed)
    if tuple(out.shape) != tuple(expected):
        raise TargetError(f"target {name}: forward on an input of shape {list(x.shape)} returned shape "
                          f"{list(out.shape)}; the reference returns {list(expected)}")
    return out, input_change(before, fed)


def open_session(model: str, checkpoint: str | None = None, mapping: str | None = None, revision: str | None = None,
                 target: str | Any | None = None, seed: int = 0, atol: float | None = None,
                 allow_pickle: bool = False, require_real: bool = False) -> Session:
    resolved = resolve(model, checkpoint, mapping, revision, allow_pickle)
    if require_real and resolved.checkpoint.weights != "real":
        why = (resolved.checkpoint.weights_note or "").removeprefix("SYNTHETIC weights: ").split(";")[0]
        raise SyntheticWeightsError(
            f"{model}: real weights are required, but {why or 'only synthetic weights are available'}. Make it "
            "reachable (network, or an HF cache that holds it: HF_HOME) or pass --checkpoint PATH (checkpoint = "
            "\"...\" in a project file); to check the synthetic stand-in instead, drop --require-real "
            "(require_real = false in a project file)."
        )
    return Session(resolved, target=target, seed=seed, atol=atol)


def check(model: str, layers: str | int | Iterable[int] | None = None, target: str | Any | None = None,
          checkpoint: str | None = None, mapping: str | None = None, revision: str | None = None, seed: int = 0,
          atol: float | None = None, on_layer: Callable[[Report, LayerResult], None] | None = None,
          logits: bool = False, allow_pickle: bool = False, experts: str | int | Iterable[int] | None = None,
          require_real: bool = False) -> Report:
    """Check the selected layers (default: all), one at a time; returns the report the CLI prints.

    ``logits=True`` also substitutes the target into the full model and compares its logits;
    ``allow_pickle`` opts in to pickle-based files (torch.load(weights_only=True)); ``experts``
    selects the experts of an MoE model (default: all), each checked on its own; ``require_real``
    refuses the synthetic stand-in (SyntheticWeightsError) instead of checking random weights."""
    session = open_session(model, checkpoint, mapping, revision, target, seed, atol, allow_pickle, require_real)
    return run_session(session, layers, on_layer, logits, experts)


def run_session(session: Session, layers: str | int | Iterable[int] | None = None,
                on_layer: Callable[[Report, LayerResult], None] | None = None, logits: bool = False,
                experts: str | int | Iterable[int] | None = None) -> Report:
    """``check`` on an already opened session (``parity check`` plans with the same session it runs)."""
    report = session.report()
    if layers is None and session.checkpoint.weights == "synthetic":
        layers = session.synthetic_layers(report.notes)
    selected_experts = session.expert_indices(experts)
    with young_objects_only():  # the per-layer gc.collect() then costs milliseconds, not 0.5 s
        for layer in parse_selection(layers, session.num_layers):
            for expert in selected_experts:
                result, report.target = session.run_layer(layer, expert)
                report.notes.extend(n for n in session.target_notes if n not in report.notes)
                report.layers.append(result)
                if on_layer is not None:
                    on_layer(report, result)
    if logits:
        from .logits import logits_impact

        report.logits = logits_impact(session, sorted({r.layer for r in report.layers}))
    return report


def load_ffn(model: str, layer: int = 0, target: str | Any | None = None, checkpoint: str | None = None,
             mapping: str | None = None, revision: str | None = None, allow_pickle: bool = False,
             expert: int | None = None) -> nn.Module:
    """The target module (default: the mapping's, e.g. FeedForward for gpt2) holding ``layer``'s weights
    (of ``expert``, for MoE models), in eval mode."""
    session = open_session(model, checkpoint, mapping, revision, target, allow_pickle=allow_pickle)
    (layer,) = parse_selection(int(layer), session.num_layers)
    if session.num_experts is not None and expert is None:
        raise LayerRangeError(f"'{model}' is a mixture of experts ({session.num_experts} per layer): pass expert=N")
    (expert,) = session.expert_indices(None if expert is None else [int(expert)])
    module, _ = session.build_target(session.read_layer(layer, expert))
    return module
