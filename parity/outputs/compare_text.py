"""``parity compare A B`` as text: the header (which checkpoint is the truth, which the candidate), one row per
layer with the conversion's own deviation beside B's, the diagnoses' evidence, the inventory outside the FFN
and the summary line.  A check's table (``text.py``) has no column for the conversion; this one does."""

from __future__ import annotations

from parity.engine.results import LayerResult, Report, register_renderers, units_noun
from parity.outputs.baseline import compared_sides
from parity.outputs.text import (
    SYNTHETIC_WARNING,
    TextWriter,
    coverage_lines,
    expert_header,
    unit_cell,
    unit_label,
    units_label,
)

HEADER = (f"{'layer':>5}  {'max|Δ|':>9}  {'rel':>9}  {'noise':>9}  {'conv Δ':>9}  {'tol':>9}  {'×noise':>8}  "
          f"{'×conv':>6}  {'stored as':<22}  verdict")


def _sci(value: float | None) -> str:
    return "-" if value is None else f"{value:.2e}"


def experts_of(report: Report) -> bool:
    """Whether the report's units are experts (a mixture of experts: each (layer, expert) judged on its own)."""
    return bool(report.layers) and units_noun(report.layers[:1]) != "layer"


def unit_noun(report: Report) -> str:
    return f"{units_noun(report.layers)}(s)"


def header_lines(report: Report) -> list[str]:
    comparison = getattr(report, "comparison", {}) or {}
    a, b = comparison.get("reference", {}), comparison.get("candidate", {})
    return [
        f"parity compare{' ' + report.name if report.name else ''}: {a.get('model', report.model)} (A, the truth) "
        f"against {b.get('model', report.target)} (B)",
        f"  A           {report.checkpoint} (mapping '{a.get('mapping', report.mapping)}', {a.get('weights')} weights)",
        f"  B           {report.target} (mapping '{b.get('mapping')}', {b.get('weights')} weights)",
        f"  oracle      transformers {report.versions.get('transformers', '?')} {report.reference} "
        f"(activation: {report.reference_activation}), built from A's config, filled with A's layer, then with B's",
        *(f"  note: {note}" for note in report.notes),
        *synthetic_lines(report, a, b),
        "",
        expert_header(HEADER, report.unit_width) if experts_of(report) else HEADER,
    ]


def synthetic_lines(report: Report, a: dict, b: dict) -> list[str]:
    """'!! SYNTHETIC weights (A and B): ...': which side is a stand-in, why, and a compare's way out."""
    sides = [side for side, info in (("A", a), ("B", b)) if info.get("weights") == "synthetic"]
    if not sides or not report.weights_note:
        return []
    why = report.weights_note.removeprefix("SYNTHETIC weights: ")  # the report's note carries a compare's advice
    return [f"  !! SYNTHETIC weights ({' and '.join(sides)}): {why}"]


def layer_line(result: LayerResult, width: int = 6) -> str:
    conv = getattr(result, "conversion", None) or {}
    ratio = ("-" if result.ratio_to_noise is None else f"{result.ratio_to_noise:.1f}" if result.ratio_to_noise < 1e5
             else f"{result.ratio_to_noise:.2e}")
    to_conv = conv.get("ratio_to_conversion")
    verdict = ("UNVERIFIABLE" if result.unverifiable is not None else "MISMATCH" if not result.passed
               else "REGRESSED" if result.regressed else "ok (bit-identical)" if conv.get("identical") else "ok")
    if result.diagnosis:
        verdict += f" — {result.diagnosis.id}"
    if result.regressed:
        verdict += f" (baseline: {result.baseline['message']})"
    stored = stored_cell(str(conv.get("kind", "-")).removeprefix("quantized ").removeprefix("cast "))
    cell = unit_cell(result, width)
    return (f"{cell}  {_sci(result.max_abs_diff):>9}  {_sci(result.max_rel_diff):>9}  "
            f"{_sci(result.noise_floor):>9}  {_sci(conv.get('conversion_deviation')):>9}  "
            f"{_sci(result.tolerance):>9}  {ratio:>8}  {'-' if to_conv is None else f'{to_conv:.2f}':>6}  "
            f"{stored[:22]:<22}  {verdict}")


def diagnosis_lines(report: Report) -> list[str]:
    lines, seen = [], set()
    for result in report.unverifiable:
        lines.append(f"unverifiable ({_unit(result)}): {result.unverifiable}")
    for result in report.layers:
        d = result.diagnosis
        if not d or (d.id, d.message) in seen:
            continue
        seen.add((d.id, d.message))
        lines.append(f"diagnosis {d.id} ({_unit(result)}): {d.message}")
        if d.distance is not None and d.reference_distance is not None:
            unit = units_noun([result])
            lines.append(f"  evidence: B's {unit} is {d.distance:.2e} from A's replayed with this mistake and "
                         f"{d.reference_distance:.2e} from A's (tolerance {_sci(result.tolerance)})")
        others = sorted((c for c in d.candidates if c.id != d.id), key=lambda c: c.distance)[:3]
        if others:
            lines.append("  next closest: " + "; ".join(f"{c.id} ({c.detail}) {c.distance:.2e}" for c in others))
        lines.append(f"  fix: {d.fix}")
    return [*lines, ""] if lines else []


def _unit(result: LayerResult) -> str:
    """'layer 3', or 'expert 3/e1' (expert 1 of layer 3, as a check's text labels it)."""
    return f"{units_noun([result])} {unit_label(result)}"


def inventory_lines(report: Report) -> list[str]:
    comparison = getattr(report, "comparison", {}) or {}
    found = comparison.get("inventory")
    if not found:
        return []
    parts = [f"{found['in_both']} in both"]
    if found["missing_in_b_count"]:
        parts.append(f"{found['missing_in_b_count']} missing in B ({', '.join(found['missing_in_b'][:4])}"
                     f"{', ...' if found['missing_in_b_count'] > 4 else ''})")
    if found["only_in_b_count"]:
        parts.append(f"{found['only_in_b_count']} only in B")
    if found["shape_differs"]:
        parts.append(f"{len(found['shape_differs'])} of another shape ({found['shape_differs'][0]['name']} ...)")
    if found["dtype_changes"]:
        parts.append("dtype " + ", ".join(f"{k} ({n})" for k, n in found["dtype_changes"].items()))
    if not found["headers_read"] and found["in_both"]:
        parts.append("shapes and dtypes not read (no local headers)")
    return [f"outside the FFN ({found['tensors_a']} tensors in A, {found['tensors_b']} in B): {'; '.join(parts)}. "
            "Values outside the FFN are not judged.", ""]


def summary_line(report: Report) -> str:
    """The one line CI logs show; a compare of synthetic stand-ins says so whatever its verdict."""
    line = verdict_line(report)
    if report.layers and (getattr(report, "comparison", None) or {}).get("same_files"):
        line = f"{line} A and B are the same files: nothing about a conversion was judged."
    return f"{line} {SYNTHETIC_WARNING}" if report.layers and report.synthetic else line


def verdict_line(report: Report) -> str:
    if not report.layers:
        return "ERROR: no layer was compared: nothing was compared, so this is not a pass."
    failed, regressed = [r for r in report.layers if not r.passed and r.unverifiable is None], report.regressed
    if failed:
        ids = list(dict.fromkeys(str(r.diagnosis.id) for r in failed if r.diagnosis))
        also = f"; {len(regressed)} regressed against the baseline: {units_label(regressed)}" if regressed else ""
        return (f"FAIL: {len(failed)} of {len(report.layers)} {unit_noun(report)} of B compute another function than "
                f"A's: {units_label(failed)}{' — ' + ', '.join(ids) if ids else ''}{also}")
    if report.unverifiable:
        return (f"ERROR: {len(report.unverifiable)} of {len(report.layers)} {unit_noun(report)} could not be verified: "
                f"{units_label(report.unverifiable)}")
    if regressed:
        return (f"FAIL: {len(regressed)} of {len(report.layers)} {unit_noun(report)} of B regressed against the "
                f"baseline: {units_label(regressed)} ({regressed[0].baseline['message']}); all are within what the "
                "conversion allows.")
    identical = all((getattr(r, "conversion", None) or {}).get("identical") for r in report.layers)
    how = "bit-identical to A's" if identical else "compute what A's compute within what the conversion allows"
    return f"PASS: {len(report.layers)} {unit_noun(report)} of B {how}."


def render_compare(report: Report) -> str:
    lines = [*header_lines(report), *(layer_line(r, report.unit_width) for r in report.layers), "",
             *coverage_lines(report), *diagnosis_lines(report),
             *inventory_lines(report), summary_line(report)]
    return "\n".join(lines)


class SuiteWriter(TextWriter):
    """A run's reports as text, as they grow: a check's as ``text.TextWriter`` writes it, a compare's (a report
    with ``comparison``) with this module's header, rows, diagnoses and inventory."""

    def layer(self, report: Report, result: LayerResult) -> None:
        if compared_sides(report) is None:
            super().layer(report, result)
            return
        self._begin(report)
        self.say(layer_line(result, report.unit_width))

    def finish(self, report: Report, summary: bool = True) -> None:
        if compared_sides(report) is None:
            super().finish(report, summary)
            return
        self._begin(report)
        self.say("")
        later = report.notes[self.noted.get(id(report), len(report.notes)):]
        for line in [*(f"note: {note}" for note in later), *([""] if later else []), *coverage_lines(report),
                     *diagnosis_lines(report), *inventory_lines(report)]:
            self.say(line)
        if summary:
            self.say(summary_line(report))

    def _begin(self, report: Report) -> None:
        if id(report) in self.started:
            return
        if self.started:
            self.say("")
        self.started.append(id(report))
        self.noted[id(report)] = len(report.notes)  # notes found later (a layer's experts permuted) follow the rows
        for line in header_lines(report):
            self.say(line)


register_renderers(compare=render_compare)  # str(CompareReport) (engine.compare.report) is this table


def stored_cell(kind: str) -> str:
    """The "stored as" cell: "float32 -> int4, float32 -> int8" said once from its one source ("float32 -> int4,
    int8"), so a layer of mixed storage fits the column; else as written."""
    pairs = [part.split(" -> ") for part in kind.split(", ")]
    if len(pairs) > 1 and all(len(p) == 2 for p in pairs) and len({p[0] for p in pairs}) == 1:
        return f"{pairs[0][0]} -> {', '.join(p[1] for p in pairs)}"
    return kind
