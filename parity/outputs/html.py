"""The report as one self-contained HTML page (``--html FILE``; ``html = "report.html"`` in a project file).

The page is opened where the CI run is long gone, often offline, so it holds everything
itself: no script, no web font, no image, no stylesheet from a network; the charts are
inline SVG.  It shows the run's context (with synthetic weights impossible to miss), a
per-layer chart of max|Δ| against the noise floor and the tolerance (log scale), the
verdict, and for a diagnosed layer the evidence: the distances of the replayed mistakes
and, for a GELU-variant diagnosis, the two activations' difference over the range of
pre-activations the inputs reached (computed here with ``math``: no torch in outputs/).

Why SVG written here rather than a plotting library: none that writes static SVG is a
dependency of parity (matplotlib would add tens of MB and numpy to a tool whose light
commands import nothing heavy; plotly and bokeh write pages that need their JavaScript,
megabytes inline).  The charts are a dot plot, horizontal bars and one curve: a few
hundred lines of plain Python, the same page on every machine, every user-given string
passed through ``html.escape``.  The markup is well-formed XML (XHTML with SVG), so
tests read it with ``xml.etree``.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from parity import __version__
from parity.definitions.families import TANH_GELUS
from parity.definitions.mapping import route_arrows
from parity.engine.results import Diagnosis, LayerResult, Report, layer_status, units_noun
from parity.outputs.atomic import write_output
from parity.outputs.text import (
    condition,
    coverage_lines,
    framework_label,
    reference_filled,
    summary_line,
    unit_label,
)

SVG = 'xmlns="http://www.w3.org/2000/svg"'
COLOURS = {"pass": "#1a7f37", "fail": "#cf222e", "regressed": "#cf222e", "unverifiable": "#b35c00",
           "baseline": "#57606a", "tolerance": "#0550ae",
           "noise": "#6e7781", "zone": "#ffe4e1", "grid": "#d8dee4", "ink": "#1f2328", "muted": "#59636e",
           "match": "#1a7f37", "reference_error": "#8250df", "other": "#8c959f", "reference": "#cf222e",
           "curve": "#8250df"}
VERDICTS = {0: ("PASS", "pass"), 1: ("FAIL", "fail"), 2: ("ERROR", "unverifiable")}
# a layer's (and a check's) status in words: the same word in the table, the tooltip and the badge
STATUS_WORDS = {"pass": "ok", "fail": "MISMATCH", "regressed": "REGRESSED", "unverifiable": "UNVERIFIABLE"}
BADGES = {"pass": "PASS", "fail": "FAIL", "regressed": "REGRESSED", "unverifiable": "ERROR"}
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ufffe\uffff]")
_SUPERSCRIPT = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")


def esc(value: object) -> str:
    """Text for the page: HTML-escaped (paths and notes are user input), control characters replaced, and a
    lone surrogate (a file name that is not UTF-8, as Python holds it) written as its escape, \\udcff: the
    page is UTF-8, which cannot hold one."""
    text = str(value).encode("utf-8", "backslashreplace").decode("utf-8")
    return html.escape(_NOT_XML.sub("\ufffd", text), quote=True)


def sci(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}e}" if math.isfinite(value) else str(value)


def finite_positive(value: float | None) -> bool:
    return value is not None and math.isfinite(value) and value > 0


# -- scales --------------------------------------------------------------------------------------------

@dataclass
class LogAxis:
    """Decades ``lo``..``hi`` (powers of ten) mapped onto pixels ``start``..``end``."""

    lo: int
    hi: int
    start: float
    end: float

    @classmethod
    def around(cls, values: Iterable[float | None], start: float, end: float) -> LogAxis:
        logs = [math.log10(v) for v in values if finite_positive(v)]
        # a little headroom: a value just above a decade must not sit on the frame
        lo, hi = (math.floor(min(logs) - 0.25), math.ceil(max(logs) + 0.1)) if logs else (-8, 0)
        hi = max(hi, lo + 1)
        while hi - lo < 3:  # at least three decades: a lone point must not sit on an edge
            lo, hi = lo - 1, hi + (hi - lo < 2)
        return cls(lo, hi, start, end)

    def at(self, value: float) -> float:
        share = (math.log10(value) - self.lo) / (self.hi - self.lo)
        return self.start + share * (self.end - self.start)

    def ticks(self) -> list[int]:
        step = max(1, math.ceil((self.hi - self.lo) / 10))
        return list(range(self.lo, self.hi + 1, step))


def decade(exponent: int) -> str:
    return "1" if exponent == 0 else "10" + str(exponent).translate(_SUPERSCRIPT)


def nice_step(span: float, count: int = 6) -> float:
    raw = span / count if span > 0 else 1.0
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)


def text(x: float, y: float, content: str, cls: str = "", anchor: str = "start", extra: str = "") -> str:
    klass = f' class="{cls}"' if cls else ""
    return f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}"{klass}{extra}>{esc(content)}</text>'


def marker(kind: str, x: float, y: float, size: float = 5.5) -> str:
    """pass: filled circle; fail: a cross; regressed: a filled triangle pointing up (grew); unverifiable: an open
    diamond (shape and colour both tell); baseline: a short grey bar, the stored run's value."""
    colour = COLOURS[kind]
    if kind == "regressed":
        s = size + 1
        return (f'<path d="M{x:.1f},{y - s:.1f} L{x + s:.1f},{y + s * 0.8:.1f} L{x - s:.1f},{y + s * 0.8:.1f} Z" '
                f'fill="{colour}" stroke="#fff" stroke-width="1.5"/>')
    if kind == "baseline":
        return (f'<line x1="{x - size * 1.8:.1f}" y1="{y:.1f}" x2="{x + size * 1.8:.1f}" y2="{y:.1f}" '
                f'stroke="{colour}" stroke-width="3"/>')
    if kind == "pass":
        return (f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{size + 0.5:.1f}" fill="{colour}" stroke="#fff" '
                'stroke-width="1.5"/>')
    if kind == "fail":
        s = size
        return (f'<path d="M{x - s:.1f},{y - s:.1f} L{x + s:.1f},{y + s:.1f} M{x - s:.1f},{y + s:.1f} '
                f'L{x + s:.1f},{y - s:.1f}" stroke="{colour}" stroke-width="3" stroke-linecap="round"/>')
    s = size + 1
    return (f'<path d="M{x:.1f},{y - s:.1f} L{x + s:.1f},{y:.1f} L{x:.1f},{y + s:.1f} L{x - s:.1f},{y:.1f} Z" '
            f'fill="#fff" stroke="{colour}" stroke-width="2.5"/>')


def legend(items: Sequence[tuple[str, str]], x: float, y: float, right: float = 940) -> str:
    """Rows of (symbol markup drawn at 0,0, label) entries from x, y; a row that would pass ``right`` wraps."""
    parts, cursor = ['<g class="legend">'], x
    for symbol, label in items:
        width = 15 + 6.9 * len(label)
        if cursor > x and cursor + width > right:
            cursor, y = x, y + 20
        parts.append(f'<g transform="translate({cursor:.1f},{y:.1f})">{symbol}</g>')
        parts.append(text(cursor + 15, y + 4.5, label, "legend-text"))
        cursor += width + 34
    parts.append("</g>")
    return "".join(parts)


LINE_SYMBOL = '<line x1="-9" y1="0" x2="9" y2="0" stroke="{}" stroke-width="{}"{}/>'
LAYER_LEGEND = [
    (marker("pass", 0, 0), "pass"), (marker("fail", 0, 0), "fail"),
    (marker("unverifiable", 0, 0), "unverifiable"),
    (LINE_SYMBOL.format(COLOURS["tolerance"], 2.5, ""), "tolerance"),
    (LINE_SYMBOL.format(COLOURS["noise"], 2.5, ' stroke-dasharray="4 3"'), "noise floor (float32)"),
    (f'<rect x="-8" y="-6" width="16" height="12" fill="{COLOURS["zone"]}"/>', "fail zone (above tolerance)"),
]


BASELINE_LEGEND = [(marker("regressed", 0, 0), "regressed (beyond the baseline)"),
                   (marker("baseline", 0, 0), "baseline's max|Δ|")]


# -- the per-layer chart -------------------------------------------------------------------------------

LAYER_BOX = (84, 48, 940, 322)  # left, top, right, bottom of the plot area in a 960 x 380 view


def layer_chart(report: Report) -> str:
    """max|Δ| per layer (one mark each) over the tolerance and noise-floor steps, log scale."""
    left, top, right, bottom = LAYER_BOX
    layers = report.layers
    lines = layer_lines(report)
    stored = [stored_value(r) for r in layers]
    axis = LogAxis.around([r.max_abs_diff for r in layers] + [v for values, *_ in lines for v in values] + stored,
                          bottom, top)
    band = (right - left) / max(1, len(layers))
    parts = [f'<svg {SVG} class="chart layer-chart" viewBox="0 0 960 380" role="img" '
             f'aria-label="max|Δ| per layer against tolerance and noise floor">',
             legend(LAYER_LEGEND + [(LINE_SYMBOL.format(COLOURS[c], 2.5, s), label) for _, c, s, label in lines[2:]]
                    + (BASELINE_LEGEND if any(v is not None for v in stored) else []), left, 14)]
    for index, result in enumerate(layers):
        if finite_positive(result.tolerance):
            y = axis.at(result.tolerance)
            parts.append(f'<rect class="zone" x="{left + index * band:.1f}" y="{top}" width="{band:.1f}" '
                         f'height="{max(0.0, y - top):.1f}" fill="{COLOURS["zone"]}"/>')
    parts += log_grid(axis, LAYER_BOX, vertical=True)
    if report.synthetic:  # a screenshot of the chart alone must still say it
        parts.append(text((left + right) / 2, (top + bottom) / 2 + 14, "SYNTHETIC WEIGHTS", "watermark", "middle"))
    for values, colour, style, _ in lines:
        style = f'stroke="{COLOURS[colour]}" stroke-width="2.5"{style}'
        parts.append(step_line(values, axis, left, band, colour, style))
    expert = bool(layers) and units_noun(layers[:1]) != "layer"
    step = max(1, math.ceil(len(layers) / (16 if expert else 24)))
    for index, result in enumerate(layers):
        x = left + (index + 0.5) * band
        if finite_positive(stored[index]):  # the baseline's value beside today's, under it in the drawing order
            parts.append(f'<g class="baseline-mark"><title>{esc(baseline_tip(result))}</title>'
                         f"{marker('baseline', x, axis.at(stored[index]))}</g>")
        parts.append(layer_point(result, x, axis))
        if index % step == 0:
            parts.append(text(x, bottom + 18, unit_label(result), "tick", "middle"))
    parts.append(text((left + right) / 2, bottom + 44, "layer / expert" if expert else "layer", "axis-label", "middle"))
    parts.append(axis_title_y("absolute difference, output units (log scale)", (top + bottom) / 2))
    parts.append("</svg>")
    return "".join(parts)


def layer_lines(report: Report) -> list[tuple[list, str, str, str]]:
    """(values per layer, colour key, extra style, legend label) of each step line: tolerance, noise floor and,
    in a low-precision run, the reference's own error in that dtype (when the report carries it)."""
    lines = [([r.tolerance for r in report.layers], "tolerance", "", "tolerance"),
             ([r.noise_floor for r in report.layers], "noise", ' stroke-dasharray="4 3"', "noise floor")]
    own = [getattr(r, "reference_error", None) for r in report.layers]
    if any(finite_positive(v) for v in own):
        dtype = getattr(report, "dtype", None) or "low precision"
        lines.append((own, "reference_error", ' stroke-dasharray="1 3" stroke-linecap="round"',
                      f"reference's own {dtype} error"))
    return lines


def log_grid(axis: LogAxis, box: tuple[float, float, float, float], vertical: bool) -> list[str]:
    """Decade grid lines and labels; ``vertical``: the log axis runs up the y axis (else along x)."""
    left, top, right, bottom = box
    parts = [f'<rect x="{left}" y="{top}" width="{right - left}" height="{bottom - top}" fill="none" '
             f'stroke="{COLOURS["grid"]}"/>']
    for exponent in axis.ticks():
        at = axis.at(10.0 ** exponent)
        if vertical:
            parts.append(f'<line x1="{left}" y1="{at:.1f}" x2="{right}" y2="{at:.1f}" stroke="{COLOURS["grid"]}"/>')
            parts.append(text(left - 8, at + 4.5, decade(exponent), "tick", "end"))
        else:
            parts.append(f'<line x1="{at:.1f}" y1="{top}" x2="{at:.1f}" y2="{bottom}" stroke="{COLOURS["grid"]}"/>')
            parts.append(text(at, bottom + 18, decade(exponent), "tick", "middle"))
    return parts


def step_line(values: Sequence[float | None], axis: LogAxis, left: float, band: float, cls: str, style: str) -> str:
    """One horizontal step per layer, joined where neighbours both have a value."""
    path, joined = [], False
    for index, value in enumerate(values):
        if not finite_positive(value):
            joined = False
            continue
        y = axis.at(value)
        path.append(f"{'L' if joined else 'M'}{left + index * band:.1f},{y:.1f} H{left + (index + 1) * band:.1f}")
        joined = True
    return f'<path class="{cls}" d="{" ".join(path)}" fill="none" {style}/>' if path else ""


def stored_value(result: LayerResult) -> float | None:
    """The baseline's max|Δ| for this layer, when it was compared with one."""
    found = result.baseline
    if not found or found.get("status") not in ("ok", "regressed"):
        return None
    value = found.get("max_abs_diff")
    return float(value) if isinstance(value, (int, float)) else None


def baseline_tip(result: LayerResult) -> str:
    found = result.baseline or {}
    text = f"layer {unit_label(result)}: baseline max|Δ| {sci(stored_value(result))}, now {sci(result.max_abs_diff)}"
    return text + (f": REGRESSED — {found['message']}" if found.get("message") and result.regressed else "")


def layer_point(result: LayerResult, x: float, axis: LogAxis) -> str:
    """The layer's mark; a value the log axis cannot show (0, none, NaN) sits on an edge, said in its tooltip."""
    status = layer_status(result)
    value = result.max_abs_diff
    verdict = STATUS_WORDS[status]
    if result.regressed:
        verdict += f" against the baseline ({result.baseline.get('message')})"
    if result.diagnosis:
        verdict += f" — {result.diagnosis.id}"
    if result.unverifiable:
        verdict += f" ({result.unverifiable})"
    tip = (f"layer {unit_label(result)}: max|Δ| {sci(value)}, tolerance {sci(result.tolerance)}, "
           f"noise floor {sci(result.noise_floor)}: {verdict}")
    note = ""
    if finite_positive(value):
        y = axis.at(value)
    elif value == 0:
        y, note = axis.start, "0"
    else:
        y, note = axis.end, "n/a"
    label = text(x, y - 10 if note == "0" else y + 20, note, "edge-note", "middle") if note else ""
    return (f'<g class="point {status}" data-unit="{esc(unit_label(result))}" data-value="{esc(sci(value, 4))}">'
            f"<title>{esc(tip)}</title>{marker(status, x, y)}{label}</g>")


def axis_title_y(label: str, middle: float, x: float = 18) -> str:
    return (f'<text class="axis-label" x="{x}" y="{middle:.1f}" text-anchor="middle" '
            f'transform="rotate(-90 {x} {middle:.1f})">{esc(label)}</text>')


# -- diagnosis evidence: distances of the replayed mistakes --------------------------------------------

def evidence_rows(diagnosis: Diagnosis) -> list[tuple[str, float | None, str]]:
    """(label, distance, kind) per bar: each replayed hypothesis, then transformers itself."""
    rows = []
    if diagnosis.candidates:
        for item in sorted(diagnosis.candidates, key=lambda c: _sort_key(c.distance)):
            detail = f" ({item.detail})" if item.detail else ""
            rows.append((f"{item.id}{detail}", item.distance, "candidate"))
    elif diagnosis.distance is not None:
        rows.append((f"{diagnosis.id} (its replay)", diagnosis.distance, "candidate"))
    rows.append(("transformers (the correct module)", diagnosis.reference_distance, "reference"))
    return rows


def _sort_key(value: float | None) -> float:
    return value if value is not None and math.isfinite(value) else math.inf


def evidence_chart(result: LayerResult) -> str | None:
    """Horizontal bars, log scale: how far the module's output is from each replay, with the tolerance."""
    diagnosis = result.diagnosis or {}
    rows = evidence_rows(diagnosis)
    if all(distance is None for _, distance, _ in rows):
        return None
    left, right, top, row_h = 370, 900, 44, 30
    bottom = top + row_h * len(rows)
    axis = LogAxis.around([d for _, d, _ in rows] + [result.tolerance], left, right)
    tolerance = result.tolerance if finite_positive(result.tolerance) else None
    parts = [f'<svg {SVG} class="chart evidence-chart" viewBox="0 0 960 {bottom + 52}" role="img" '
             f'aria-label="distance of the module from each replayed mistake">']
    parts += log_grid(axis, (left, top, right, bottom), vertical=False)
    for index, (label, distance, kind) in enumerate(rows):
        parts.append(evidence_bar(index, label, distance, kind, tolerance, axis, (left, top, row_h)))
    if tolerance is not None:
        at = axis.at(tolerance)
        parts.append(f'<line class="tolerance" x1="{at:.1f}" y1="{top - 8}" x2="{at:.1f}" y2="{bottom}" '
                     f'stroke="{COLOURS["tolerance"]}" stroke-width="2.5" stroke-dasharray="6 3"/>')
        parts.append(text(at, top - 14, f"tolerance {sci(tolerance)}", "tol-label", "middle"))
    parts.append(text((left + right) / 2, bottom + 42, "distance from the module's output: max |Δ|, output units "
                      "(log scale)", "axis-label", "middle"))
    parts.append("</svg>")
    return "".join(parts)


def evidence_bar(index: int, label: str, distance: float | None, kind: str, tolerance: float | None,
                 axis: LogAxis, frame: tuple[float, float, float]) -> str:
    left, top, row_h = frame
    y = top + index * row_h + 6
    within = distance is not None and tolerance is not None and distance <= tolerance
    colour = COLOURS["reference"] if kind == "reference" else COLOURS["match"] if within else COLOURS["other"]
    shown = label if len(label) <= 48 else label[:47] + "…"
    weight = "bar-label strong" if within or kind == "reference" else "bar-label"
    parts = [f'<g class="bar {kind}{" within" if within else ""}"><title>{esc(label)}: {esc(sci(distance))}</title>',
             text(left - 10, y + 13, shown, weight, "end")]
    if finite_positive(distance):
        end = axis.at(distance)
        parts.append(f'<rect x="{left}" y="{y:.1f}" width="{max(1.5, end - left):.1f}" height="{row_h - 12}" '
                     f'rx="2" fill="{colour}"/>')
        parts.append(text(end + 6, y + 13, sci(distance), "bar-value"))
    else:
        note = "0 (identical output)" if distance == 0 else "not measured"
        parts.append(f'<rect x="{left}" y="{y:.1f}" width="3" height="{row_h - 12}" fill="{colour}"/>')
        parts.append(text(left + 10, y + 13, note, "bar-value"))
    parts.append("</g>")
    return "".join(parts)


# -- GELU variants: the two activations' difference over the range the inputs reached -------------------

def gelu_exact(z: float) -> float:
    return 0.5 * z * (1.0 + math.erf(z / math.sqrt(2.0)))


def gelu_tanh(z: float) -> float:
    return 0.5 * z * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * z ** 3)))


def quick_gelu(z: float) -> float:
    return z / (1.0 + math.exp(-1.702 * z)) if z > -700 else 0.0


ACTIVATIONS = {"exact GELU": gelu_exact, "tanh GELU": gelu_tanh, "quick GELU": quick_gelu}


def activation_pair(diagnosis_id: str, reference_activation: str) -> tuple[str, str] | None:
    """(what the module runs, what the checkpoint expects) for a GELU-variant diagnosis."""
    expected = "tanh GELU" if reference_activation in TANH_GELUS else "exact GELU"
    return {"gelu_exact_instead_of_tanh": ("exact GELU", "tanh GELU"),
            "gelu_tanh_instead_of_exact": ("tanh GELU", "exact GELU"),
            "quick_gelu": ("quick GELU", expected)}.get(diagnosis_id)


def activation_curve(wrong: str, right: str, low: float, high: float, count: int = 241) -> list[tuple[float, float]]:
    f, g = ACTIVATIONS[wrong], ACTIVATIONS[right]
    span = high - low if high > low else 1.0
    return [(z, f(z) - g(z)) for z in (low + span * i / (count - 1) for i in range(count))]


def activation_chart(report: Report, result: LayerResult) -> str | None:
    """wrong(z) - right(z) for z over the layer's pre-activation range, linear axes."""
    pair = activation_pair((result.diagnosis or {}).get("id", ""), report.reference_activation)
    if pair is None:
        return None
    low, high = result.preactivation_range or (-8.0, 8.0)
    points = activation_curve(*pair, low, high)
    left, top, right, bottom = 84, 40, 940, 262
    peak_z, peak = max(points, key=lambda p: abs(p[1]))
    y_step = nice_step(2 * abs(peak) or 1e-6, 6)
    y_max = y_step * math.ceil(abs(peak) * 1.08 / y_step) or y_step

    def sx(z: float) -> float:
        return left + (z - low) / ((high - low) or 1.0) * (right - left)

    def sy(d: float) -> float:
        return top + (y_max - d) / (2 * y_max) * (bottom - top)

    parts = [f'<svg {SVG} class="chart activation-chart" viewBox="0 0 960 320" role="img" '
             f'aria-label="{esc(pair[0])} minus {esc(pair[1])}">',
             f'<rect x="{left}" y="{top}" width="{right - left}" height="{bottom - top}" fill="none" '
             f'stroke="{COLOURS["grid"]}"/>']
    parts += linear_ticks(low, high, nice_step(high - low, 8), sx, "x", (left, top, right, bottom))
    parts += linear_ticks(-y_max, y_max, y_step, sy, "y", (left, top, right, bottom))
    parts.append(f'<line x1="{left}" y1="{sy(0):.1f}" x2="{right}" y2="{sy(0):.1f}" stroke="{COLOURS["muted"]}"/>')
    path = " ".join(f"{'M' if i == 0 else 'L'}{sx(z):.1f},{sy(d):.1f}" for i, (z, d) in enumerate(points))
    parts.append(f'<path class="curve" d="{path}" fill="none" stroke="{COLOURS["curve"]}" stroke-width="2.5"/>')
    parts.append(f'<circle cx="{sx(peak_z):.1f}" cy="{sy(peak):.1f}" r="5" fill="none" stroke="{COLOURS["ink"]}" '
                 'stroke-width="1.5"/>')
    parts.append(text(right, top - 12, f"largest |difference| (circled): {sci(abs(peak))} at z = {peak_z:.2f}",
                      "peak-label", "end"))
    parts.append(text((left + right) / 2, bottom + 42, "pre-activation z (the range this layer's inputs reached)",
                      "axis-label", "middle"))
    parts.append(axis_title_y(f"{pair[0]}(z) − {pair[1]}(z)", (top + bottom) / 2))
    parts.append("</svg>")
    return "".join(parts)


def linear_ticks(low: float, high: float, step: float, scale, which: str, box) -> list[str]:
    left, top, right, bottom = box
    parts, value = [], math.ceil(low / step) * step
    while value <= high + step * 1e-9:
        at = scale(value)
        label = f"{value:.3g}" if which == "x" else ("0" if abs(value) < step / 2 else f"{value:.1e}")
        if which == "x":
            parts.append(f'<line x1="{at:.1f}" y1="{top}" x2="{at:.1f}" y2="{bottom}" stroke="{COLOURS["grid"]}"/>')
            parts.append(text(at, bottom + 18, label, "tick", "middle"))
        else:
            parts.append(f'<line x1="{left}" y1="{at:.1f}" x2="{right}" y2="{at:.1f}" stroke="{COLOURS["grid"]}"/>')
            parts.append(text(left - 8, at + 4.5, label, "tick", "end"))
        value += step
    return parts


# -- the page ------------------------------------------------------------------------------------------

def context_block(report: Report) -> str:
    """Model, checkpoint, weights, target, reference, versions, seed, device and dtype (when the report has them)."""
    weights = ('<span class="badge synthetic">SYNTHETIC</span> random values with the real shapes'
               if report.synthetic else '<span class="badge real">real</span> read from the checkpoint')
    rows = [("model", esc(report.model) + f' <span class="muted">(mapping {esc(report.mapping)})</span>'),
            ("checkpoint", f"<code>{esc(report.checkpoint)}</code>"), ("weights", weights),
            ("target", f"<code>{esc(report.target)}</code>{esc(framework_label(report))}"),
            ("reference", f"<code>{esc(report.reference)}</code> (activation <code>"
                          f"{esc(report.reference_activation)}</code>)"),
            *([("reference filled", esc(reference_filled(report.reference_routes)))]
              if getattr(report, "reference_routes", None) else []),
            *([("target filled", f"<code>{esc(route_arrows(report.routes['tensors']))}</code>")]
              if getattr(report, "routes", None) else []),
            ("versions", ", ".join(f"{esc(k)} {esc(v)}" for k, v in report.versions.items())),
            ("seed", esc(report.seed))]
    for name in ("device", "dtype"):
        value = getattr(report, name, None)
        if value is not None:
            rows.append((name, f"<code>{esc(value)}</code>"))
    items = "".join(f"<dt>{name}</dt><dd>{value}</dd>" for name, value in rows)
    parts = [f'<dl class="context">{items}</dl>']
    if report.synthetic:
        note = report.weights_note or "No real checkpoint weight was read."
        parts.append('<div class="synthetic-banner"><strong>SYNTHETIC WEIGHTS.</strong> '
                     f"{esc(note.removeprefix('SYNTHETIC weights: '))} A pass here says nothing "
                     "about a real checkpoint (--require-real refuses this).</div>")
    elif report.weights_note:
        parts.append(f'<p class="note">{esc(report.weights_note)}</p>')
    if report.notes:
        parts.append('<ul class="notes">' + "".join(f"<li>{esc(n)}</li>" for n in report.notes) + "</ul>")
    return "".join(parts)


def layer_table(report: Report) -> str:
    expert = bool(report.layers) and units_noun(report.layers[:1]) != "layer"
    own = any(getattr(r, "ratio_to_reference_error", None) is not None for r in report.layers)
    head = ["layer", *(["expert"] if expert else []), "max|Δ|", "rel", "noise floor", "tolerance", "×noise",
            *(["ref. error", "×ref. error"] if own else []), "z range", "verdict"]
    rows = []
    for r in report.layers:
        status = layer_status(r)
        verdict = STATUS_WORDS[status]
        if r.regressed:
            verdict += f": {r.baseline.get('message')}"
        if r.diagnosis:
            verdict += f" — {r.diagnosis.id}"
        if r.unverifiable:
            verdict += f": {r.unverifiable}"
        z = "-" if r.preactivation_range is None else "[{:.1f}, {:.1f}]".format(*r.preactivation_range)
        ratio = "-" if r.ratio_to_noise is None else f"{r.ratio_to_noise:.1f}"
        mine = getattr(r, "ratio_to_reference_error", None)
        low = [sci(getattr(r, "reference_error", None)), "-" if mine is None else f"{mine:.2f}"] if own else []
        within = r.expert if r.expert is not None else r.unit or "-"
        cells = [r.layer, *([within] if expert else []), sci(r.max_abs_diff), sci(r.max_rel_diff),
                 sci(r.noise_floor), sci(r.tolerance), ratio, *low, z]
        rows.append(f'<tr class="{status}">' + "".join(f'<td class="num">{esc(c)}</td>' for c in cells)
                    + f'<td class="verdict">{esc(verdict)}</td></tr>')
    header = "".join(f"<th>{esc(h)}</th>" for h in head)
    return (f'<div class="table-wrap"><table class="layers"><thead><tr>{header}</tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table></div>')


def diagnosis_blocks(report: Report) -> str:
    """One block per distinct diagnosis, drawn for its first layer (as the text report groups them)."""
    parts, seen = [], set()
    for result in report.layers:
        d = result.diagnosis
        if not d or d.id in seen:
            continue
        seen.add(d.id)
        units = [unit_label(r) for r in report.layers if r.diagnosis and r.diagnosis.id == d.id]
        parts.append(f'<div class="diagnosis"><h3>diagnosis <code>{esc(d.id)}</code> '
                     f'<span class="muted">(layers {esc(", ".join(units))})</span></h3>'
                     f'<p>{esc(d.get("message", ""))}</p>'
                     f'<p class="fix"><strong>fix:</strong> {esc(d.get("fix", ""))}</p>')
        evidence = evidence_chart(result)
        if evidence:
            parts.append(f"<h4>evidence, layer {esc(unit_label(result))}: how far the module's output is from each "
                         "replayed mistake (a bar left of the tolerance line reproduces the module)</h4>" + evidence)
        curve = activation_chart(report, result)
        if curve:
            low, high = result.preactivation_range or (-8.0, 8.0)
            parts.append(f"<h4>the two activations, layer {esc(unit_label(result))}: their difference over the "
                         f"pre-activations the inputs reached, [{low:.1f}, {high:.1f}]</h4>" + curve)
        parts.append("</div>")
    return "".join(parts)


def logits_block(report: Report) -> str:
    logits = report.logits
    if not logits:
        return ""
    if logits.get("skipped"):
        return f'<div class="logits"><h3>logits impact</h3><p>not measured: {esc(logits["skipped"])}</p></div>'
    scale = logits.get("logit_scale")
    shift = logits.get("max_abs_diff")
    relative = shift / scale if finite_positive(scale) and shift is not None else None
    cards = [("final logits max |Δ|", sci(shift)), ("logit scale", sci(scale)), ("relative", sci(relative)),
             ("top-1 agreement", f"{logits.get('top1_agreement', 0):.1%}")]
    body = "".join(f'<div class="card"><div class="value">{esc(v)}</div><div class="label">{esc(k)}</div></div>'
                   for k, v in cards)
    return (f'<div class="logits"><h3>logits impact</h3><p>the target substituted for layer(s) '
            f'{esc(logits.get("layers"))} of the full model, {esc(logits.get("tokens"))} fixed tokens '
            f'({esc(logits.get("weights"))})</p><div class="cards">{body}</div></div>')


def not_checked_block(report: Report) -> str:
    """Mistakes a low-precision run cannot tell from a correct module (when the report says so): never shown as
    a pass of them."""
    found: dict[str, str] = {}
    for result in report.layers:
        for item in result.not_checked:
            found.setdefault(item.id, item.message or item.detail)
    if not found:
        return ""
    items = "".join(f"<li><code>{esc(k)}</code>: {esc(v)}</li>" for k, v in found.items())
    return (f'<div class="not-checked"><strong>not checked {esc(condition(report))}</strong>: these mistakes fit '
            f"within this run's tolerance, so this run cannot see them<ul>{items}</ul></div>")


CAPTION = ('<p class="caption">One mark per layer: the largest absolute difference between the module\'s output '
           "and transformers' (computed in float64). A layer passes when its mark is on or below its tolerance line: "
           "derived from the noise floor (transformers' own float32 error), or from the reference's own error in a "
           "low-precision run, unless --atol sets it. Hover a mark for its numbers.</p>")


def report_section(report: Report, summary: bool = True) -> str:
    """One check: its context, summary, chart, diagnoses, logits and table; ``summary``: repeat the check's
    summary line (a single check's is the page header)."""
    status = report.status
    label = BADGES[status]
    synthetic = " synthetic" if report.synthetic else ""
    line = (f'<p class="summary {status}{synthetic}"><span class="badge {status}">{label}</span> '
            f"{esc(summary_line(report))}</p>")
    return "".join([
        context_block(report), line if summary else "", not_checked_block(report),
        f"<h3>max|Δ| per layer</h3>{layer_chart(report)}{CAPTION}" if report.layers else "",
        coverage_block(report), diagnosis_blocks(report), logits_block(report),
        f"<details open=\"open\"><summary>the numbers, per layer</summary>{layer_table(report)}</details>",
    ])


def coverage_block(report: Report) -> str:
    """Whole MoE blocks: how much of the routing each one's inputs exercised (the text report's coverage lines)."""
    lines = [line for line in coverage_lines(report) if line]
    if not lines:
        return ""
    return "<h3>routing coverage</h3><ul class=\"coverage\">" + "".join(f"<li>{esc(line)}</li>" for line in lines) + \
        "</ul>"


def check_section(index: int, run, single: bool = False) -> str:
    where = getattr(getattr(run, "spec", None), "where", "") or ""
    where = f' <span class="muted">{esc(where)}</span>' if where else ""
    title = f"<h2>{esc(run.label)}{where}</h2>"
    body = report_section(run.report, summary=not single) if run.report is not None else ""
    if run.error is not None:
        body += f'<div class="error"><strong>could not run:</strong> {esc(run.error)}</div>'
    return f'<section class="check" id="check-{index}">{title}{body}</section>'


def run_status(run) -> str:
    if run.error is not None or run.report is None:
        return "unverifiable"
    return run.report.status


def render_html(runs: Sequence, summary: str, code: int, problem: str | None = None, title: str = "") -> str:
    """The page for ``runs`` (objects with ``label``, ``report`` and ``error``, as ``parity check`` runs them):
    ``summary`` is the run's summary line, ``code`` its exit code, ``problem`` a baseline problem."""
    word, status = VERDICTS.get(code, ("ERROR", "unverifiable"))
    title = title or (f"parity: {runs[0].label}" if len(runs) == 1 else "parity check")
    contents = ""
    if len(runs) > 1:
        contents = '<nav><ol>' + "".join(
            f'<li><a href="#check-{i}"><span class="badge {run_status(r)}">{esc(BADGES[run_status(r)])}</span> '
            f"{esc(r.label)}</a></li>" for i, r in enumerate(runs)) + "</ol></nav>"
    extra = f'<p class="error">{esc(problem)}</p>' if problem else ""
    synthetic = any(run.report is not None and run.report.synthetic for run in runs)
    tag = '<div class="tag">SYNTHETIC WEIGHTS</div>' if synthetic else ""
    written = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    sections = "".join(check_section(i, run, single=len(runs) == 1) for i, run in enumerate(runs))
    return (f'<!DOCTYPE html>\n<html xmlns="http://www.w3.org/1999/xhtml" lang="en"><head><meta charset="utf-8"/>'
            f'<meta name="viewport" content="width=device-width, initial-scale=1"/><title>{esc(title)} — {word}'
            f"</title><style>{STYLE}</style></head><body>"
            f'<header class="verdict {status}"><div class="word">{word}</div><div class="line">{esc(summary)}</div>'
            f"{tag}</header><main>{extra}{contents}{sections}</main>"
            f"<footer>parity {esc(__version__)} · written {written} · self-contained: no network needed to view"
            "</footer></body></html>\n")


def report_html(report: Report, label: str | None = None) -> str:
    """The page for a single Report (``parity.check``'s result)."""
    code = {"pass": 0, "fail": 1, "regressed": 1}.get(report.status, 2)
    run = PageRun(label or report.model, report, None)
    return render_html([run], summary_line(report), code)


@dataclass
class PageRun:
    """One check as the page needs it (``parity check``'s CheckRun has the same three fields)."""

    label: str
    report: Report | None
    error: str | None


def write_html(path: str | Path, runs: Sequence, summary: str, code: int, problem: str | None = None) -> None:
    """Atomically (parity.outputs.atomic): a half-written page is never left behind."""
    write_output(path, render_html(runs, summary, code, problem), "--html")


STYLE = """
:root { --pass: #1a7f37; --fail: #cf222e; --unverifiable: #b35c00; --ink: #1f2328; --muted: #59636e;
  --line: #d0d7de; --bg: #f6f8fa; }
* { box-sizing: border-box; }
body { margin: 0; color: var(--ink); background: var(--bg); line-height: 1.45;
  font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "Noto Sans", "DejaVu Sans", Arial, sans-serif; }
code, .num, td { font-family: ui-monospace, "SFMono-Regular", "DejaVu Sans Mono", Menlo, Consolas, monospace;
  font-size: 13px; }
header.verdict { padding: 18px 32px; color: #fff; display: flex; gap: 24px; align-items: center; }
header.verdict .word { font-size: 34px; font-weight: 700; letter-spacing: 1px; }
header.verdict .line { font-size: 16px; max-width: 980px; }
header.verdict .tag { margin-left: auto; border: 2px solid #fff; border-radius: 6px; padding: 4px 10px;
  font-weight: 700; background: var(--unverifiable); white-space: nowrap; }
.summary.synthetic { background: #fff1e5; }
header.pass { background: var(--pass); } header.fail { background: var(--fail); }
header.unverifiable { background: var(--unverifiable); }
main { max-width: 1080px; margin: 0 auto; padding: 8px 24px 24px; }
section.check { background: #fff; border: 1px solid var(--line); border-radius: 8px; padding: 4px 24px 20px;
  margin: 20px 0; }
h2 { font-size: 21px; margin: 16px 0 8px; word-break: break-all; }
h3 { font-size: 17px; margin: 22px 0 6px; } h4 { font-size: 14px; font-weight: 600; margin: 14px 0 4px;
  color: var(--muted); }
.muted { color: var(--muted); font-weight: normal; font-size: 14px; }
dl.context { display: grid; grid-template-columns: 130px 1fr; gap: 4px 16px; margin: 8px 0 12px; }
dl.context dt { color: var(--muted); } dl.context dd { margin: 0; word-break: break-all; }
.badge { display: inline-block; padding: 1px 8px; border-radius: 10px; color: #fff; font-size: 12px;
  font-weight: 700; font-family: system-ui, "DejaVu Sans", sans-serif; vertical-align: 1px; }
.badge.pass, .badge.real { background: var(--pass); } .badge.fail, .badge.regressed { background: var(--fail); }
.badge.unverifiable, .badge.synthetic { background: var(--unverifiable); }
.synthetic-banner { background: #fff1e5; border: 2px solid var(--unverifiable); border-left-width: 10px;
  padding: 10px 14px; margin: 10px 0; border-radius: 6px; font-size: 16px; }
.synthetic-banner strong { color: var(--unverifiable); font-size: 18px; }
.summary { font-size: 16px; padding: 10px 14px; border-radius: 6px; margin: 14px 0; }
.summary.pass { background: #dafbe1; } .summary.fail, .summary.regressed { background: #ffebe9; }
.summary.unverifiable { background: #fff1e5; }
.error { background: #ffebe9; border-left: 6px solid var(--fail); padding: 10px 14px; border-radius: 4px; }
.not-checked { background: #fff8c5; border-left: 6px solid #bf8700; padding: 8px 14px; border-radius: 4px;
  margin: 10px 0; }
.notes { color: var(--muted); font-size: 14px; } .note { color: var(--muted); }
svg.chart { width: 100%; height: auto; display: block; background: #fff; }
svg text { font-family: system-ui, "DejaVu Sans", Arial, sans-serif; fill: #1f2328; font-size: 13px; }
svg .watermark { font-size: 46px; font-weight: 800; fill: #b35c00; fill-opacity: 0.13; letter-spacing: 4px; }
svg .tick { font-size: 12px; fill: #59636e; } svg .axis-label { font-size: 13.5px; font-weight: 600; }
svg .legend-text { font-size: 12.5px; } svg .edge-note { font-size: 11px; fill: #59636e; }
svg .bar-label { font-size: 12.5px; } svg .strong { font-weight: 700; } svg .bar-value { font-size: 12px; }
svg .tol-label { font-size: 12px; fill: #0550ae; font-weight: 600; } svg .peak-label { font-size: 12.5px; }
.diagnosis { border-top: 1px solid var(--line); margin-top: 18px; }
.fix { background: #ddf4ff; padding: 6px 10px; border-radius: 4px; }
.cards { display: flex; gap: 12px; flex-wrap: wrap; }
.card { border: 1px solid var(--line); border-radius: 6px; padding: 8px 14px; min-width: 170px; }
.card .value { font-size: 20px; font-weight: 700; font-family: ui-monospace, "DejaVu Sans Mono", monospace; }
.card .label { color: var(--muted); font-size: 13px; }
details summary { cursor: pointer; color: var(--muted); margin: 16px 0 6px; }
table.layers { border-collapse: collapse; width: 100%; }
table.layers th { text-align: right; font-size: 13px; color: var(--muted); border-bottom: 2px solid var(--line);
  padding: 4px 8px; font-weight: 600; white-space: nowrap; }
.caption { color: var(--muted); font-size: 13.5px; margin: 4px 0 8px; }
table.layers td { text-align: right; padding: 3px 8px; border-bottom: 1px solid #eaeef2; white-space: nowrap; }
table.layers td.verdict { white-space: normal; } .table-wrap { overflow-x: auto; }
table.layers td.verdict, table.layers th:last-child { text-align: left; }
tr.fail td.verdict, tr.regressed td.verdict { color: var(--fail); font-weight: 700; }
tr.pass td.verdict { color: var(--pass); }
tr.unverifiable td.verdict { color: var(--unverifiable); font-weight: 700; }
nav ol { background: #fff; border: 1px solid var(--line); border-radius: 8px; padding: 10px 10px 10px 40px; }
nav a { color: var(--ink); text-decoration: none; } nav a:hover { text-decoration: underline; }
footer { text-align: center; color: var(--muted); font-size: 12px; padding: 16px; }
"""
