"""What a check found: per-layer results and the run's context (plain data, no torch).

The JSON field names are a stable interface (CI users parse them); add, never rename.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from parity.definitions.records import Candidate, Diagnosis, Separability

__all__ = ["Candidate", "Diagnosis", "LayerResult", "Report", "Separability", "WeightsKind"]

WeightsKind = Literal["real", "synthetic"]  # a checkpoint's own weights, or the synthetic stand-in

SCHEMA_VERSION = 1
# The JSON Schema of what --json writes (reports, `parity check` suites, `parity inspect`); shipped in the package.
SCHEMA_FILE = Path(__file__).resolve().parent.parent / "schema" / "report.schema.json"


@dataclass
class LayerResult:
    """One layer's verdict.  Metrics are None when the module could not even be loaded (shape mismatch)."""

    layer: int
    passed: bool
    max_abs_diff: float | None
    max_rel_diff: float | None  # max |diff| / max |reference|
    mean_abs_diff: float | None
    max_at: list[int] | None  # [batch, token, channel] of the max |diff|
    noise_floor: float | None  # max |reference float32 - reference float64|
    tolerance: float | None
    ratio_to_noise: float | None
    preactivation_range: list[float] | None  # [min, max] of the activation's input reached
    deterministic: bool = True
    diagnosis: Diagnosis | None = None  # the known mistake that explains a failing layer, with its evidence
    expert: int | None = None  # MoE: which expert of the layer; null for dense models
    unit: str | None = None  # a unit of the layer that is neither the layer's FFN nor a routed expert: its name
    weights: WeightsKind = "real"  # where this layer's weights came from
    fingerprint: str | None = None  # hash of the layer's stored FFN tensors (names, dtypes, shapes, bytes)
    unverifiable: str | None = None  # why this comparison could not tell right from wrong (then passed is false)
    # low-precision runs only (--dtype bfloat16 / float16); null in float32 runs:
    reference_error: float | None = None  # max |reference in the compute dtype on the device - reference float64|
    ratio_to_reference_error: float | None = None  # max_abs_diff / reference_error
    separability: list[Separability] | None = None  # low precision or --atol: which mistakes are told apart
    # against a stored baseline (--baseline): {key, status: ok|regressed|other_weights|not_compared, max_abs_diff,
    # passed, target, message}; null when the run had no baseline
    baseline: dict | None = None
    # a whole MoE block (unit 'block'): {tokens, tokens_per_expert, never_chosen, set_aside, set_aside_agree}:
    # how much of the routing the inputs exercised, and the near-tie tokens judged apart; null for other units
    coverage: dict | None = None

    def __post_init__(self):
        """A diagnosis or separability rows given as plain dicts (a report read back from JSON) become records."""
        if isinstance(self.diagnosis, dict):
            found = dict(self.diagnosis)
            found["candidates"] = [c if isinstance(c, Candidate) else Candidate(**c)
                                   for c in found.get("candidates") or []]
            self.diagnosis = Diagnosis(**found)
        if self.separability is not None:
            self.separability = [row if isinstance(row, Separability) else Separability(**row)
                                 for row in self.separability]

    @property
    def regressed(self) -> bool:
        """Within tolerance or not, its deviation grew beyond the baseline's (or it passed there and fails now)."""
        return self.baseline is not None and self.baseline.get("status") == "regressed"

    @property
    def not_checked(self) -> list[Separability]:
        """The known mistakes this layer's check cannot tell from a correct module at its dtype."""
        return [s for s in self.separability or [] if not s.checked]


@dataclass
class Report:
    model: str
    checkpoint: str
    weights: WeightsKind
    mapping: str
    target: str
    reference: str  # transformers class of the reference MLP
    reference_activation: str
    versions: dict[str, str]
    seed: int
    weights_note: str | None = None
    notes: list[str] = field(default_factory=list)
    layers: list[LayerResult] = field(default_factory=list)
    logits: dict | None = None  # --logits: the target substituted inside the full model
    device: str = "cpu"  # where the target ran
    dtype: str = "float32"  # the target's compute dtype; the truth is always float64 on the CPU
    # how the target was filled: {inferred, extends, args, tensors} as a mapping file writes them (--save-mapping)
    routes: dict | None = None
    name: str | None = None  # the check's name in a project file ([[checks]] name): its baseline key and heading
    atol: float | None = None  # --atol: a tolerance that is not parity's own (separability is then stated)
    # how transformers' MLP (the oracle) was filled: its parameter (HF name) -> checkpoint tensor, as spelled in a
    # mapping file; identity routes for a checkpoint under transformers' own names
    reference_routes: dict | None = None
    framework: str = "torch"  # what the target is written in: torch, mlx, flax.nnx, numpy, onnx (parity.targets)
    units: list[str] = field(default_factory=list)  # the named units a layer may hold beside routed experts
    # the layout derived from transformers that this run used (no mapping file): --save-mapping writes it in full;
    # not part of the JSON (its routes are)
    layout: Any = field(default=None, repr=False, compare=False)

    @property
    def unit_width(self) -> int:
        """The width of the text table's expert column: an expert number, or the longest unit name."""
        return max([6, *(len(unit) for unit in self.units)])

    @property
    def low_precision(self) -> bool:
        return self.dtype != "float32"

    @property
    def passed(self) -> bool:
        """No layer checked is no evidence: an empty report never passes; nor does one that regressed against
        its baseline."""
        return bool(self.layers) and all(layer.passed and not layer.regressed for layer in self.layers)

    @property
    def regressed(self) -> list[LayerResult]:
        return [layer for layer in self.layers if layer.regressed]

    @property
    def unverifiable(self) -> list[LayerResult]:
        return [layer for layer in self.layers if layer.unverifiable is not None]

    @property
    def synthetic(self) -> bool:
        """Any layer checked on synthetic (random) weights: the pass then says nothing about a real checkpoint."""
        return self.weights == "synthetic" or any(layer.weights == "synthetic" for layer in self.layers)

    @property
    def status(self) -> str:
        """'pass' | 'fail' (some layer deviates) | 'regressed' (every layer within tolerance, some grew beyond the
        baseline) | 'unverifiable' (nothing checked, or a layer that cannot be judged)."""
        if not self.layers or self.unverifiable:
            return "unverifiable"
        if any(not layer.passed for layer in self.layers):
            return "fail"
        return "regressed" if self.regressed else "pass"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(replace(self, layout=None))
        del data["layout"]
        for layer, result in zip(data["layers"], self.layers, strict=True):
            layer["status"] = layer_status(result)
        data = {"schema_version": SCHEMA_VERSION, "passed": self.passed, "status": self.status, **data}
        return finite_json(data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        """The text report, as `parity MODEL` prints it (``parity.render``)."""
        return _RENDERERS["text"](self) if "text" in _RENDERERS else self._plain()

    def _repr_html_(self) -> str | None:
        """Jupyter shows this: the same report, as HTML."""
        return _RENDERERS["html"](self) if "html" in _RENDERERS else None

    def _plain(self) -> str:
        """One line, for a process that never imported a renderer: model, target, verdict."""
        return f"parity report: {self.model} [{self.target}]: {self.status}, {len(self.layers)} layer(s) checked"


# Renderers live in parity.outputs, above the engine: parity.outputs.render registers them here when imported
# (parity.api and parity.testing import it), so a Report prints as its text table, and the engine never imports
# upward (tests/test_architecture.py counts function-level imports too).
_RENDERERS: dict[str, Callable[[Report], str]] = {}


def register_renderers(**renderers: Callable[[Report], str]) -> None:
    """``text=`` and ``html=`` render a Report for ``str(report)`` and notebooks' ``_repr_html_``."""
    _RENDERERS.update(renderers)


def within_layer(result: LayerResult) -> str | None:
    """Which unit of its layer a result is: 'e1' for routed expert 1, a named unit ('shared_expert'), or None for
    the layer's one FFN."""
    return f"e{result.expert}" if result.expert is not None else result.unit


def units_noun(results: list[LayerResult]) -> str:
    """'layer', 'expert', or 'unit' where a report holds both (dense layers before MoE ones, shared experts)."""
    kinds = {"expert" if r.expert is not None else "layer" if r.unit is None else "unit" for r in results}
    return kinds.pop() if len(kinds) == 1 else "unit"


def layer_status(result: LayerResult) -> str:
    """'unverifiable' | 'fail' | 'regressed' (within tolerance, beyond the baseline) | 'pass'."""
    if result.unverifiable is not None:
        return "unverifiable"
    if not result.passed:
        return "fail"
    return "regressed" if result.regressed else "pass"


def finite_json(value: Any) -> Any:
    """NaN/Inf become null: strict JSON parsers (and CI tools) reject the bare NaN json.dumps writes."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite_json(v) for v in value]
    return value
