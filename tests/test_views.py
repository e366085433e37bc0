"""Every view tells the same truth: exit code, text, JSON, JUnit, HTML and pytest agree with the verdict,
and every output lands in exactly what the user named (a device or FIFO is written, never replaced)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
import threading
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from .support import ROOT, run_main, run_parity

pytest_plugins = ["pytester"]


def is_char_device(path: str) -> bool:
    return stat.S_ISCHR(os.stat(path).st_mode)


# -- outputs land in what the user named ------------------------------------------------------------

def test_dev_null_stays_a_device_and_dev_full_is_an_error(tiny, capsys):
    code, _, _ = run_main(capsys, tiny["gpt2"], "--layer", "0", "--json", "/dev/null", "--junit", "/dev/null",
                          "--html", "/dev/null", "-q")
    assert code == 0
    assert is_char_device("/dev/null")
    code, _, err = run_main(capsys, tiny["gpt2"], "--layer", "0", "--junit", "/dev/full", "-q")
    assert code == 2 and "--junit /dev/full: cannot write the file" in err and "No space left" in err
    assert is_char_device("/dev/full")


def test_a_fifo_is_written_to_its_reader_not_replaced(tiny, tmp_path, capsys):
    fifo = tmp_path / "report.xml"
    os.mkfifo(fifo)
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()), daemon=True)
    reader.start()
    code, _, _ = run_main(capsys, tiny["gpt2"], "--layer", "0", "--junit", fifo, "-q")
    reader.join(timeout=60)
    assert code == 0 and not reader.is_alive()
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert ET.fromstring(received[0]).get("tests") == "1"


@pytest.mark.slow
def test_dev_stdout_into_a_pipe_and_a_file(tiny, tmp_path):
    out = run_parity(tiny["gpt2"], "--layer", "0", "--json", "/dev/stdout", "-q")  # stdout is a pipe here
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout[out.stdout.index("{"):])["passed"] is True
    log = tmp_path / "log.txt"
    with open(log, "w") as handle:  # /dev/stdout is then a regular file: appended to, never replaced
        code = subprocess.run([sys.executable, "-m", "parity", str(tiny["gpt2"]), "--layer", "0", "--json",
                               "/dev/stdout"], stdout=handle, stderr=subprocess.PIPE, cwd=ROOT, timeout=600,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"}).returncode
    # /dev/stdout is stdout: as with --json -, the text goes to stderr and stdout is exactly the JSON document
    assert code == 0 and json.loads(log.read_text())["passed"] is True


@pytest.mark.slow
def test_stdout_that_cannot_be_written_is_exit_2(tiny):
    with open("/dev/full", "w") as full:
        out = subprocess.run([sys.executable, "-m", "parity", str(tiny["gpt2"]), "--layer", "0"], stdout=full,
                             stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=600,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 2 and "cannot write to standard output" in out.stderr


@pytest.mark.parametrize("option", ["--json", "--junit", "--html", "--save-mapping", "--baseline"])
def test_an_empty_output_path_is_a_usage_error(tiny, option, capsys):
    with pytest.raises(SystemExit) as exit_:
        run_main(capsys, tiny["gpt2"], "--layer", "0", option, "")
    assert exit_.value.code == 2
    assert f"argument {option}: the value is empty" in capsys.readouterr().err


def test_an_empty_path_in_a_project_file_is_an_error(tiny, tmp_path, monkeypatch, capsys):
    (tmp_path / "parity.toml").write_text(f'baseline = ""\n[[checks]]\nmodel = {json.dumps(str(tiny["gpt2"]))}\n')
    monkeypatch.chdir(tmp_path)
    code, _, err = run_main(capsys, "check")
    assert code == 2 and "'baseline' is empty" in err


def test_an_error_run_replaces_the_last_green_reports(tiny, tmp_path, capsys):
    files = {"--json": tmp_path / "r.json", "--junit": tmp_path / "r.xml", "--html": tmp_path / "r.html"}
    options = [str(x) for pair in files.items() for x in pair]
    assert run_main(capsys, tiny["gpt2"], "--layer", "0", *options)[0] == 0
    assert json.loads(files["--json"].read_text())["passed"] is True
    code, _, err = run_main(capsys, tiny["gpt2"], "--layer", "0", "--target", "no_such_module:MLP", *options)
    assert code == 2 and "no_such_module" in err
    document = json.loads(files["--json"].read_text())
    assert document["kind"] == "error" and document["passed"] is False and "no_such_module" in document["error"]
    junit = ET.parse(files["--junit"]).getroot()
    assert junit.get("errors") == "1" and junit.get("failures") == "0"
    assert "no_such_module" in junit.find(".//error").get("message")
    page = files["--html"].read_text()
    assert "ERROR" in page and "no_such_module" in page and "PASS" not in page


def test_a_project_file_error_still_writes_the_named_reports(tmp_path, monkeypatch, capsys):
    (tmp_path / "parity.toml").write_text("[[checks]]\nmodel = 3\n")
    monkeypatch.chdir(tmp_path)
    code, _, _ = run_main(capsys, "check", "--json", "r.json", "--junit", "r.xml")
    assert code == 2
    assert json.loads((tmp_path / "r.json").read_text())["kind"] == "error"
    assert ET.parse(tmp_path / "r.xml").getroot().get("errors") == "1"


def test_an_error_json_on_stdout_is_valid_against_the_schema(tiny, capsys):
    import jsonschema  # a test dependency: a missing install fails here, never skips

    from parity.engine.results import SCHEMA_FILE

    code, out, _ = run_main(capsys, tiny["gpt2"], "--layer", "0", "--target", "no_such_module:MLP", "--json", "-")
    assert code == 2
    jsonschema.validate(json.loads(out), json.loads(SCHEMA_FILE.read_text()))


# -- --save-mapping never destroys a user's file ---------------------------------------------------

def test_save_mapping_refuses_a_file_it_did_not_write(tiny, tmp_path, capsys):
    precious = tmp_path / "pyproject.toml"
    precious.write_text("[project]\nname = 'mine'\n")
    code, _, err = run_main(capsys, tiny["gpt2"], "--layer", "0", "--save-mapping", precious)
    assert code == 2 and "was not written by --save-mapping" in err and "--force" in err
    assert precious.read_text() == "[project]\nname = 'mine'\n"
    assert run_main(capsys, tiny["gpt2"], "--layer", "0", "--save-mapping", precious, "--force")[0] == 0
    assert precious.read_text().startswith("# Written by `parity ")
    assert run_main(capsys, tiny["gpt2"], "--layer", "0", "--save-mapping", precious)[0] == 0  # its own file


def test_save_mapping_never_replaces_a_file_the_user_edited_since(tiny, tmp_path, capsys):
    """The template says "replace each ? ... then run with --mapping this file": once the user has done that in
    place, the file is theirs, although its first line still says parity wrote it."""
    saved = tmp_path / "mine.toml"
    assert run_main(capsys, tiny["gpt2"], "--layer", "0", "--save-mapping", saved)[0] == 0
    assert run_main(capsys, tiny["gpt2"], "--layer", "0", "--save-mapping", saved)[0] == 0  # untouched: replaced
    edited = saved.read_text().replace('"c_fc.bias"', '"c_fc.bias"  # checked by hand', 1)
    assert edited != saved.read_text() and edited.startswith("# Written by `parity ")
    saved.write_text(edited)
    code, out, err = run_main(capsys, tiny["gpt2"], "--layer", "0", "--save-mapping", saved)
    assert code == 2 and "has been edited since" in err and "--force" in err and str(saved) in err
    assert "PASS" not in out and "max|Δ|" not in out  # refused before anything was computed
    assert saved.read_text() == edited
    assert run_main(capsys, tiny["gpt2"], "--layer", "0", "--save-mapping", saved, "--force")[0] == 0
    assert saved.read_text() != edited


def test_save_mapping_never_overwrites_the_mapping_it_was_given(tiny, tmp_path, capsys):
    mapping = tmp_path / "m.toml"
    assert run_main(capsys, tiny["gpt2"], "--layer", "0", "--save-mapping", mapping)[0] == 0
    before = mapping.read_text()
    linked = tmp_path / "hard-link.toml"
    linked.hardlink_to(mapping)  # another name of the same file
    for extra, destination in (([], mapping), (["--force"], mapping), ([], linked)):
        code, _, err = run_main(capsys, tiny["gpt2"], "--layer", "0", "--mapping", mapping, "--save-mapping",
                                destination, *extra)
        assert code == 2 and "is the run's mapping" in err and "would destroy it" in err
        assert mapping.read_text() == before
    assert run_main(capsys, tiny["gpt2"], "--layer", "0", "--mapping", mapping)[0] == 0


# -- a regression is the check's own verdict, in every view ----------------------------------------

FACTORY = """
from parity.ffn import FeedForward

def MLP(config):
    return FeedForward(config.n_embd, dropout=0.0, activation="gelu_tanh")
"""


def project(folder: Path, tiny, checks: list[dict]) -> None:
    lines = ['baseline = "baseline.json"']
    for check in checks:
        lines.append("[[checks]]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in check.items()]
    (folder / "parity.toml").write_text("\n".join(lines) + "\n")


def shrink_baseline(path: Path) -> None:
    """Every stored max|Δ| made 1000x smaller: today's run regressed against it while still within tolerance."""
    data = json.loads(path.read_text())
    for entry in data["entries"].values():
        entry["max_abs_diff"] = entry["max_abs_diff"] / 1000
    path.write_text(json.dumps(data))


def test_a_regression_is_red_in_json_html_text_and_junit(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    project(tmp_path, tiny, [{"name": "gpt2-ffn", "model": str(tiny["gpt2"]), "layers": [0, 1]},
                             {"name": "llama-ffn", "model": str(tiny["llama"]), "layers": [0]}])
    assert run_main(capsys, "check", "--update-baseline")[0] == 0
    data = json.loads((tmp_path / "baseline.json").read_text())
    gpt2_keys = [key for key in data["entries"] if key.startswith("check gpt2-ffn | ")]
    for key in gpt2_keys:
        data["entries"][key]["max_abs_diff"] /= 1000
    (tmp_path / "baseline.json").write_text(json.dumps(data))

    code, out, _ = run_main(capsys, "check", "--json", "r.json", "--html", "r.html", "--junit", "r.xml")
    assert code == 1
    checks = {c["name"]: c["report"] for c in json.loads((tmp_path / "r.json").read_text())["checks"]}
    assert checks["gpt2-ffn"]["status"] == "regressed" and checks["gpt2-ffn"]["passed"] is False
    assert [layer["status"] for layer in checks["gpt2-ffn"]["layers"]] == ["regressed", "regressed"]
    assert checks["gpt2-ffn"]["layers"][0]["baseline"]["status"] == "regressed"
    assert checks["llama-ffn"]["status"] == "pass" and checks["llama-ffn"]["passed"] is True
    assert "FAIL: 2 of 2 layer(s) regressed against the baseline: layers 0, 1" in out
    assert "REGRESSED (baseline: max|Δ| grew" in out
    assert "Failing: gpt2-ffn." in out.splitlines()[-2] + out.splitlines()[-1]
    page = (tmp_path / "r.html").read_text()
    assert '<span class="badge regressed">REGRESSED</span>' in page and 'class="baseline-mark"' in page
    assert '<tr class="regressed">' in page
    junit = ET.parse(tmp_path / "r.xml").getroot()
    failed = [case.get("name") for case in junit.iter("testcase") if case.find("failure") is not None]
    assert failed == ["layer 0", "layer 1"] and junit.get("failures") == "2"


def test_single_check_regression_in_its_report(tiny, tmp_path, capsys):
    baseline = tmp_path / "b.json"
    assert run_main(capsys, tiny["gpt2"], "--layer", "1", "--baseline", baseline, "--update-baseline")[0] == 0
    shrink_baseline(baseline)
    code, out, _ = run_main(capsys, tiny["gpt2"], "--layer", "1", "--baseline", baseline, "--json", "-")
    assert code == 1
    report = json.loads(out)
    assert report["status"] == "regressed" and report["passed"] is False
    assert report["layers"][0]["baseline"]["max_abs_diff"] > 0


def test_baseline_follows_the_check_name_when_the_target_moves(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mymod.py").write_text(FACTORY)
    (tmp_path / "mymod_ffn.py").write_text(FACTORY)
    project(tmp_path, tiny, [{"name": "ffn", "model": str(tiny["gpt2"]), "layers": [0], "target": "mymod:MLP"}])
    assert run_main(capsys, "check", "--update-baseline")[0] == 0
    project(tmp_path, tiny, [{"name": "ffn", "model": str(tiny["gpt2"]), "layers": [0], "target": "mymod_ffn:MLP"}])
    code, out, err = run_main(capsys, "check", "--json", "r.json", "--html", "r.html")
    assert code == 0, err
    assert (out + err).count("target was mymod:MLP, now mymod_ffn:MLP") == 1
    notes = json.loads((tmp_path / "r.json").read_text())["baseline"]["notes"]
    assert notes == ["target was mymod:MLP, now mymod_ffn:MLP"]
    assert "target was mymod:MLP, now mymod_ffn:MLP" in (tmp_path / "r.html").read_text()
    assert "1 layer(s) compared" in out


def test_k_selecting_a_deviating_check_is_a_mismatch_not_a_baseline_error(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    project(tmp_path, tiny, [{"name": "good", "model": str(tiny["llama"]), "layers": [0]},
                             {"name": "bad", "model": str(tiny["llama"]), "layers": [0]}])
    assert run_main(capsys, "check", "--update-baseline")[0] == 0
    project(tmp_path, tiny, [{"name": "good", "model": str(tiny["llama"]), "layers": [0]},
                             {"name": "bad", "model": str(tiny["llama"]), "layers": [0],
                              "target": "tests.mutants:SwappedSwiGLU"}])
    monkeypatch.syspath_prepend(str(ROOT))
    code, out, err = run_main(capsys, "check", "-k", "bad", "--junit", "r.xml")
    assert code == 1, err
    assert "matches none" not in err and "Failing: bad." in out
    assert ET.parse(tmp_path / "r.xml").getroot().get("errors") == "0"


def test_missing_baseline_says_how_to_create_it(tiny, tmp_path, capsys):
    code, _, err = run_main(capsys, tiny["gpt2"], "--layer", "0", "--baseline", tmp_path / "none.json")
    assert code == 2 and "baseline file not found; create it with --update-baseline" in err


def test_multi_check_sections_are_headed_by_the_check_name(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))
    project(tmp_path, tiny, [{"name": "first-ffn", "model": str(tiny["gpt2"]), "layers": [0]},
                             {"name": "second-ffn", "model": str(tiny["llama"]), "layers": [0],
                              "target": "tests.mutants:SwappedSwiGLU"}])
    (tmp_path / "parity.toml").write_text((tmp_path / "parity.toml").read_text().replace(
        'baseline = "baseline.json"\n', ""))
    code, out, _ = run_main(capsys, "check")
    assert code == 1
    assert f"parity: first-ffn ({tiny['gpt2']})" in out and f"parity: second-ffn ({tiny['llama']})" in out
    code, out, _ = run_main(capsys, "check", "-q")
    assert code == 1 and out.strip().endswith("Failing: second-ffn.")


# -- pytest: a skip for synthetic weights, parity's frames hidden, a short first line ----------------

PYTEST_FILE = """
from parity.testing import assert_parity
from parity.ffn import FeedForward


def exact_gelu(config):
    return FeedForward(config.n_embd, dropout=0.0, activation="gelu")


def test_api():
    assert_parity("gpt2", layers=[0])


def test_fixture(parity_check):
    parity_check("gpt2", layers=[0])


def test_synthetic_asked_for():
    assert_parity("gpt2", layers=[0], require_real=False)


def test_setup_error():
    assert_parity("gpt2", layers=[0], target=lambda d_model, d_ff: None, require_real=False)


def test_mismatch():
    assert_parity(CHECKPOINT, layers=[1], target=exact_gelu)
"""


@pytest.fixture
def inner_tests(pytester, tiny):
    pytester.makepyfile(test_inner=PYTEST_FILE.replace("CHECKPOINT", repr(str(tiny["gpt2"]))))
    yield pytester
    from parity.pytest_plugin import REQUIRE_REAL

    REQUIRE_REAL["on"] = False


def test_pytest_skips_synthetic_weights_unless_asked(inner_tests, monkeypatch):
    monkeypatch.delenv("PARITY_REQUIRE_REAL", raising=False)
    result = inner_tests.runpytest("-rs", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, skipped=2, failed=2)
    result.stdout.fnmatch_lines(["SKIPPED*synthetic weights only*require_real=False*"])
    for option, env in ((["--parity-require-real"], None), ([], "1")):
        if env:
            monkeypatch.setenv("PARITY_REQUIRE_REAL", env)
        result = inner_tests.runpytest("-p", "no:cacheprovider", *option)
        result.assert_outcomes(passed=1, failed=4)


def test_pytest_failures_show_the_verdict_not_parity_frames(inner_tests, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    for variable in ("CI", "BUILD_NUMBER"):  # on CI pytest prints the whole line: the 80-column cut is a terminal's
        monkeypatch.delenv(variable, raising=False)
    result = inner_tests.runpytest("-rf", "-p", "no:cacheprovider", "--tb=long")
    text = result.stdout.str()
    assert "parity/api.py" not in text and "parity/engine" not in text and "LlamaConfig" not in text
    summary = [line for line in text.splitlines() if line.startswith("FAILED")]
    assert any(line.startswith("FAILED test_inner.py::test_setup_error - TargetError:") for line in summary)
    mismatch = next(line for line in summary if "test_mismatch" in line)
    assert "gelu_exact_instead_of_tanh at gpt2[1]" in mismatch and len(mismatch) <= 80
    assert str(Path(sys.prefix)) not in mismatch


def test_bfloat16_caveat_is_a_parity_warning(tiny):
    from parity.ffn import FeedForward
    from parity.testing import ParityWarning, assert_parity

    with pytest.warns(ParityWarning, match="Not checked at bfloat16: gelu_exact_instead_of_tanh"):
        assert_parity(str(tiny["gpt2"]), layers=[0], dtype="bfloat16",
                      target=lambda config: FeedForward(config.n_embd, dropout=0.0, activation="gelu"))


# -- tests that pass wherever a person runs them ----------------------------------------------------

@pytest.mark.slow
def test_the_suite_needs_no_parity_on_path(tmp_path):
    """`venv/bin/python -m pytest` without the venv's bin on PATH: the CLI tests collect and find the command."""
    env = {**os.environ, "PATH": str(tmp_path)}  # an empty folder: no `parity`, no other tool
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "tests/test_cli.py", "tests/test_html.py", "tests/test_hostile.py"],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "error" not in out.stdout.lower().split("\n")[-2]


def test_no_test_finds_the_command_on_path():
    looked_up = "which(" + '"parity")'
    for path in sorted(Path(__file__).parent.glob("*.py")):
        assert looked_up not in path.read_text().replace("'", '"'), path.name


@pytest.mark.slow
def test_sigint_reaches_a_child_started_while_sigint_is_ignored(tmp_path):
    """As from `nohup` or a background job: the test process ignores SIGINT, the child must still get it."""
    script = textwrap.dedent("""
        import signal, subprocess, sys, time
        sys.path.insert(0, sys.argv[1])
        from tests.support import default_sigint
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        child = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                                 stdout=subprocess.PIPE, preexec_fn=default_sigint)
        child.stdout.readline()
        child.send_signal(signal.SIGINT)
        print(child.wait(timeout=30))
    """)
    out = subprocess.run([sys.executable, "-c", script, str(ROOT)], capture_output=True, text=True, timeout=120)
    # KeyboardInterrupt: Python exits by SIGINT (-2) once the handler ran, instead of sleeping 60 s (a timeout)
    assert out.stdout.strip() in ("-2", "1"), out.stderr
