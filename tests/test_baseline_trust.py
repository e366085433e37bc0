"""Baselines a CI runner can trust: keys that follow the repository (not the folder it was
cloned into), entries tied to the weights they were made from, a baseline that matches
nothing is an error, validated factor and slack, and outputs written atomically.

Every case goes through parity.cli.main in this process (the same code as the `parity` executable,
without the import cost); the end-to-end cases run it in a project folder (the working directory), as CI does.
"""

from __future__ import annotations

import json
import os
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from parity import cli
from parity.cli.options import build_parser
from parity.errors import BaselineError, ParityError
from parity.outputs import atomic
from parity.outputs.baseline import BASELINE_VERSION, load_baseline, load_for_update

from .conftest import build_model, save
from .support import run_main, run_parity

LAYERS = 5  # gpt2 layers 0-1 + llama layers 0-2 in the project below


def in_folder(monkeypatch, capsys, cwd: Path, *args) -> tuple[int, str, str]:
    """`parity ARGS...` run from ``cwd`` (a project folder, as CI runs it): (exit code, stdout, stderr)."""
    monkeypatch.chdir(cwd)
    return run_main(capsys, *args)


@pytest.fixture()
def repo(tiny, tmp_path) -> Path:
    """A project as it sits in a repository: checkpoints and baseline named relative to parity.toml."""
    root = tmp_path / "repo"
    shutil.copytree(tiny["gpt2"], root / "models" / "gpt2")
    shutil.copytree(tiny["llama"], root / "models" / "llama")
    (root / "parity.toml").write_text(
        'baseline = "parity-baseline.json"\n'
        '[[checks]]\nmodel = "models/gpt2"\nlayers = "0-1"\n'  # MODEL is a local path
        '[[checks]]\nmodel = "llama"\ncheckpoint = "models/llama"\n')  # a mapping name and a local checkpoint
    return root


def baseline_of(folder: Path) -> dict:
    return json.loads((folder / "parity-baseline.json").read_text())


def edit_baseline(folder: Path, edit) -> None:
    data = baseline_of(folder)
    for entry in data["entries"].values():
        edit(entry)
    (folder / "parity-baseline.json").write_text(json.dumps(data))


# -- keys follow the repository ------------------------------------------------------------------

def test_copied_repository_matches_its_baseline_and_a_regression_fails(repo, tmp_path, monkeypatch, capsys):
    code, _, err = in_folder(monkeypatch, capsys, repo, "check", "--update-baseline")
    assert code == 0, err
    text = (repo / "parity-baseline.json").read_text()
    assert str(tmp_path) not in text and str(tmp_path.resolve()) not in text  # no absolute path in any key
    data = json.loads(text)
    assert data["parity_baseline"] == BASELINE_VERSION
    keys = sorted(data["entries"])
    assert len(keys) == LAYERS
    assert keys[0] == "llama | models/llama | parity.ffn:SwiGLU | layer 0000", keys
    assert keys[-1].startswith("models/gpt2 | models/gpt2 | ")
    for entry in data["entries"].values():
        assert isinstance(entry["fingerprint"], str) and entry["fingerprint"] and entry["weights"] == "real"

    clone = tmp_path / "ci-runner" / "work" / "clone"  # what every CI runner does: the same tree elsewhere
    shutil.copytree(repo, clone)
    code, out, err = in_folder(monkeypatch, capsys, clone, "check", "--json", "report.json")
    assert code == 0, out + err
    assert f"{LAYERS} layer(s) compared" in out
    assert json.loads((clone / "report.json").read_text())["baseline"]["not_compared"] == []

    edit_baseline(clone, lambda entry: entry.update(max_abs_diff=entry["max_abs_diff"] * 0.1))
    code, out, err = in_folder(monkeypatch, capsys, clone, "check", "--baseline-slack", "0", "--json", "report.json")
    assert code == 1, out + err
    assert "baseline: models/gpt2 | models/gpt2 | parity.ffn:FeedForward | layer 0000: max|Δ| grew" in out
    regressions = json.loads((clone / "report.json").read_text())["baseline"]["regressions"]
    assert len(regressions) == LAYERS and all("(10x;" in r["message"] for r in regressions)  # 4 digits


def test_single_check_keys_are_relative_to_the_working_directory(tiny, tmp_path, monkeypatch, capsys):
    shutil.copytree(tiny["gpt2"], tmp_path / "ckpt")
    monkeypatch.chdir(tmp_path)
    assert run_main(capsys, "gpt2", "--checkpoint", tmp_path / "ckpt", "--layer", "0", "--baseline", "b.json",
                    "--update-baseline")[0] == 0
    assert list(json.loads(Path("b.json").read_text())["entries"]) == [
        "gpt2 | ckpt | parity.ffn:FeedForward | layer 0000"]
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    shutil.copytree(tiny["gpt2"], outside / "deep" / "tiny-gpt2")  # neither under the working directory: its name only
    assert run_main(capsys, outside / "deep" / "tiny-gpt2", "--layer", "0", "--baseline", "c.json",
                    "--update-baseline")[0] == 0
    assert list(json.loads(Path("c.json").read_text())["entries"]) == [
        "tiny-gpt2 | tiny-gpt2 | parity.ffn:FeedForward | layer 0000"]


# -- the baseline must describe these weights ------------------------------------------------------

def test_baseline_made_from_other_weights_is_reported_not_compared(repo, monkeypatch, capsys):
    assert in_folder(monkeypatch, capsys, repo, "check", "--update-baseline")[0] == 0
    shutil.rmtree(repo / "models" / "gpt2")
    save(build_model("gpt2", seed=99), repo / "models" / "gpt2")  # same path, same shapes, other values
    code, out, err = in_folder(monkeypatch, capsys, repo, "check", "--json", "report.json", "--junit", "junit.xml")
    assert code == 2, out + err
    assert "baseline entry made from other weights (fingerprint " in out
    assert "does not describe these weights" in err and "regenerate it with --update-baseline" in err
    data = json.loads((repo / "report.json").read_text())
    assert data["passed"] is False and data["baseline"]["error"]
    assert sorted(r["layer"] for r in data["baseline"]["other_weights"]) == [0, 1]  # gpt2's layers; llama compared
    assert data["baseline"]["compared"] == 3
    failures = [f.get("type") for f in ET.parse(repo / "junit.xml").getroot().iter("failure")]
    assert failures == ["BaselineOtherWeights"] * 2


def test_old_format_baseline_is_compared_with_a_note_then_upgraded(repo, monkeypatch, capsys):
    monkeypatch.chdir(repo)
    assert run_main(capsys, "check", "--update-baseline")[0] == 0
    data = baseline_of(repo)
    data["parity_baseline"] = 1
    for entry in data["entries"].values():
        del entry["fingerprint"], entry["weights"]
    data["entries"]["/home/someone/models/gpt2 | /home/someone/models/gpt2 | x:Y | layer 0000"] = {"max_abs_diff": 1e-7}
    (repo / "parity-baseline.json").write_text(json.dumps(data))
    code, out, _ = run_main(capsys, "check")
    assert code == 0 and f"{LAYERS} entries have no weight fingerprint (a format-1 baseline" in out
    code, out, _ = run_main(capsys, "check", "--update-baseline")
    assert code == 0 and f"dropped {LAYERS + 1} entries of the old format" in out
    upgraded = baseline_of(repo)
    assert upgraded["parity_baseline"] == BASELINE_VERSION and len(upgraded["entries"]) == LAYERS
    assert all(entry["fingerprint"] for entry in upgraded["entries"].values())


# -- matching nothing, matching part -------------------------------------------------------------

def test_baseline_matching_none_of_the_layers_is_exit_2(tiny, tmp_path, monkeypatch, capsys):
    baseline = tmp_path / "b.json"
    code, _, err = in_folder(monkeypatch, capsys, tmp_path, tiny["gpt2"], "--layer", "0", "--baseline", baseline,
                             "--update-baseline")
    assert code == 0, err
    code, out, err = in_folder(monkeypatch, capsys, tmp_path, tiny["llama"], "--layer", "0", "--baseline",
                               baseline)  # a baseline of another model
    assert code == 2, out + err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"parity: error: baseline {baseline} matches none of this run's 1 layer(s)")
    assert "| layer 0000'" in last and "the file holds 1 entry: 'gpt2 |" in last
    assert "regenerate it with --update-baseline" in last


def test_partial_match_lists_the_layers_not_compared(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert run_main(capsys, tiny["gpt2"], "--layer", "1", "--baseline", "b.json", "--update-baseline")[0] == 0
    code, out, _ = run_main(capsys, tiny["gpt2"], "--baseline", "b.json", "--json", "r.json", "--quiet")
    assert code == 0
    assert "baseline: 2 layer(s) not compared (no entry in b.json): " in out and "layer 0002'" in out
    baseline = json.loads(Path("r.json").read_text())["baseline"]
    assert baseline["compared"] == 1 and baseline["error"] is None
    assert [key[-4:] for key in baseline["not_compared"]] == ["0000", "0002"]


# -- factor and slack --------------------------------------------------------------------------------

@pytest.mark.parametrize("option, value", [("--baseline-factor", "nan"), ("--baseline-factor", "inf"),
                                           ("--baseline-factor", "-1"), ("--baseline-factor", "0.5"),
                                           ("--baseline-slack", "nan"), ("--baseline-slack", "inf"),
                                           ("--baseline-slack", "-1e-9"), ("--baseline-slack", "x")])
def test_bad_factor_or_slack_on_the_command_line_is_a_usage_error(tmp_path, option, value, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["check", "--baseline", str(tmp_path / "b.json"), f"{option}={value}"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and f"argument {option}: " in err, err


@pytest.mark.slow  # the real executable: argument parsing ends the process before any import of torch
def test_bad_factor_in_the_executable_is_exit_2_before_any_work(tiny, tmp_path):
    run = run_parity(tiny["gpt2"], "--baseline", tmp_path / "b.json", "--baseline-factor", "nan", cwd=tmp_path)
    assert run.returncode == 2 and "argument --baseline-factor: must be a finite number, not nan" in run.stderr


@pytest.mark.parametrize("key, value", [("baseline_factor", "nan"), ("baseline_factor", "inf"),
                                        ("baseline_factor", "-2.0"), ("baseline_factor", "0.9"),
                                        ("baseline_slack", "nan"), ("baseline_slack", "-inf"),
                                        ("baseline_slack", "-1e-9")])
def test_bad_factor_or_slack_in_the_project_file_is_exit_2(tmp_path, monkeypatch, capsys, key, value):
    (tmp_path / "parity.toml").write_text(f'{key} = {value}\n[[checks]]\nmodel = "gpt2"\n')
    monkeypatch.chdir(tmp_path)
    code, _, err = run_main(capsys, "check")
    assert code == 2 and f"parity.toml: '{key}' must be" in err, err


def test_limits_themselves_are_accepted(tmp_path):
    from parity.definitions.project import load_project

    (tmp_path / "parity.toml").write_text('baseline_factor = 1\nbaseline_slack = 0\n[[checks]]\nmodel = "gpt2"\n')
    project = load_project(cwd=tmp_path)
    assert (project.baseline_factor, project.baseline_slack) == (1.0, 0.0)
    assert build_parser().parse_args(["m", "--baseline-factor", "1", "--baseline-slack", "0"]).baseline_factor == 1.0


# -- broken baseline files ---------------------------------------------------------------------------

def test_update_onto_a_file_that_is_not_a_baseline_refuses_to_overwrite_it(tiny, tmp_path, capsys):
    garbage = tmp_path / "package.json"
    garbage.write_text('{"name": "my-app", "version": "1.0.0"}\n')
    code, out, err = run_main(capsys, tiny["gpt2"], "--baseline", garbage, "--update-baseline")
    assert code == 2 and "exists but is not a parity baseline" in err and "will not overwrite it" in err
    assert "regenerate" not in err and out == ""  # refused before any layer was computed
    assert garbage.read_text() == '{"name": "my-app", "version": "1.0.0"}\n'


NOT_OURS = "will not overwrite it"


@pytest.mark.parametrize("text, message, on_update", [
    ('{"parity_baseline": 2, "entries": {"k | c | t | layer 0000": {"passed": true}}}',
     "entry 'k | c | t | layer 0000' has no 'max_abs_diff'", NOT_OURS),
    ('{"parity_baseline": 2, "entries": {"k": {"max_abs_diff": NaN}}}', "not a finite number or null", NOT_OURS),
    ('{"parity_baseline": 2, "entries": {"k": {"max_abs_diff": 1e-7, "passed": "yes"}}}', "'passed' is 'yes'",
     NOT_OURS),
    ('{"parity_baseline": 9, "entries": {}}', "written by a newer parity", "upgrade parity"),
    ('{"entries": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply", NOT_OURS),
])
def test_broken_baseline_is_a_clear_error_never_a_crash(tiny, tmp_path, capsys, text, message, on_update):
    path = tmp_path / "b.json"
    path.write_text(text)
    with pytest.raises(BaselineError, match=message.replace("(", r"\(").replace("|", r"\|")):
        load_baseline(path)
    with pytest.raises(BaselineError, match=on_update):
        load_for_update(path)
    code, _, err = run_main(capsys, tiny["gpt2"], "--layer", "0", "--baseline", path)
    assert code == 2 and message in err and "internal error" not in err, err


# -- atomic writes -----------------------------------------------------------------------------------

def test_failed_baseline_write_keeps_the_old_file_and_leaves_no_temp(tiny, tmp_path, monkeypatch, capsys):
    baseline = tmp_path / "b.json"
    assert run_main(capsys, tiny["gpt2"], "--layer", "0", "--baseline", baseline, "--update-baseline")[0] == 0
    before = baseline.read_bytes()
    real_replace = os.replace

    def full_disk(src, dst):  # only the baseline's rename fails: nothing else in the run is disturbed
        if Path(dst) == baseline:
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "replace", full_disk)
    code, _, err = run_main(capsys, tiny["gpt2"], "--layers", "0-2", "--baseline", baseline, "--update-baseline")
    assert code == 2 and f"baseline {baseline}: cannot write the file (No space left on device)" in err, err
    assert baseline.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.json"]


@pytest.mark.parametrize("option", ["--json", "--junit"])
def test_failed_report_write_keeps_the_old_file_and_leaves_no_temp(tiny, tmp_path, monkeypatch, capsys, option):
    report = tmp_path / "report.out"
    report.write_text("previous run\n")
    monkeypatch.setattr(atomic.os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(5, "Input/output error")))
    code, _, err = run_main(capsys, tiny["gpt2"], "--layer", "0", option, report)
    assert code == 2 and f"{option} {report}: cannot write the file (Input/output error)" in err, err
    assert report.read_text() == "previous run\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.out"]


def test_write_interrupted_by_any_exception_leaves_no_temp(tmp_path, monkeypatch):
    target = tmp_path / "b.json"
    target.write_text("old")
    monkeypatch.setattr(atomic.os, "replace", lambda src, dst: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        atomic.write_output(target, "new", "baseline")
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["b.json"]


def test_atomic_write_replaces_content_and_keeps_permissions(tmp_path):
    target = tmp_path / "b.json"
    target.write_text("old")
    target.chmod(0o640)
    atomic.write_output(target, "new ✓\n", "baseline")
    assert target.read_text(encoding="utf-8") == "new ✓\n" and target.stat().st_mode & 0o777 == 0o640
    fresh = tmp_path / "sub" / "fresh.json"
    atomic.write_output(fresh, "x", "baseline")
    umask = os.umask(0)
    os.umask(umask)
    assert fresh.read_text() == "x" and fresh.stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's 0600


def test_junit_under_a_regular_file_is_exit_2_naming_the_file(tiny, tmp_path, capsys):
    blocker = tmp_path / "reports"
    blocker.write_text("a file, not a folder")
    code, _, err = run_main(capsys, tiny["gpt2"], "--layer", "0", "--junit", blocker / "junit.xml")
    assert code == 2 and (f"--junit {blocker / 'junit.xml'}: {blocker} is a file, not a folder; choose a path in a "
                          "folder you can write to (checked before computing anything)") in err, err
    assert "Traceback" not in err and blocker.read_text() == "a file, not a folder"
    with pytest.raises(ParityError, match="--json"):
        atomic.write_output(blocker / "r.json", "{}", "--json")


# -- the rules themselves (no model run) -----------------------------------------------------------

def test_compare_rules_for_fingerprints_hub_keys_and_unreadable_numbers(tmp_path):
    from parity.outputs.baseline import compare_baseline, entry_key, problem_message, write_baseline

    from .builders import layer_result, report_with

    report = report_with(layer_result(0, fingerprint="aaaa"), layer_result(1, fingerprint="bbbb"),
                         layer_result(2, fingerprint="cccc"), model="owner/name")
    report.checkpoint = "owner/name@v1.0"  # a hub checkpoint: named as asked, the fingerprint pins the weights
    keys = [entry_key(report, layer) for layer in report.layers]
    assert keys[0] == "owner/name | owner/name@v1.0 | pkg:FFN | layer 0000"
    entries = {keys[0]: {"max_abs_diff": 1e-9, "fingerprint": "aaaa"},
               keys[1]: {"max_abs_diff": 1e-9, "fingerprint": "zzzz"},
               keys[2]: {"max_abs_diff": 1e-9}}
    result = compare_baseline([report], entries)
    assert result.compared == 2 and result.unfingerprinted == 1 and result.regressions == []
    assert [r.layer.layer for r in result.other_weights] == [1]
    assert "fingerprint zzzz, now bbbb" in result.other_weights[0].message
    assert "does not describe these weights" in problem_message("b.json", result, entries)
    del entries[keys[1]]
    assert problem_message("b.json", compare_baseline([report], entries), entries) is None

    report.layers[0].max_abs_diff = float("nan")  # a module that outputs NaN: stored as null, still readable
    assert write_baseline(tmp_path / "b.json", [report]) == (3, 0)
    assert load_baseline(tmp_path / "b.json")[keys[0]]["max_abs_diff"] is None
