"""What a check found: per-layer results and the run's context (plain data, no torch).

The JSON field names are a stable interface (CI users parse them); add, never rename.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

SCHEMA_VERSION = 1


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
    diagnosis: dict | None = None  # {id, message, fix, distance, reference_distance}
    expert: int | None = None  # MoE: which expert of the layer; null for dense models
    weights: str = "real"  # where this layer's weights came from: "real" | "synthetic"
    fingerprint: str | None = None  # hash of the layer's stored FFN tensors (names, dtypes, shapes, bytes)
    unverifiable: str | None = None  # why this comparison could not tell right from wrong (then passed is false)


@dataclass
class Report:
    model: str
    checkpoint: str
    weights: str  # "real" | "synthetic"
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

    @property
    def passed(self) -> bool:
        """No layer checked is no evidence: an empty report never passes."""
        return bool(self.layers) and all(layer.passed for layer in self.layers)

    @property
    def unverifiable(self) -> list[LayerResult]:
        return [layer for layer in self.layers if layer.unverifiable is not None]

    @property
    def synthetic(self) -> bool:
        """Any layer checked on synthetic (random) weights: the pass then says nothing about a real checkpoint."""
        return self.weights == "synthetic" or any(layer.weights == "synthetic" for layer in self.layers)

    @property
    def status(self) -> str:
        """'pass' | 'fail' (some layer deviates) | 'unverifiable' (nothing checked, or a layer that cannot be judged)."""
        if not self.layers or self.unverifiable:
            return "unverifiable"
        return "pass" if self.passed else "fail"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for layer, result in zip(data["layers"], self.layers):
            layer["status"] = layer_status(result)
        data = {"schema_version": SCHEMA_VERSION, "passed": self.passed, "status": self.status, **data}
        return finite_json(data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def layer_status(result: LayerResult) -> str:
    return "unverifiable" if result.unverifiable is not None else "pass" if result.passed else "fail"


def finite_json(value: Any) -> Any:
    """NaN/Inf become null: strict JSON parsers (and CI tools) reject the bare NaN json.dumps writes."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite_json(v) for v in value]
    return value
