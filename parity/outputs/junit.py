"""JUnit XML for CI systems (GitHub, GitLab, Jenkins): one <testsuite> per check, one
<testcase> per layer (per expert when the layer has experts).  A deviation is a
<failure> carrying the numbers and the diagnosis; a check that could not run is an
<error>, so a CI page tells a broken set-up from a wrong module.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Iterable
from pathlib import Path

from parity.engine.results import LayerResult, Report
from parity.outputs.atomic import write_output
from parity.outputs.text import coverage_line, layer_line, not_checked_summary, separability_lines


def case_name(layer: LayerResult) -> str:
    """'layer 3', 'layer 3 expert 1'; '(synthetic weights)' appended so no CI page shows a bare pass of random
    weights."""
    name = f"layer {layer.layer}"
    name = name if layer.expert is None else f"{name} expert {layer.expert}"
    name = name if layer.unit is None else f"{name} {layer.unit}"
    return f"{name} (synthetic weights)" if layer.weights == "synthetic" else name


def failure_message(layer: LayerResult) -> str:
    if layer.max_abs_diff is None:  # no numbers: the diagnosis says why (non-finite output, a missing layer, ...)
        parts = [] if layer.diagnosis else ["the module cannot be loaded with this layer's tensors"]
    elif layer.max_abs_diff <= layer.tolerance:
        parts = [f"max|Δ| {layer.max_abs_diff:.3e} within tolerance {layer.tolerance:.3e}"]
    elif layer.ratio_to_reference_error is not None:  # a low-precision run: judged against the reference's own error
        parts = [f"max|Δ| {layer.max_abs_diff:.3e} > tolerance {layer.tolerance:.3e} "
                 f"({layer.ratio_to_reference_error:.1f}x the reference's own error {layer.reference_error:.2e} "
                 "in the run's dtype)"]
    else:
        parts = [f"max|Δ| {layer.max_abs_diff:.3e} > tolerance {layer.tolerance:.3e} "
                 f"({layer.ratio_to_noise:.1f}x the noise floor {layer.noise_floor:.2e})"]
    if not layer.deterministic:
        parts.append("output is non-deterministic (dropout or train mode?)")
    diagnosis = layer.diagnosis
    if diagnosis:
        text = f"diagnosis {diagnosis.id}: {diagnosis.message}"
        if diagnosis.distance is not None and diagnosis.reference_distance is not None:
            text += (f" (distance {diagnosis.distance:.2e}; "
                     f"to the correct reference {diagnosis.reference_distance:.2e})")
        parts.append(text)
    return "; ".join(parts)


def build_junit(runs: Iterable, regressions: dict[int, str] | None = None, other_weights: dict[int, str] | None = None,
                baseline_error: str | None = None) -> ET.Element:
    """``runs``: objects with ``label``, ``report`` (Report | None), ``error`` (str | None) and
    ``seconds`` (per layer).  ``regressions``: id(LayerResult) -> baseline message (a failure too);
    ``other_weights``: the same for entries made from other weights (not compared: a failure, so a
    CI page does not show the layer as checked against the baseline); ``baseline_error``: why the
    baseline as a whole cannot be trusted, an <error> of its own."""
    baseline = {"regressions": regressions or {}, "other_weights": other_weights or {}}
    root = ET.Element("testsuites", name="parity")
    totals = {"tests": 0, "failures": 0, "errors": 0}
    for run in runs:
        suite = ET.SubElement(root, "testsuite", name=run.label)
        counts = {"tests": 0, "failures": 0, "errors": 0}
        if run.report is not None:
            add_properties(suite, run.report)
            for index, layer in enumerate(run.report.layers):
                seconds = run.seconds[index] if index < len(run.seconds) else 0.0
                case = ET.SubElement(suite, "testcase", name=case_name(layer), classname=run.label,
                                     time=f"{seconds:.3f}")
                counts["tests"] += 1
                outcome = add_outcome(case, layer, baseline)
                if outcome is not None:
                    counts[outcome] += 1
                if layer.coverage is not None:  # a whole MoE block: what its inputs exercised, and what was set aside
                    ET.SubElement(case, "system-out").text = coverage_line(layer)
        if run.error is not None:
            counts["tests"] += 1
            counts["errors"] += 1
            case = ET.SubElement(suite, "testcase", name="set-up", classname=run.label, time="0.000")
            ET.SubElement(case, "error", message=run.error, type="ParityError").text = run.error
        close_suite(suite, counts, totals, sum(run.seconds))
    if baseline_error is not None:
        suite = ET.SubElement(root, "testsuite", name="baseline")
        case = ET.SubElement(suite, "testcase", name="baseline", classname="baseline", time="0.000")
        ET.SubElement(case, "error", message=baseline_error, type="BaselineError").text = baseline_error
        close_suite(suite, {"tests": 1, "failures": 0, "errors": 1}, totals, 0.0)
    for key, value in totals.items():
        root.set(key, str(value))
    return root


def add_properties(suite: ET.Element, report: Report) -> None:
    props = ET.SubElement(suite, "properties")
    for name, value in (("checkpoint", report.checkpoint), ("weights", report.weights), ("target", report.target),
                        ("reference", report.reference), ("reference_activation", report.reference_activation),
                        ("dtype", report.dtype), ("device", report.device),
                        ("framework", getattr(report, "framework", "torch")),
                        *((f"version.{k}", v) for k, v in report.versions.items())):
        ET.SubElement(props, "property", name=name, value=str(value))
    caveat = not_checked_summary(report).strip()
    if caveat:  # a pass that cannot tell some mistakes apart says so on the CI page too
        ET.SubElement(props, "property", name="not_checked", value=caveat)
        ET.SubElement(suite, "system-out").text = "\n".join(separability_lines(report)).strip() or caveat


def add_outcome(case: ET.Element, layer: LayerResult, baseline: dict[str, dict[int, str]]) -> str | None:
    """The case's <error> (unverifiable) or <failure> (mismatch, baseline finding); which one, or None."""
    if layer.unverifiable is not None:  # an error, not a failure: the set-up cannot judge the module
        ET.SubElement(case, "error", message=f"unverifiable: {layer.unverifiable}",
                      type="Unverifiable").text = layer_line(layer)
        return "errors"
    problems = [failure_message(layer)] if not layer.passed else []
    problems += ["baseline: " + found[id(layer)] for found in baseline.values() if id(layer) in found]
    if not problems:
        return None
    kind = ("Mismatch" if not layer.passed else "BaselineRegression" if id(layer) in baseline["regressions"]
            else "BaselineOtherWeights")
    ET.SubElement(case, "failure", message="; ".join(problems), type=kind).text = layer_line(layer)
    return "failures"


def close_suite(suite: ET.Element, counts: dict[str, int], totals: dict[str, int], seconds: float) -> None:
    for key, value in counts.items():
        suite.set(key, str(value))
        totals[key] += value
    suite.set("skipped", "0")
    suite.set("time", f"{seconds:.3f}")


def write_junit(path: str | Path, runs: Iterable, regressions: dict[int, str] | None = None,
                other_weights: dict[int, str] | None = None, baseline_error: str | None = None) -> None:
    """Atomically: a CI page must never parse half a report (parity.outputs.atomic)."""
    tree = ET.ElementTree(build_junit(runs, regressions, other_weights, baseline_error))
    ET.indent(tree)
    text = ET.tostring(tree.getroot(), encoding="unicode")
    write_output(path, "<?xml version='1.0' encoding='utf-8'?>\n" + text + "\n", "--junit")
