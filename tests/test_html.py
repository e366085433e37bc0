"""--html: one self-contained page, read back as XML (it is well-formed XHTML with inline SVG),
written by the `parity` command (parity.cli.main, in this process), and rendered by a real browser
(headless Chromium)."""

import collections
import math
import re
import struct
import subprocess
import xml.etree.ElementTree as ET
import zlib
from html.parser import HTMLParser
from pathlib import Path

import pytest

from parity.definitions.project import parse_project
from parity.engine.results import LayerResult, Report
from parity.errors import ParityError, ProjectConfigError
from parity.outputs import html as page

from .support import run_captured, run_main

CHROMIUM = Path("/usr/bin/chromium")


# -- helpers -------------------------------------------------------------------------------------------

def parse(text: str) -> ET.Element:
    assert text.startswith("<!DOCTYPE html>\n")
    root = ET.fromstring(text.split("\n", 1)[1])
    for element in root.iter():  # drop the XHTML / SVG namespaces: tests name plain tags
        element.tag = element.tag.rsplit("}", 1)[-1]
    return root


def classes(element: ET.Element) -> set[str]:
    return set(element.get("class", "").split())


def having(root: ET.Element, tag: str, cls: str) -> list[ET.Element]:
    return [e for e in root.iter(tag) if cls in classes(e)]


def layer(index: int, diff: float | None, tolerance: float = 3e-5, **kw) -> LayerResult:
    passed = kw.pop("passed", diff is not None and math.isfinite(diff) and diff <= tolerance
                    and kw.get("unverifiable") is None)
    return LayerResult(layer=index, passed=passed, max_abs_diff=diff, max_rel_diff=None, mean_abs_diff=None,
                       max_at=None, noise_floor=2e-6, tolerance=tolerance, ratio_to_noise=None,
                       preactivation_range=[-7.7, 7.9], **kw)


def report(layers, **kw) -> Report:
    fields = dict(model="gpt2", checkpoint="/ckpt/gpt2", weights="real", mapping="gpt2", target="pkg.ffn:MLP",
                  reference="transformers.models.gpt2.modeling_gpt2.GPT2MLP", reference_activation="gelu_new",
                  versions={"parity": "0.1.0", "transformers": "5.0"}, seed=0)
    return Report(**{**fields, **kw}, layers=layers)


GELU_DIAGNOSIS = {"id": "gelu_exact_instead_of_tanh", "message": "exact GELU", "fix": "use tanh GELU",
                  "distance": 0.0, "reference_distance": 4.5e-4}


def mixed_report() -> Report:
    """Layer 1 fails (a GELU mistake), layer 3 cannot be judged, the rest pass."""
    return report([layer(0, 2e-6), layer(1, 4.5e-4, diagnosis=GELU_DIAGNOSIS), layer(2, 1.5e-6),
                   layer(3, 1e-6, unverifiable="two weight matrices are identical"), layer(4, 2.5e-6)])


def points(chart: ET.Element) -> dict[str, set[str]]:
    return {g.get("data-unit"): classes(g) - {"point"} for g in having(chart, "g", "point")}


# -- the page, read as XML -----------------------------------------------------------------------------

def test_the_chart_has_one_point_per_layer_and_marks_the_failed_one():
    root = parse(page.report_html(mixed_report()))
    (chart,) = having(root, "svg", "layer-chart")
    assert points(chart) == {"0": {"pass"}, "1": {"fail"}, "2": {"pass"}, "3": {"unverifiable"}, "4": {"pass"}}
    failed = next(g for g in having(chart, "g", "point") if "fail" in classes(g))
    assert "MISMATCH" in failed.find("title").text and "gelu_exact_instead_of_tanh" in failed.find("title").text
    assert failed.find("path").get("stroke") == page.COLOURS["fail"]  # a red cross, not a dot
    odd = next(g for g in having(chart, "g", "point") if "unverifiable" in classes(g))
    assert odd.find("path").get("stroke") == page.COLOURS["unverifiable"] and odd.find("circle") is None
    for line in ("tolerance", "noise"):  # the steps the marks are judged against
        (path,) = having(chart, "path", line)
        assert path.get("d").count("H") == 5
    labels = {t.text for t in chart.iter("text")}
    assert {"layer", "absolute difference, output units (log scale)", "tolerance", "pass", "fail"} <= labels
    assert "10⁻⁵" in labels  # decades on the log axis
    assert root.find(".//header").findtext("div") == "ERROR"  # a layer could not be judged: exit 2, as the CLI


def test_a_value_the_log_axis_cannot_show_is_still_one_point():
    layers = [layer(0, 0.0), layer(1, None, passed=False), layer(2, float("nan"), unverifiable="overflow"),
              layer(3, 1e30, passed=False)]
    (chart,) = having(parse(page.report_html(report(layers))), "svg", "layer-chart")
    assert points(chart) == {"0": {"pass"}, "1": {"fail"}, "2": {"unverifiable"}, "3": {"fail"}}


def test_one_chart_per_check_and_a_check_that_could_not_run():
    second = report([layer(0, 1e-6), layer(7, 2e-6)], weights="synthetic")
    runs = [page.PageRun("first", mixed_report(), None), page.PageRun("second", second, None),
            page.PageRun("third", None, "checks[2]: no such folder")]
    root = parse(page.render_html(runs, "ERROR: 3 check(s)", 2))
    charts = having(root, "svg", "layer-chart")
    assert [len(points(c)) for c in charts] == [5, 2]
    assert set(points(charts[1])) == {"0", "7"}
    assert "no such folder" in "".join(having(root, "div", "error")[0].itertext())
    assert [a.get("href") for a in root.iter("a")] == ["#check-0", "#check-1", "#check-2"]
    summaries = having(root, "p", "summary")  # each check's own line; the page's is the header
    assert [classes(p) - {"summary"} for p in summaries] == [{"unverifiable"}, {"pass", "synthetic"}]


def test_user_text_is_escaped_and_the_page_stays_well_formed():
    nasty = report([layer(0, 1e-6)], model="<script>alert(1)</script>", checkpoint='/tmp/a&b/"x" <y>\x1b[31m',
                   notes=["<b>bold</b> & more"], weights_note="</dd></dl><img src=x>")
    text = page.report_html(nasty, label="<h1>label</h1>")
    root = parse(text)
    assert not list(root.iter("script")) and not list(root.iter("img")) and not list(root.iter("b"))
    body = "".join(root.itertext())
    assert "<script>alert(1)</script>" in body and '/tmp/a&b/"x" <y>' in body and "<b>bold</b> & more" in body


def test_the_page_needs_no_network():
    text = page.report_html(mixed_report())
    assert "<script" not in text and "<link" not in text and "@import" not in text and "url(" not in text
    assert not re.search(r"\s(src|href)=\"(?!#)", text)
    assert set(re.findall(r"https?://[^\"' ]+", text)) == {"http://www.w3.org/1999/xhtml", "http://www.w3.org/2000/svg"}


def test_synthetic_weights_are_impossible_to_miss():
    synthetic = report([layer(0, 1e-6)], weights="synthetic",
                       weights_note="SYNTHETIC weights: the default checkpoint is not reachable")
    root = parse(page.report_html(synthetic))
    banner = "".join(having(root, "div", "synthetic-banner")[0].itertext())
    assert "SYNTHETIC WEIGHTS" in banner and "not reachable" in banner
    assert "SYNTHETIC WEIGHTS" in {t.text for t in having(root, "text", "watermark")}  # in the chart itself
    assert having(root, "span", "synthetic") and "SYNTHETIC" in root.find(".//header").findtext("div[2]")
    assert having(root, "div", "tag")[0].text == "SYNTHETIC WEIGHTS"  # beside the verdict
    real = parse(page.report_html(mixed_report()))
    assert not having(real, "div", "synthetic-banner") and not having(real, "text", "watermark")
    assert not having(real, "div", "tag")


def test_context_shows_versions_seed_device_and_dtype():
    run = report([layer(0, 1e-6)], seed=7)
    run.device, run.dtype = "cuda:1", "bfloat16"  # set whether or not Report declares them
    context = "".join(having(parse(page.report_html(run)), "dl", "context")[0].itertext())
    for expected in ("/ckpt/gpt2", "pkg.ffn:MLP", "GPT2MLP", "gelu_new", "transformers 5.0", "7", "cuda:1",
                     "bfloat16"):
        assert expected in context


def test_evidence_draws_every_replayed_hypothesis_against_the_tolerance():
    candidates = [{"id": "quick_gelu", "detail": "reference runs gelu_new", "distance": 2.1e-2},
                  {"id": "gelu_exact_instead_of_tanh", "detail": "reference runs gelu_new", "distance": 0.0},
                  {"id": "bias_dropped", "detail": "c_fc.bias missing", "distance": 5.5e-2}]
    result = layer(0, 4.5e-4, diagnosis={**GELU_DIAGNOSIS, "candidates": candidates})
    (chart,) = having(parse(page.report_html(report([result]))), "svg", "evidence-chart")
    bars = having(chart, "g", "bar")
    assert len(bars) == 4 and "reference" in classes(bars[-1])  # the hypotheses, then transformers itself
    assert [classes(b) for b in bars if "within" in classes(b)] == [{"bar", "candidate", "within"}]
    assert "gelu_exact_instead_of_tanh" in bars[0].find("title").text  # closest first
    assert having(chart, "line", "tolerance")


def test_evidence_without_candidates_is_distance_against_reference_distance():
    result = layer(0, 4.5e-4, diagnosis={**GELU_DIAGNOSIS, "distance": 1e-7})
    (chart,) = having(parse(page.report_html(report([result]))), "svg", "evidence-chart")
    widths = [float(b.find("rect").get("width")) for b in having(chart, "g", "bar")]
    assert len(widths) == 2 and widths[0] < widths[1]
    found = {"id": "shape_mismatch", "message": "m", "fix": "f", "distance": None, "reference_distance": None}
    root = parse(page.report_html(report([layer(0, None, passed=False, diagnosis=found)])))
    assert not having(root, "svg", "evidence-chart") and having(root, "div", "diagnosis")


def test_gelu_curves_are_the_known_difference():
    curve = page.activation_curve("exact GELU", "tanh GELU", -8.0, 8.0)
    z, peak = max(curve, key=lambda p: abs(p[1]))
    assert 4.6e-4 < abs(peak) < 4.8e-4 and 2.5 < abs(z) < 2.9  # exact vs tanh GELU differ most near |z| = 2.7
    assert abs(page.gelu_exact(1.0) - 0.8413447460685429) < 1e-15 and page.quick_gelu(-1000.0) == 0.0
    assert page.activation_pair("quick_gelu", "gelu") == ("quick GELU", "exact GELU")
    assert page.activation_pair("quick_gelu", "gelu_new") == ("quick GELU", "tanh GELU")
    assert page.activation_pair("gate_up_swapped", "silu") is None


def test_a_gelu_diagnosis_plots_the_difference_over_the_reached_range():
    root = parse(page.report_html(mixed_report()))
    (chart,) = having(root, "svg", "activation-chart")
    xs = [float(x) for x in re.findall(r"[ML]([\d.]+),", having(chart, "path", "curve")[0].get("d"))]
    assert len(xs) == 241 and xs == sorted(xs)
    ticks = {t.text for t in having(chart, "text", "tick")}
    assert {"-6", "6"} <= ticks and "8" not in ticks  # the layer reached [-7.7, 7.9]
    assert any("exact GELU(z) − tanh GELU(z)" == t.text for t in chart.iter("text"))
    assert not having(parse(page.report_html(report([layer(0, 1e-6)]))), "svg", "activation-chart")


def test_logits_numbers_and_a_logits_check_not_run():
    shift = {"weights": "real", "layers": [0, 1], "tokens": 32, "max_abs_diff": 7.33e-4, "logit_scale": 2.75,
             "top1_agreement": 1.0}
    cards = having(parse(page.report_html(report([layer(0, 1e-6)], logits=shift))), "div", "card")
    values = {c.findtext("div[2]"): c.findtext("div[1]") for c in cards}
    assert values["final logits max |Δ|"] == "7.33e-04" and values["top-1 agreement"] == "100.0%"
    skipped = parse(page.report_html(report([layer(0, 1e-6)], logits={"skipped": "needs 800 GB"})))
    assert "needs 800 GB" in "".join(having(skipped, "div", "logits")[0].itertext())


def test_many_layers_and_experts():
    experts = [layer(i // 8, 1e-6, expert=i % 8) for i in range(64)]
    (chart,) = having(parse(page.report_html(report(experts))), "svg", "layer-chart")
    assert len(points(chart)) == 64 and "3/e5" in points(chart)
    assert "layer / expert" in {t.text for t in chart.iter("text")}
    assert len(having(chart, "text", "tick")) < 64  # labels thinned, points not


def test_an_empty_report_renders_without_a_chart():
    root = parse(page.report_html(report([])))
    assert not having(root, "svg", "layer-chart") and "ERROR" in root.find(".//header").findtext("div")


def test_written_atomically(tmp_path):
    target = tmp_path / "deep" / "report.html"
    page.write_html(target, [page.PageRun("x", mixed_report(), None)], "FAIL: x", 1)
    assert parse(target.read_text(encoding="utf-8")) is not None
    assert [p.name for p in target.parent.iterdir()] == ["report.html"]
    (tmp_path / "file").write_text("")
    with pytest.raises(ParityError, match="--html"):
        page.write_html(tmp_path / "file" / "report.html", [], "x", 2)


def test_project_file_html_key(tmp_path):
    project = parse_project({"html": "out/report.html", "checks": [{"model": "gpt2"}]}, tmp_path / "parity.toml")
    assert project.html == str(tmp_path / "out" / "report.html")
    with pytest.raises(ProjectConfigError, match="'html' has the wrong type"):
        parse_project({"html": 3, "checks": [{"model": "gpt2"}]}, tmp_path / "parity.toml")


# -- the command ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def failing_page(tiny, tmp_path_factory):
    """(exit code, stdout, stderr) of a failing run with --html, and the page (module-scoped: Chromium reads it)."""
    path = tmp_path_factory.mktemp("html") / "fail.html"
    run = run_captured(tiny["gpt2"], "--target", "tests.mutants:gpt2_exact_gelu", "--logits", "--html", path,
                       "--quiet")
    return run, path


def test_cli_failing_run(failing_page):
    (code, _, err), path = failing_page
    assert code == 1, err
    root = parse(path.read_text(encoding="utf-8"))
    (chart,) = having(root, "svg", "layer-chart")
    assert points(chart) == {"0": {"fail"}, "1": {"fail"}, "2": {"fail"}}  # the tiny gpt2 has 3 layers
    assert "FAIL" in "".join(root.find(".//header").itertext())
    assert having(root, "svg", "evidence-chart") and having(root, "svg", "activation-chart")
    assert having(root, "div", "logits") and "gelu_exact_instead_of_tanh" in "".join(root.itertext())


def test_cli_passing_run(tiny, tmp_path, capsys):
    path = tmp_path / "pass.html"
    code, _, err = run_main(capsys, tiny["llama"], "--layers", "0,2", "--html", path, "--quiet")
    assert code == 0, err
    root = parse(path.read_text(encoding="utf-8"))
    (chart,) = having(root, "svg", "layer-chart")
    assert points(chart) == {"0": {"pass"}, "2": {"pass"}}
    assert not having(root, "div", "diagnosis") and "PASS" in "".join(root.find(".//header").itertext())


def test_parity_check_writes_the_project_files_html(tiny, tmp_path, monkeypatch, capsys):
    (tmp_path / "parity.toml").write_text(
        f'html = "out/report.html"\n[[checks]]\nmodel = "{tiny["llama"]}"\nlayers = [1]\n'
        f'[[checks]]\nmodel = "{tiny["gpt2"]}"\nlayers = "0-1"\ntarget = "tests.mutants:gpt2_exact_gelu"\n')
    monkeypatch.chdir(tmp_path)
    code, _, err = run_main(capsys, "check", "--quiet")
    assert code == 1, err
    root = parse((tmp_path / "out" / "report.html").read_text(encoding="utf-8"))
    assert [points(c) for c in having(root, "svg", "layer-chart")] == [{"1": {"pass"}}, {"0": {"fail"}, "1": {"fail"}}]


# -- a real browser ------------------------------------------------------------------------------------

def chromium(page_path: Path, profile: Path, *flags: str) -> subprocess.CompletedProcess:
    command = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               f"--user-data-dir={profile}", *flags, page_path.as_uri()]
    return subprocess.run(command, capture_output=True, text=True, timeout=180)


def png_pixels(data: bytes) -> tuple[int, int, collections.Counter]:
    """(width, height, colour -> pixel count) of an 8-bit RGB/RGBA PNG, decoded with zlib and struct."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    chunks, pos = [], 8
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        chunks.append((kind, data[pos + 8:pos + 8 + length]))
        pos += 12 + length
    width, height, depth, colour_type = struct.unpack(">IIBB", dict(chunks)[b"IHDR"][:10])
    assert depth == 8 and colour_type in (2, 6)
    n = 3 if colour_type == 2 else 4
    raw, stride = zlib.decompress(b"".join(c for k, c in chunks if k == b"IDAT")), width * n
    prev, counts = bytearray(stride), collections.Counter()
    for y in range(height):
        line = unfilter(raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)]), prev, n)
        counts.update(bytes(line[i:i + 3]) for i in range(0, stride, n))
        prev = line
    return width, height, counts


def unfilter(kind: int, line: bytearray, prev: bytearray, n: int) -> bytearray:
    """Undo one row's PNG filter (0 None, 1 Sub, 2 Up, 3 Average, 4 Paeth)."""
    if kind == 0:
        return line
    if kind == 2:
        return bytearray((x + b) & 255 for x, b in zip(line, prev, strict=True))
    for i in range(len(line)):
        a = line[i - n] if i >= n else 0
        if kind == 3:
            a = (a + prev[i]) >> 1
        elif kind == 4:
            b, c = prev[i], prev[i - n] if i >= n else 0
            p = a + b - c
            a = a if abs(p - a) <= abs(p - b) and abs(p - a) <= abs(p - c) else b if abs(p - b) <= abs(p - c) else c
        line[i] = (line[i] + a) & 255
    return line


class ChartElements(HTMLParser):
    def __init__(self):
        super().__init__()
        self.found = collections.Counter()

    def handle_starttag(self, tag, attrs):
        for cls in (dict(attrs).get("class") or "").split():
            self.found[(tag, cls)] += 1


@pytest.mark.slow  # a real browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason="headless Chromium is not installed (/usr/bin/chromium; "
                                                  "Debian: apt-get install chromium)")
def test_headless_chromium_renders_the_charts(failing_page, tmp_path):
    _, path = failing_page
    dom = chromium(path, tmp_path / "profile-dom", "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    seen = ChartElements()
    seen.feed(dom.stdout)
    assert seen.found[("svg", "layer-chart")] == 1 and seen.found[("g", "point")] == 3
    assert seen.found[("g", "fail")] == 3 and seen.found[("svg", "evidence-chart")] == 1
    assert seen.found[("path", "curve")] == 1 and seen.found[("path", "tolerance")] == 1
    shot = tmp_path / "page.png"
    out = chromium(path, tmp_path / "profile-shot", f"--screenshot={shot}", "--window-size=1280,2000")
    assert out.returncode == 0 and shot.is_file(), out.stderr[-2000:]
    width, height, colours = png_pixels(shot.read_bytes())
    assert (width, height) == (1280, 2000)
    assert len(colours) > 200  # text, antialiased curves and markers: not a blank or a one-colour page

    def pixels(name: str) -> int:
        return colours[bytes.fromhex(page.COLOURS[name][1:])]

    assert pixels("zone") > 10_000  # the fail zone above the tolerance, drawn only in the layer chart
    assert pixels("fail") > 100 and pixels("curve") > 200 and pixels("tolerance") > 200
