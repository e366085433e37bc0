"""The report as text: the header, one table row per layer, diagnosis blocks, the summary line.

The CLI prints these pieces as layers finish; ``render`` joins them for a finished report
(``assert_parity``'s message): one renderer for both.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from parity.definitions.mapping import route_arrows
from parity.definitions.mistakes import MistakeId
from parity.engine.results import LayerResult, Report, units_noun, within_layer

GELU_VARIANTS = (MistakeId.GELU_EXACT_INSTEAD_OF_TANH, MistakeId.GELU_TANH_INSTEAD_OF_EXACT)
# found from the runs and the shapes, not by a replay: as visible at a low precision as in float32
NEEDS_NO_REPLAY = (MistakeId.DROPOUT_ACTIVE, MistakeId.INPUT_MUTATED, MistakeId.NONFINITE_OUTPUT,
                   MistakeId.INTERMEDIATE_SIZE_MISMATCH, MistakeId.SHAPE_MISMATCH)


def _sci(value: float | None) -> str:
    return "-" if value is None else f"{value:.2e}"


HEADER = (f"{'layer':>5}  {'max|Δ|':>9}  {'rel':>9}  {'mean|Δ|':>9}  {'noise':>9}  {'tol':>9}  "
          f"{'×noise':>7}  {'z range':>15}  verdict")




def expert_header(header: str, width: int = 6) -> str:
    """A table's header with the expert column (``width`` wide) after the layer's."""
    return f"{'layer':>5}  {'expert':>{width}}" + header[5:]
# A low-precision run (--dtype bfloat16 / float16): the noise columns hold the reference's own error in that
# dtype and the ratio to it (LayerResult.reference_error, ratio_to_reference_error).
LOW_COLUMNS = (f"{'noise':>9}  {'tol':>9}  {'×noise':>7}", f"{'ref err':>9}  {'tol':>9}  {'×ref':>7}")


def table_header(result: LayerResult | None, low_precision: bool = False, width: int = 6) -> str:
    """The column header for a table whose rows look like ``result`` (an expert column for MoE, where a layer
    has several units: ``width`` wide, the longest unit name's)."""
    header = HEADER if result is None or units_noun([result]) == "layer" else expert_header(HEADER, width)
    return header.replace(*LOW_COLUMNS) if low_precision else header


def framework_label(report: Report) -> str:
    """' (mlx 0.32.4)' for a target of another framework than PyTorch, else ''."""
    if report.framework == "torch":
        return ""
    from parity.targets import distribution_of

    package = distribution_of(report.framework)
    version = report.versions.get(package, "?")
    return f" ({report.framework} {version})" if package == report.framework else \
        f" ({report.framework}, {package} {version})"


def header_lines(report: Report) -> list[str]:
    title = report.model if not report.name or report.name == report.model else f"{report.name} ({report.model})"
    lines = [
        f"parity: {title} — mapping '{report.mapping}'",
        f"  checkpoint  {report.checkpoint} ({report.weights} weights)",
        f"  target      {report.target}{framework_label(report)}",
        *([f"  routes      {routes_line(report.routes)}"] if report.routes else []),
        f"  reference   transformers {report.versions.get('transformers', '?')} {report.reference} "
        f"(activation: {report.reference_activation})",
        *([f"  filled      {reference_filled(report.reference_routes)}"] if report.reference_routes else []),
    ]
    if report.low_precision or report.device != "cpu":
        lines.append(f"  compute     {report.dtype} on {report.device} (truth: float64 on cpu)")
    if report.weights_note:
        lines.append(f"  !! {report.weights_note}")
    lines.extend(f"  note: {note}" for note in report.notes)
    return lines


def reference_filled(routes: dict) -> str:
    """How the reference was filled: 'under transformers' own names', or its routes (a converted format)."""
    if all(spelled == target for target, spelled in routes.items()):
        return "under transformers' own names"
    return route_arrows(routes)


ROUTES_SHOWN = 8  # routes the header lists; a block's many more are in the JSON


def routes_line(routes: dict) -> str:
    """The routes that filled the target, 'param ← tensor' ('.T': transposed), and where they came from."""
    derived = routes["extends"].startswith("derived from ")  # a derived layout: no file for --save-mapping to extend
    origin = ("inferred from parameter names" + ("" if derived else "; --save-mapping FILE writes them")
              if routes.get("inferred")
              else f"mapping {routes['extends'].rsplit('/', 1)[-1]}")
    tensors = routes["tensors"]
    if len(tensors) > ROUTES_SHOWN and all(spelled == target for target, spelled in tensors.items()):
        return f"each of {len(tensors)} parameters from the tensor of its own name ({origin})"
    if len(tensors) > ROUTES_SHOWN:  # a whole MoE block: one route per expert's projection; the JSON has them all
        shown = dict(list(tensors.items())[:ROUTES_SHOWN])
        return f"{route_arrows(shown)}, ... {len(tensors) - ROUTES_SHOWN} more in the JSON ({origin})"
    return f"{route_arrows(tensors)} ({origin})"


def layer_line(result: LayerResult, width: int = 6) -> str:
    zrange = "-" if result.preactivation_range is None else "[{:.1f}, {:.1f}]".format(*result.preactivation_range)
    low = result.reference_error is not None  # a low-precision row: its noise is the reference's own error
    noise, ratio = ((result.reference_error, result.ratio_to_reference_error) if low
                    else (result.noise_floor, result.ratio_to_noise))
    ratio = "-" if ratio is None else f"{ratio:.1f}"
    verdict = ("UNVERIFIABLE" if result.unverifiable is not None else "MISMATCH" if not result.passed
               else "REGRESSED" if result.regressed else "ok")
    if result.regressed:
        verdict += f" (baseline: {result.baseline['message']})"
    if result.diagnosis:
        verdict += f" — {result.diagnosis.id}"
    cell = unit_cell(result, width)
    return (f"{cell}  {_sci(result.max_abs_diff):>9}  {_sci(result.max_rel_diff):>9}  "
            f"{_sci(result.mean_abs_diff):>9}  {_sci(noise):>9}  {_sci(result.tolerance):>9}  "
            f"{ratio:>7}  {zrange:>15}  {verdict}")


def unit_label(result: LayerResult) -> str:
    """'3' for a layer, '3/e1' for expert 1 of layer 3, '3/shared_expert' for a named unit of it."""
    part = within_layer(result)
    return str(result.layer) if part is None else f"{result.layer}/{part}"


def unit_cell(result: LayerResult, width: int = 6) -> str:
    """The layer (and expert) columns of a row; a named unit in the expert column, ``width`` wide."""
    if result.expert is None and result.unit is None:
        return f"{result.layer:>5}"
    return f"{result.layer:>5}  {result.expert if result.expert is not None else result.unit:>{width}}"


def coverage_lines(report: Report) -> list[str]:
    """Per whole-MoE-block unit: how much of the routing its inputs exercised, and the near-ties set aside."""
    lines = [coverage_line(result) for result in report.layers if result.coverage is not None]
    return [*lines, ""] if lines else []


def coverage_line(result: LayerResult) -> str:
    """'coverage (layer 1/block): 48 tokens, every expert chosen by some token (...); no near-ties'."""
    c = result.coverage
    never = c["never_chosen"]
    chosen = ("every expert chosen by some token" if not never
              else f"experts {', '.join(map(str, never))} chosen by no token (not exercised)")
    aside = (f"; {c['set_aside']} near-tie token(s) set aside (their choice of experts moves within float32 "
             f"noise), {c['set_aside_agree']} of them matching one of transformers' choices"
             if c["set_aside"] else "; no near-ties")
    return (f"coverage (layer {unit_label(result)}): {c['tokens']} tokens, {chosen} (tokens per expert "
            f"{min(c['tokens_per_expert'])} to {max(c['tokens_per_expert'])}){aside}")


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
        if not d or d.id in seen:
            continue
        seen.add(d.id)
        layers = [unit_label(r) for r in report.layers if r.diagnosis and r.diagnosis.id == d.id]
        lines.append(f"diagnosis {d.id} (layers {', '.join(map(str, layers))}): {d.message}")
        if d.distance is not None and d.reference_distance is not None and d.id == MistakeId.DROPOUT_ACTIVE:
            lines.append(f"  evidence: two runs on the same input differ by {d.distance:.2e}; the first is "
                         f"{d.reference_distance:.2e} from transformers")  # no replay: its distance is the runs'
        elif d.distance is not None and d.reference_distance is not None:
            lines.append(f"  evidence: the module is {d.distance:.2e} from this mistake's replay "
                         f"and {d.reference_distance:.2e} from transformers")
        if d.id == MistakeId.UNEXPLAINED and result.max_at:  # where to look: the JSON's max_at, said in the text
            batch, token, channel = result.max_at
            lines.append(f"  largest deviation (layer {unit_label(result)}): input row {batch}, token {token}, output "
                         f"channel {channel} of parity's inputs (seed {report.seed})")
        lines.append(f"  fix: {d.fix}")
        lines.append("")
    return lines + separability_lines(report)


def separability_lines(report: Report) -> list[str]:
    """A low-precision run: which known mistakes its layers can still tell from a correct module, and
    which not (with the numbers of the layer where the mistake came closest to passing)."""
    rows = [row for result in report.layers for row in result.separability or []]
    if not rows:
        return []
    missed: dict[tuple[str, str], list[tuple[LayerResult, dict]]] = {}  # (id, detail) -> where it is not checked
    for result in report.layers:
        for row in result.not_checked:
            key = (row.id, "" if row.id in GELU_VARIANTS else row.detail)
            missed.setdefault(key, []).append((result, row))
    lines = []
    for found in missed.values():  # the numbers of the layer where the mistake is least visible
        least, row = min(found, key=lambda pair: pair[1].distance / max(pair[0].tolerance or 0.0, 1e-300))
        where = units_label(list({id(r): r for r, _ in found}.values()))
        if len(found) > 1:
            where += f"; the figures are {units_label([least])}'s, where it is least visible"
        lines.append(f"{where}: {row.message}")  # the message names the mistake and the condition
    told = sorted({row.id for row in rows if row.checked} - {mistake for mistake, _ in missed})
    lines.append(f"told apart {condition(report)} on every layer: {', '.join(told + list(NEEDS_NO_REPLAY))}")
    return [*lines, ""]


def units_label(results: list[LayerResult]) -> str:
    """'layer 3', 'layers 0, 1', 'experts 1/e2, 1/e5' (named: a bare '1' reads as a count)."""
    noun = units_noun(results)
    labels = ", ".join(unit_label(r) for r in results[:12]) + (" ..." if len(results) > 12 else "")
    return f"{noun}{'s' if len(results) > 1 else ''} {labels}"


def diagnosis_ids(results: list[LayerResult]) -> str:
    """' — gate_up_swapped, bias_dropped' (the distinct diagnosis ids of these layers) or ''."""
    ids = list(dict.fromkeys(str(r.diagnosis.id) for r in results if r.diagnosis))
    return f" — {', '.join(ids)}" if ids else ""


SYNTHETIC_WARNING = "SYNTHETIC weights: no real checkpoint weight was read (--require-real refuses this)."


def summary_line(report: Report) -> str:
    """The one line CI logs show (also with --quiet): the verdict, and what it rests on."""
    if not report.layers:
        return "ERROR: no layer was checked: nothing was compared, so this is not a pass."
    unit = f"{units_noun(report.layers)}(s)"
    failed = [r for r in report.layers if not r.passed and r.unverifiable is None]
    unverifiable = report.unverifiable
    regressed = report.regressed
    if failed:
        line = (f"FAIL: {len(failed)} of {len(report.layers)} {unit} deviate from transformers: {units_label(failed)}"
                f"{diagnosis_ids(failed)}")
        if unverifiable:
            line += f"; {len(unverifiable)} could not be verified: {units_label(unverifiable)}"
        if regressed:
            line += f"; {len(regressed)} regressed against the baseline: {units_label(regressed)}"
    elif unverifiable:
        line = (f"ERROR: {len(unverifiable)} of {len(report.layers)} {unit} could not be verified "
                f"({unverifiable[0].unverifiable}): {units_label(unverifiable)}")
    elif regressed:
        line = (f"FAIL: {len(regressed)} of {len(report.layers)} {unit} regressed against the baseline: "
                f"{units_label(regressed)} ({regressed[0].baseline['message']}); all are within tolerance.")
    else:
        line = f"PASS: {len(report.layers)} {unit} match transformers within tolerance."
    if report.low_precision:
        line = line.rstrip(".") + f" (at {report.dtype} on {report.device})."
    line += not_checked_summary(report)
    return f"{line} {SYNTHETIC_WARNING}" if report.synthetic else line


def condition(report: Report) -> str:
    """'at bfloat16', 'with --atol 2', 'at bfloat16 with --atol 0.1': what the separability rows were judged at."""
    parts = [f"at {report.dtype}"] if report.low_precision else []
    if report.atol is not None:
        parts.append(f"with --atol {report.atol:g}")
    return " ".join(parts) or "at float32"


def not_checked_summary(report: Report) -> str:
    """' Not checked at bfloat16: gelu_exact_instead_of_tanh, ...; run with --dtype float32 to check them.' or ''; the
    advice names
    the real cause: the dtype, or the --atol that a mistake fits under (by the rows' own messages)."""
    rows = [row for result in report.layers for row in result.not_checked]
    names = list(dict.fromkeys(row.id for row in rows))  # the ids, as the JSON has them
    if not names:
        return ""
    by_tolerance = any("drop --atol" in (row.message or "") for row in rows)
    by_dtype = any("--dtype float32" in (row.message or "") for row in rows)
    advice = ("run with --dtype float32 and without --atol" if by_dtype and report.atol is not None
              else "drop --atol" if by_tolerance else "run with --dtype float32")
    return (f" Not checked {condition(report)}: {', '.join(names)}; {advice} to check "
            f"{'it' if len(names) == 1 else 'them'}.")


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
    compares = sum(getattr(getattr(run, "spec", None), "kind", "check") == "compare" for run in runs)
    counted = (f"{len(runs) - compares} check(s) and {compares} compare(s)" if compares
               else f"{len(runs)} check(s)")
    line = (f"{verdict}: {counted}, {layers} layer(s) checked{where}; {failed} deviate, "
            f"{unverifiable} could not be verified, {against}{errors} could not run.")
    if not results and not errors:
        line += " Nothing was compared, so this is not a pass."
    caveats = [f"{run.label}:{not_checked_summary(run.report)}" for run in runs
               if run.report is not None and not_checked_summary(run.report)]
    if caveats:  # a low-precision pass that cannot tell some mistakes apart: the -q line says it too
        line += " " + " ".join(caveats)
    failing = [as_given(run.label) for run in runs
               if run.error is not None or (run.report is not None and not run.report.passed)]
    if failing:
        shown = ", ".join(failing[:8]) + (f" and {len(failing) - 8} more" if len(failing) > 8 else "")
        line += f" Failing: {shown}."
    synthetic = [as_given(run.label) for run in runs if run.report is not None and run.report.synthetic]
    if synthetic:
        line += f" SYNTHETIC weights (no real checkpoint weight read) in: {', '.join(synthetic)}."
    return line


def as_given(label: str) -> str:
    """A check's label as the project file gave its paths: the project file's folder is made part of a local
    path when the check is read (``models/gpt2`` becomes absolute); run from that folder, it is left out again."""
    return label.replace(os.path.join(os.getcwd(), ""), "")


class TextWriter:
    """A report as text, written as it grows: header and column titles before a check's first row,
    one row per layer, then the diagnosis, logits and summary blocks.  The CLI streams it while
    layers run; ``render`` uses the same writer for a finished report."""

    def __init__(self, say: Callable[[str], None]):
        self.say = say
        self.started: list[int] = []  # id() of the reports whose header was written
        self.noted: dict[int, int] = {}  # id() of a report -> how many of its notes its header wrote

    def layer(self, report: Report, result: LayerResult) -> None:
        self._start(report, result)
        self.say(layer_line(result, report.unit_width))

    def finish(self, report: Report, summary: bool = True) -> None:
        self._start(report, report.layers[0] if report.layers else None)
        self.say("")
        later = report.notes[self.noted.get(id(report), len(report.notes)):]
        for note in later:  # found by a later layer than the header's (an ONNX graph of another layer, say)
            self.say(f"note: {note}")
        if later:
            self.say("")
        for line in [*coverage_lines(report), *diagnosis_lines(report), *logits_lines(report)]:
            self.say(line)
        if summary:
            self.say(summary_line(report))

    def _start(self, report: Report, first: LayerResult | None) -> None:
        if id(report) in self.started:
            return
        if self.started:
            self.say("")
        self.started.append(id(report))
        self.noted[id(report)] = len(report.notes)
        for line in [*header_lines(report), "", table_header(first, report.low_precision, report.unit_width)]:
            self.say(line)


def render(report: Report) -> str:
    """The whole report as the CLI prints it (``assert_parity``'s message)."""
    lines: list[str] = []
    writer = TextWriter(lines.append)
    for result in report.layers:
        writer.layer(report, result)
    writer.finish(report)
    return "\n".join(lines)
