"""The report as text: the header, one table row per layer, diagnosis blocks, the summary line.

The CLI prints these pieces as layers finish; ``render`` joins them for a finished report
(``assert_parity``'s message): one renderer for both.
"""

from __future__ import annotations

from typing import Callable

from parity.engine.results import LayerResult, Report


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


def suite_summary(runs, code: int, regressed: int | None, shard) -> str:
    layers = sum(len(run.report.layers) for run in runs if run.report is not None)
    results = [layer for run in runs if run.report is not None for layer in run.report.layers]
    failed = sum(not layer.passed and layer.unverifiable is None for layer in results)
    unverifiable = sum(layer.unverifiable is not None for layer in results)
    errors = sum(run.error is not None for run in runs)
    where = f" in shard {shard[0]}/{shard[1]}" if shard else ""
    verdict = {0: "PASS", 1: "FAIL", 2: "ERROR"}[code]
    against = "" if regressed is None else f"{regressed} regressed against the baseline, "
    line = (f"{verdict}: {len(runs)} check(s), {layers} layer(s) checked{where}; {failed} deviate, "
            f"{unverifiable} could not be verified, {against}{errors} could not run.")
    if not results and not errors:
        line += " Nothing was compared, so this is not a pass."
    synthetic = [run.label for run in runs if run.report is not None and run.report.synthetic]
    if synthetic:
        line += f" SYNTHETIC weights (no real checkpoint weight read) in: {', '.join(synthetic)}."
    return line


class TextWriter:
    """A report as text, written as it grows: header and column titles before a check's first row,
    one row per layer, then the diagnosis, logits and summary blocks.  The CLI streams it while
    layers run; ``render`` uses the same writer for a finished report."""

    def __init__(self, say: Callable[[str], None]):
        self.say = say
        self.started: list[int] = []  # id() of the reports whose header was written

    def layer(self, report: Report, result: LayerResult) -> None:
        self._start(report, result)
        self.say(layer_line(result))

    def finish(self, report: Report, summary: bool = True) -> None:
        self._start(report, report.layers[0] if report.layers else None)
        self.say("")
        for line in [*diagnosis_lines(report), *logits_lines(report)]:
            self.say(line)
        if summary:
            self.say(summary_line(report))

    def _start(self, report: Report, first: LayerResult | None) -> None:
        if id(report) in self.started:
            return
        if self.started:
            self.say("")
        self.started.append(id(report))
        for line in [*header_lines(report), "", HEADER if first is None else table_header(first)]:
            self.say(line)


def render(report: Report) -> str:
    """The whole report as the CLI prints it (``assert_parity``'s message)."""
    lines: list[str] = []
    writer = TextWriter(lines.append)
    for result in report.layers:
        writer.layer(report, result)
    writer.finish(report)
    return "\n".join(lines)
