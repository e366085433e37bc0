"""A report rendered, as public API: ``parity.render(report)`` (the text table `parity MODEL` prints) and
``parity.render_html(report)`` (the same, for notebooks).

Importing this module registers both with ``parity.engine.results``, so ``str(report)`` is the text
table and Jupyter shows the HTML, while the engine never imports outputs (imports go down only).
The front doors (``parity.api``, ``parity.testing``, ``parity.render``) import it.
"""

from __future__ import annotations

from html import escape

from parity.engine.results import Report, register_renderers
from parity.outputs.text import render as render_text
from parity.outputs.text import summary_line

COLORS = {"pass": "#1a7f37", "fail": "#cf222e", "unverifiable": "#9a6700"}


def render(report: Report) -> str:
    """The report as text: header, one row per layer, diagnoses, summary line (``str(report)``)."""
    return render_text(report)


def render_html(report: Report) -> str:
    """The report as HTML: the verdict line in colour, then the text table (``report._repr_html_()``)."""
    color = COLORS.get(report.status, "inherit")
    return (f'<div class="parity-report"><p style="font-weight:bold;color:{color}">{escape(summary_line(report))}'
            f'</p><pre>{escape(render_text(report))}</pre></div>')


register_renderers(text=render, html=render_html)
