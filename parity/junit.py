"""JUnit XML for CI systems (GitHub, GitLab, Jenkins): one <testsuite> per check, one
<testcase> per layer (per expert when the layer has experts).  A deviation is a
<failure> carrying the numbers and the diagnosis; a check that could not run is an
<error>, so a CI page tells a broken set-up from a wrong module.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Iterable

from .errors import ParityError
from .report import LayerResult, Report, layer_line


def case_name(layer: LayerResult) -> str:
    name = f"layer {layer.layer}"
    return name if layer.expert is None else f"{name} expert {layer.expert}"


def failure_message(layer: LayerResult) -> str:
    if layer.max_abs_diff is None:  # the module could not hold the checkpoint's tensors: no numbers
        parts = ["the module cannot be loaded with this layer's tensors"]
    elif layer.max_abs_diff <= layer.tolerance:
        parts = [f"max|Δ| {layer.max_abs_diff:.3e} within tolerance {layer.tolerance:.3e}"]
    else:
        parts = [f"max|Δ| {layer.max_abs_diff:.3e} > tolerance {layer.tolerance:.3e} "
                 f"({layer.ratio_to_noise:.1f}x the noise floor {layer.noise_floor:.2e})"]
    if not layer.deterministic:
        parts.append("output is non-deterministic (dropout or train mode?)")
    diagnosis = layer.diagnosis
    if diagnosis:
        text = f"diagnosis {diagnosis.get('id')}: {diagnosis.get('message')}"
        if diagnosis.get("distance") is not None and diagnosis.get("reference_distance") is not None:
            text += f" (distance {diagnosis['distance']:.2e}; to the correct reference {diagnosis['reference_distance']:.2e})"
        parts.append(text)
    return "; ".join(parts)


def build_junit(runs: Iterable, regressions: dict[int, str] | None = None) -> ET.Element:
    """``runs``: objects with ``label``, ``report`` (Report | None), ``error`` (str | None) and
    ``seconds`` (per layer).  ``regressions``: id(LayerResult) -> baseline message (a failure too)."""
    regressions = regressions or {}
    root = ET.Element("testsuites", name="parity")
    totals = {"tests": 0, "failures": 0, "errors": 0}
    for run in runs:
        suite = ET.SubElement(root, "testsuite", name=run.label)
        counts = {"tests": 0, "failures": 0, "errors": 0}
        report: Report | None = run.report
        if report is not None:
            ET.SubElement(ET.SubElement(suite, "properties"), "property", name="checkpoint", value=report.checkpoint)
            props = suite.find("properties")
            for name, value in (("weights", report.weights), ("target", report.target), ("reference", report.reference),
                                ("reference_activation", report.reference_activation),
                                *((f"version.{k}", v) for k, v in report.versions.items())):
                ET.SubElement(props, "property", name=name, value=str(value))
            for index, layer in enumerate(report.layers):
                seconds = run.seconds[index] if index < len(run.seconds) else 0.0
                case = ET.SubElement(suite, "testcase", name=case_name(layer), classname=run.label,
                                     time=f"{seconds:.3f}")
                counts["tests"] += 1
                problems = []
                if not layer.passed:
                    problems.append(failure_message(layer))
                if id(layer) in regressions:
                    problems.append("baseline: " + regressions[id(layer)])
                if problems:
                    counts["failures"] += 1
                    failure = ET.SubElement(case, "failure", message="; ".join(problems),
                                            type="BaselineRegression" if layer.passed else "Mismatch")
                    failure.text = layer_line(layer)
        if run.error is not None:
            counts["tests"] += 1
            counts["errors"] += 1
            case = ET.SubElement(suite, "testcase", name="set-up", classname=run.label, time="0.000")
            ET.SubElement(case, "error", message=run.error, type="ParityError").text = run.error
        for key, value in counts.items():
            suite.set(key, str(value))
            totals[key] += value
        suite.set("skipped", "0")
        suite.set("time", f"{sum(run.seconds):.3f}")
    for key, value in totals.items():
        root.set(key, str(value))
    return root


def write_junit(path: str | Path, runs: Iterable, regressions: dict[int, str] | None = None) -> None:
    tree = ET.ElementTree(build_junit(runs, regressions))
    ET.indent(tree)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        tree.write(path, encoding="utf-8", xml_declaration=True)
    except OSError as exc:
        raise ParityError(f"--junit {path}: cannot write the report: {exc.strerror or exc}") from None
