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
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from . import __version__
from .errors import LayerRangeError, MissingTensorError, WeightDefectError
from .mapping import ConfigValue, Mapping
from .memory import young_objects_only
from .reference import ReferenceModel, activation_module, activation_name, configured_activation
from .report import LayerResult, Report
from .resolve import Resolved, resolve
from .mapping import TensorRoute
from .target import build_target, fill_target, route_tensor
from .upcast import compute_in

ROW_TARGETS = (1.0, 3.0, 8.0)  # max |pre-activation| aimed at by each batch row
TOKENS = 16
NOISE_FACTOR = 16.0  # tolerance = NOISE_FACTOR x noise floor ...
RELATIVE_FLOOR = 2.0 ** -20  # ... but never below this x max |reference| (fp32 rounding of the output)
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


def parse_layers(spec: str | int | Iterable[int] | None, num_layers: int) -> list[int]:
    """'all' | '3' | '0,3,5' | '2-7' | [0, 3] -> validated layer indices."""
    if spec is None or spec == "all":
        return list(range(num_layers))
    if isinstance(spec, int):
        layers = [spec]
    elif isinstance(spec, str):
        layers = []
        for part in spec.split(","):
            part = part.strip()
            try:
                if "-" in part.lstrip("-"):
                    lo, hi = part.split("-", 1) if not part.startswith("-") else ("-" + part[1:].split("-")[0], part[1:].split("-", 1)[1])
                    layers.extend(range(int(lo), int(hi) + 1))
                else:
                    layers.append(int(part))
            except ValueError:
                raise LayerRangeError(f"--layers {spec!r}: expected 'all', N, 'N,M,...' or 'N-M'") from None
    else:
        layers = list(spec)
    for layer in layers:
        if not 0 <= layer < num_layers:
            raise LayerRangeError(f"layer {layer} is out of range: this model has {num_layers} layers (valid: 0-{num_layers - 1})")
    return layers


class Session:
    """Everything resolved once for a run; ``run_layer`` then works on one layer at a time."""

    def __init__(self, resolved: Resolved, target: str | Any | None = None, seed: int = 0, atol: float | None = None):
        self.resolved = resolved
        self.mapping: Mapping = resolved.mapping
        self.checkpoint = resolved.checkpoint
        self.config = resolved.config
        self.target_spec = target
        self.seed = seed
        self.atol = atol
        self.reference = ReferenceModel(self.config)
        self.num_layers = int(ConfigValue(self.config, self.mapping.path)(self.mapping.num_layers, "num_layers"))
        self.hidden_size = int(ConfigValue(self.config, self.mapping.path)(self.mapping.hidden_size, "hidden_size"))

    # -- tensors ---------------------------------------------------------------------------
    def reference_routes(self, layer: int) -> list[TensorRoute]:
        """Reference parameter (HF name) <- checkpoint tensor; by default the same name."""
        given = {route.target: route for route in self.mapping.reference_tensors}
        names = self.reference.tensor_shapes(self.mapping.reference_path(layer))
        return [given.get(name, TensorRoute(name, name)) for name in names]

    def layer_prefix(self, layer: int) -> str:
        """The checkpoint key prefix under which this layer's FFN tensors are stored."""
        sources = [route.source for route in self.reference_routes(layer)]
        block = self.mapping.layer_prefix(layer)
        for prefix in self.mapping.key_prefixes:
            if all(self.checkpoint.has(f"{prefix}{block}.{name}") for name in sources):
                return f"{prefix}{block}."
        wanted = [f"{self.mapping.key_prefixes[0]}{block}.{name}" for name in sources]
        absent = [w for w in wanted if not self.checkpoint.has(w)]
        hints = "; ".join(f"{w} (closest present: {', '.join(self.checkpoint.closest(w)) or 'none'})" for w in absent)
        raise MissingTensorError(
            f"{self.checkpoint.location}: layer {layer}'s FFN tensors are missing (tried key prefixes "
            f"{self.mapping.key_prefixes} from {self.mapping.path.name}): {hints}"
        )

    def read_layer(self, layer: int, dtype: torch.dtype | None = torch.float32) -> dict[str, torch.Tensor]:
        """The layer's FFN tensors under names relative to the layer, upcast to ``dtype`` (None: as stored)."""
        prefix = self.layer_prefix(layer)
        routes = [*self.reference_routes(layer), *self.mapping.tensors]
        wanted = list(dict.fromkeys(r.source for r in routes if not r.optional or self.checkpoint.has(prefix + r.source)))
        raw = self.checkpoint.read([prefix + n for n in wanted])
        tensors = {}
        for name in wanted:
            tensor = raw.pop(prefix + name)
            if not all_finite(tensor):
                bad = int((~torch.isfinite(tensor)).sum())
                raise WeightDefectError(
                    f"{self.checkpoint.location}: tensor '{prefix + name}' holds {bad} NaN/Inf values: "
                    "the checkpoint is defective (not a module mismatch)"
                )
            tensors[name] = tensor if dtype is None or not tensor.is_floating_point() else tensor.to(dtype)
        return tensors

    # -- modules ---------------------------------------------------------------------------
    def build_reference(self, layer: int, tensors: dict[str, torch.Tensor]) -> nn.Module:
        routed = {r.target: route_tensor(r, tensors[r.source]) for r in self.reference_routes(layer)}
        return self.reference.build(self.mapping.reference_path(layer), routed, self.hidden_size)

    def build_target(self, tensors: dict[str, torch.Tensor]) -> tuple[nn.Module, str]:
        with skip_init():
            module, name = build_target(self.mapping, self.config, self.target_spec)
        fill_target(module, self.mapping, tensors, self.config)
        return module.eval(), name

    # -- inputs ----------------------------------------------------------------------------
    def inputs(self, layer: int, reference: nn.Module) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + layer)
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
    def run_layer(self, layer: int) -> tuple[LayerResult, str]:
        """Check one layer.  Peak memory: the layer's weights as stored plus the float32 target;
        the reference upcasts one projection at a time (``parity.upcast``), never the model."""
        tensors = self.read_layer(layer, dtype=None)
        target, target_name = self.build_target(tensors)
        reference = self.build_reference(layer, tensors)  # shares storage with ``tensors``
        del tensors
        x = self.inputs(layer, reference)
        with torch.no_grad():
            z = preactivation(reference, x)
            out32 = reference(x).double()
            got = run_module(target, x)
            again = run_module(target, x)
            del target
            out64 = compute_in(reference, torch.float64)(x.double())  # one projection at a time in float64
        del reference
        gc.collect()
        noise = float((out32 - out64).abs().max())
        scale = float(out64.abs().max())
        diff = (got - out64).abs()
        max_abs = float(diff.max())
        tolerance = self.atol if self.atol is not None else max(NOISE_FACTOR * noise, RELATIVE_FLOOR * scale)
        deterministic = bool(torch.equal(got, again))
        result = LayerResult(
            layer=layer,
            passed=bool(max_abs <= tolerance) and deterministic,
            max_abs_diff=max_abs,
            max_rel_diff=max_abs / scale if scale else float("inf"),
            mean_abs_diff=float(diff.mean()),
            max_at=[int(i) for i in torch.unravel_index(diff.argmax(), diff.shape)],
            noise_floor=noise,
            tolerance=tolerance,
            ratio_to_noise=max_abs / noise if noise else float("inf") if max_abs else 0.0,
            preactivation_range=[float(z.min()), float(z.max())] if z is not None else [float("nan")] * 2,
            deterministic=deterministic,
        )
        return result, target_name

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

    def synthetic_layers(self, report: Report) -> list[int] | None:
        """All layers, unless the synthetic model would be large: then first, middle and last.

        Random weights are the same kind of tensor at every depth; writing gigabytes of them
        proves nothing more than three layers do.
        """
        shapes = self.reference.tensor_shapes(self.mapping.reference_path(0)).values()
        layer_bytes = sum(math.prod(shape) for shape in shapes) * 2
        if layer_bytes * self.num_layers <= SYNTHETIC_BUDGET_BYTES:
            return None
        chosen = sorted({0, self.num_layers // 2, self.num_layers - 1})
        report.notes.append(f"synthetic weights of this size: checking layers {chosen} of {self.num_layers}; "
                            "--layers all checks every one")
        return chosen

    def target_name(self) -> str:
        spec = self.target_spec if self.target_spec is not None else self.mapping.target_class
        return spec if isinstance(spec, str) else f"{spec.__module__}:{spec.__qualname__}"


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
    return seen[0] if seen else None


def run_module(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Run a target in its own parameter dtype (a bf16 target computes in bf16) -> float64."""
    param = next(module.parameters(), None)
    dtype = param.dtype if param is not None and param.is_floating_point() else x.dtype
    out = module(x.to(dtype))
    if isinstance(out, tuple):
        out = out[0]
    return out.double()


def open_session(model: str, checkpoint: str | None = None, mapping: str | None = None, revision: str | None = None,
                 target: str | Any | None = None, seed: int = 0, atol: float | None = None) -> Session:
    return Session(resolve(model, checkpoint, mapping, revision), target=target, seed=seed, atol=atol)


def check(model: str, layers: str | int | Iterable[int] | None = None, target: str | Any | None = None,
          checkpoint: str | None = None, mapping: str | None = None, revision: str | None = None, seed: int = 0,
          atol: float | None = None, on_layer: Callable[[Report, LayerResult], None] | None = None) -> Report:
    """Check the selected layers (default: all), one at a time; returns the report the CLI prints."""
    session = open_session(model, checkpoint, mapping, revision, target, seed, atol)
    report = session.report()
    if layers is None and session.checkpoint.weights == "synthetic":
        layers = session.synthetic_layers(report)
    with young_objects_only():  # the per-layer gc.collect() then costs milliseconds, not 0.5 s
        for layer in parse_layers(layers, session.num_layers):
            result, report.target = session.run_layer(layer)
            report.layers.append(result)
            if on_layer is not None:
                on_layer(report, result)
    return report


def load_ffn(model: str, layer: int = 0, target: str | Any | None = None, checkpoint: str | None = None,
             mapping: str | None = None, revision: str | None = None) -> nn.Module:
    """The target module (default: the mapping's, e.g. FeedForward for gpt2) holding ``layer``'s weights, in eval mode."""
    session = open_session(model, checkpoint, mapping, revision, target)
    (layer,) = parse_layers(int(layer), session.num_layers)
    module, _ = session.build_target(session.read_layer(layer))
    return module
