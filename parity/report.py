"""What a check found: per-layer results, the run's context, and its renderings.

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


def _sci(value: float | None) -> str:
    return "-" if value is None else f"{value:.2e}"


HEADER = f"{'layer':>5}  {'max|Δ|':>9}  {'rel':>9}  {'mean|Δ|':>9}  {'noise':>9}  {'tol':>9}  {'×noise':>7}  {'z range':>15}  verdict"


EXPERT_HEADER = f"{'layer':>5}  {'expert':>6}" + HEADER[5:]


def table_header(result: LayerResult) -> str:
    """The column header for a table whose rows look like ``result`` (an expert column for MoE)."""
    return HEADER if result.expert is None else EXPERT_HEADER


def header_lines(report: Report) -> list[str]:
    lines = [
        f"parity: {report.model} — mapping '{report.mapping}'",
        f"  checkpoint  {report.checkpoint} ({report.weights} weights)",
        f"  target      {report.target}",
        f"  reference   transformers {report.versions.get('transformers', '?')} {report.reference} "
        f"(activation: {report.reference_activation})",
    ]
    if report.weights_note:
        lines.append(f"  !! {report.weights_note}")
    lines.extend(f"  note: {note}" for note in report.notes)
    return lines


def layer_line(result: LayerResult) -> str:
    zrange = "-" if result.preactivation_range is None else "[{:.1f}, {:.1f}]".format(*result.preactivation_range)
    ratio = "-" if result.ratio_to_noise is None else f"{result.ratio_to_noise:.1f}"
    verdict = "ok" if result.passed else "UNVERIFIABLE" if result.unverifiable is not None else "MISMATCH"
    if result.diagnosis:
        verdict += f" — {result.diagnosis['id']}"
    cell = f"{result.layer:>5}" if result.expert is None else f"{result.layer:>5}  {result.expert:>6}"
    return (f"{cell}  {_sci(result.max_abs_diff):>9}  {_sci(result.max_rel_diff):>9}  "
            f"{_sci(result.mean_abs_diff):>9}  {_sci(result.noise_floor):>9}  {_sci(result.tolerance):>9}  "
            f"{ratio:>7}  {zrange:>15}  {verdict}")


def unit_label(result: LayerResult) -> str:
    """'3' for a layer, '3/e1' for expert 1 of layer 3."""
    return str(result.layer) if result.expert is None else f"{result.layer}/e{result.expert}"


def diagnosis_lines(report: Report) -> list[str]:
    """One block per distinct diagnosis: the evidence and the fix; then why layers could not be verified."""
    lines, seen = [], set()
    reasons: dict[str, list[str]] = {}
    for result in report.unverifiable:
        reasons.setdefault(result.unverifiable, []).append(unit_label(result))
    for reason, units in reasons.items():
        lines += [f"unverifiable (layers {', '.join(units)}): {reason}",
                  "  a pass here would prove nothing; check weights that can tell a right module from a wrong one", ""]
    for result in report.layers:
        d = result.diagnosis
        if not d or d["id"] in seen:
            continue
        seen.add(d["id"])
        layers = [unit_label(r) for r in report.layers if r.diagnosis and r.diagnosis["id"] == d["id"]]
        lines.append(f"diagnosis {d['id']} (layers {', '.join(map(str, layers))}): {d['message']}")
        if d.get("distance") is not None and d.get("reference_distance") is not None:
            lines.append(f"  evidence: the module is {d['distance']:.2e} from this mistake's replay "
                         f"and {d['reference_distance']:.2e} from transformers")
        lines.append(f"  fix: {d['fix']}")
        lines.append("")
    return lines


def _units(results: list[LayerResult]) -> str:
    return ", ".join(unit_label(r) for r in results[:12]) + (" ..." if len(results) > 12 else "")


SYNTHETIC_WARNING = "SYNTHETIC weights: no real checkpoint weight was read (--require-real refuses this)."


def summary_line(report: Report) -> str:
    """The one line CI logs show (also with --quiet): the verdict, and what it rests on."""
    if not report.layers:
        return "ERROR: no layer was checked: nothing was compared, so this is not a pass."
    unit = "expert(s)" if report.layers[0].expert is not None else "layer(s)"
    failed = [r for r in report.layers if not r.passed and r.unverifiable is None]
    unverifiable = report.unverifiable
    if failed:
        line = f"FAIL: {len(failed)} of {len(report.layers)} {unit} deviate from transformers: {_units(failed)}"
        if unverifiable:
            line += f"; {len(unverifiable)} could not be verified: {_units(unverifiable)}"
    elif unverifiable:
        line = (f"ERROR: {len(unverifiable)} of {len(report.layers)} {unit} could not be verified "
                f"({unverifiable[0].unverifiable}): {_units(unverifiable)}")
    else:
        line = f"PASS: {len(report.layers)} {unit} match transformers within tolerance."
    return f"{line} {SYNTHETIC_WARNING}" if report.synthetic else line


def logits_lines(report: Report) -> list[str]:
    logits = report.logits
    if not logits:
        return []
    if logits.get("skipped"):
        return [f"logits impact: not measured: {logits['skipped']}", ""]
    return [
        f"logits impact ({logits['weights']}): target substituted for layer(s) {logits['layers']} of the full model, "
        f"{logits['tokens']} fixed tokens",
        f"  final logits max |Δ| = {logits['max_abs_diff']:.2e} (logit scale {logits['logit_scale']:.2e}); "
        f"top-1 agreement {logits['top1_agreement']:.1%}",
        "",
    ]


def render(report: Report) -> str:
    header = table_header(report.layers[0]) if report.layers else HEADER
    return "\n".join([*header_lines(report), "", header, *map(layer_line, report.layers), "",
                      *diagnosis_lines(report), *logits_lines(report), summary_line(report)])
