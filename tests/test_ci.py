"""CI-facing features: JUnit, --quiet, JSON suite, project file, --shard, baselines."""

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace

import pytest

from parity import cli
from parity.definitions.datafiles import builtin_mapping_dir
from parity.definitions.project import load_project
from parity.definitions.run_selection import parse_shard, shard_units
from parity.engine.results import SCHEMA_VERSION
from parity.errors import BaselineError, ProjectConfigError, ShardError
from parity.outputs.baseline import compare, entry_key, load_baseline
from parity.outputs.junit import build_junit

from .builders import layer_result, report_with
from .support import ROOT, run_main

# -- JUnit ---------------------------------------------------------------------------------------

def test_junit_mismatch_has_suite_case_failure_structure(tiny, tmp_path, capsys):
    path = tmp_path / "junit.xml"
    code, _, _ = run_main(capsys, tiny["llama"], "--layers", "0,2", "--target", "tests.mutants:SwappedSwiGLU",
                          "--junit", path)
    assert code == 1
    root = ET.parse(path).getroot()
    assert root.tag == "testsuites" and root.get("tests") == "2" and root.get("failures") == "2"
    (suite,) = root.findall("testsuite")
    assert suite.get("tests") == "2" and suite.get("failures") == "2" and suite.get("errors") == "0"
    cases = suite.findall("testcase")
    assert [c.get("name") for c in cases] == ["layer 0", "layer 2"]
    for case in cases:
        assert float(case.get("time")) >= 0 and case.get("classname")
        failure = case.find("failure")
        assert failure is not None and "tolerance" in failure.get("message") and "MISMATCH" in failure.text


def test_junit_pass_has_no_failure(tiny, tmp_path, capsys):
    path = tmp_path / "junit.xml"
    assert run_main(capsys, tiny["gpt2"], "--layer", "1", "--junit", path)[0] == 0
    root = ET.parse(path).getroot()
    assert root.get("failures") == "0" and root.find(".//failure") is None
    assert [c.get("name") for c in root.iter("testcase")] == ["layer 1"]
    props = {p.get("name"): p.get("value") for p in root.iter("property")}
    assert props["reference_activation"] == "gelu_new" and props["weights"] == "real"


def test_junit_carries_diagnosis_expert_and_errors():
    diagnosed = layer_result(0, passed=False, max_abs=1e-3, diagnosis={
        "id": "exact_gelu", "message": "uses the exact erf GELU", "distance": 1e-9, "reference_distance": 9e-4})
    expert = layer_result(1)
    expert.expert = 3
    runs = [SimpleNamespace(label="gpt2", report=report_with(diagnosed, expert), error=None, seconds=[0.5, 0.25]),
            SimpleNamespace(label="broken", report=None, error="parity.toml: checks[1]: no such folder", seconds=[])]
    root = ET.fromstring(ET.tostring(build_junit(runs)))
    assert root.get("tests") == "3" and root.get("failures") == "1" and root.get("errors") == "1"
    failure = root.find(".//failure")
    assert "exact_gelu" in failure.get("message") and "9.00e-04" in failure.get("message")
    assert [c.get("name") for c in root.iter("testcase")] == ["layer 0", "layer 1 expert 3", "set-up"]
    assert "no such folder" in root.find(".//error").get("message")


# -- --quiet, JSON -------------------------------------------------------------------------------

def test_quiet_prints_only_the_summary_and_silences_downloads(tiny, capsys):
    from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars

    try:
        code, out, err = run_main(capsys, tiny["gpt2"], "--layers", "0-1", "--quiet")
        assert code == 0
        assert out.splitlines() == ["PASS: 2 layer(s) match transformers within tolerance."]
        assert are_progress_bars_disabled()
    finally:
        enable_progress_bars()


# -- project file ---------------------------------------------------------------------------------

def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_project_from_pyproject_and_parity_toml_wins(tmp_path):
    write(tmp_path / "pyproject.toml",
          '[project]\nname = "x"\n[[tool.parity.checks]]\nmodel = "gpt2"\nlayers = [0, 11]\n')
    project = load_project(cwd=tmp_path)
    assert project.path.name == "pyproject.toml"
    assert [(c.model, c.layers) for c in project.checks] == [("gpt2", [0, 11])]
    write(tmp_path / "parity.toml", '[defaults]\nseed = 3\n[[checks]]\nmodel = "llama"\natol = 1e-4\n')
    project = load_project(cwd=tmp_path)
    assert project.path.name == "parity.toml" and project.checks[0].seed == 3 and project.checks[0].atol == 1e-4


@pytest.mark.parametrize("text, message", [
    ('[[checks]]\nlayers = [0]\n', "checks[0]: 'model' is required"),
    ('[[checks]]\nmodel = "gpt2"\n[[checks]]\nmodel = "llama"\nlayer = 1\nlayers = [2]\n',
     "checks[1] (model 'llama'): give 'layer'"),
    ('[[checks]]\nmodel = "gpt2"\nlayrs = [0]\n', "unknown key 'layrs'"),
    ('[[checks]]\nmodel = "gpt2"\natol = -1\n', "'atol' must be a positive finite number"),
    ('[[checks]]\nmodel = "gpt2"\nlayers = [true]\n', "'layers' must be"),
    ('checks = []\n', "non-empty array"),
    ('[[checks]\n', "invalid TOML"),
])
def test_bad_project_entry_names_file_and_entry(tmp_path, text, message):
    write(tmp_path / "parity.toml", text)
    with pytest.raises(ProjectConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")) as info:
        load_project(cwd=tmp_path)
    assert "parity.toml" in str(info.value)


def test_no_project_file_is_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_main(capsys, "check")
    assert code == 2 and "[tool.parity]" in err and "Traceback" not in err


def test_check_runs_every_entry_with_one_summary_and_continues_past_errors(tiny, tmp_path, monkeypatch, capsys):
    write(tmp_path / "parity.toml", f'''
[[checks]]
model = "{tiny['gpt2']}"
layers = "0-1"
[[checks]]
name = "swapped llama"
model = "{tiny['llama']}"
layers = [1]
target = "tests.mutants:SwappedSwiGLU"
[[checks]]
model = "/no/such/folder"
''')
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))
    code, out, err = run_main(capsys, "check", "--json", tmp_path / "r.json", "--junit", tmp_path / "j.xml")
    assert code == 2  # a check that cannot run outranks a mismatch
    assert "parity.toml: checks[2]" in err and "no such file or folder" in err
    assert out.strip().splitlines()[-1].startswith("ERROR: 3 check(s), 3 layer(s) checked; 1 deviate")
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["kind"] == "suite" and data["passed"] is False and data["schema_version"] == SCHEMA_VERSION
    assert [c["name"] for c in data["checks"]][1] == "swapped llama"
    assert data["checks"][0]["report"]["passed"] is True and data["checks"][1]["report"]["passed"] is False
    assert data["checks"][2]["report"] is None and "no such file" in data["checks"][2]["error"]
    root = ET.parse(tmp_path / "j.xml").getroot()
    assert (root.get("tests"), root.get("failures"), root.get("errors")) == ("4", "1", "1")


def test_model_argument_still_works_beside_subcommands(tiny, capsys):
    assert run_main(capsys, tiny["gpt2"], "--layer", "0")[0] == 0
    assert run_main(capsys, "list")[0] == 0


# -- --shard ----------------------------------------------------------------------------------------

def test_shards_partition_units_deterministically():
    units = [(check, layer) for check, n in enumerate([12, 3, 1]) for layer in range(n)]
    shards = [shard_units(units, (k, 4)) for k in range(1, 5)]
    assert sorted(u for s in shards for u in s) == sorted(units)  # each unit exactly once
    assert max(map(len, shards)) - min(map(len, shards)) <= 1  # balanced
    assert shards == [shard_units(units, (k, 4)) for k in range(1, 5)]  # stable
    assert {layer for check, layer in shards[0] if check == 0} == {0, 4, 8}  # a large check is spread
    assert shard_units(units, None) == units
    assert parse_shard("2/4") == (2, 4)
    for bad in ("0/4", "5/4", "2", "a/b"):
        with pytest.raises(ShardError):
            parse_shard(bad)


def test_shard_jobs_together_run_each_layer_once(tiny, tmp_path, monkeypatch, capsys):
    write(tmp_path / "parity.toml", f'[[checks]]\nmodel = "{tiny["gpt2"]}"\n[[checks]]\nmodel = "{tiny["qwen2"]}"\n')
    monkeypatch.chdir(tmp_path)
    seen = []
    for k in (1, 2):
        code, out, _ = run_main(capsys, "check", "--shard", f"{k}/2", "--json", "-")
        assert code == 0
        data = json.loads(out)
        assert data["shard"] == [k, 2]
        seen += [(c["name"], layer["layer"]) for c in data["checks"] if c["report"] for layer in c["report"]["layers"]]
    assert sorted(seen) == sorted([(str(tiny["gpt2"]), i) for i in range(3)]
                                  + [(str(tiny["qwen2"]), i) for i in range(2)])
    assert run_main(capsys, "check", "--shard", "3/2")[0] == 2


# -- baseline ----------------------------------------------------------------------------------------

def test_baseline_compare_rules():
    base = {entry_key(report_with(layer_result(0)), layer_result(0)): {"max_abs_diff": 1e-9, "passed": True},
            entry_key(report_with(layer_result(1)), layer_result(1)): {"max_abs_diff": 1e-6, "passed": True},
            entry_key(report_with(layer_result(2)), layer_result(2)): {"max_abs_diff": 1e-7, "passed": True}}
    noise = report_with(layer_result(0, max_abs=3e-9), layer_result(1, max_abs=1.9e-6), layer_result(2, max_abs=1e-7))
    assert compare([noise], base) == ([], 3)  # 1e-9 -> 3e-9 is under the absolute slack; 1.9x under 2x
    grown = report_with(layer_result(0, max_abs=3e-9), layer_result(1, max_abs=2.5e-6),
                        layer_result(2, passed=False, max_abs=1.5e-7), layer_result(5, max_abs=1.0))
    regressions, compared = compare([grown], base)
    assert compared == 3  # layer 5 has no entry: new, not a regression
    assert [r.layer.layer for r in regressions] == [1, 2]
    assert "2.5x" in regressions[0].message and "fails now" in regressions[1].message
    assert compare([grown], base, factor=3.0)[0][0].layer.layer == 2


def test_baseline_update_then_compare_cli(tiny, tmp_path, capsys):
    baseline = tmp_path / "baseline.json"
    code, _, err = run_main(capsys, tiny["gpt2"], "--baseline", baseline)
    assert code == 2 and "create it with --update-baseline" in err  # not created yet: says how
    code, out, _ = run_main(capsys, tiny["gpt2"], "--baseline", baseline, "--update-baseline")
    assert code == 0 and "wrote 3 layer entries" in out
    text = baseline.read_text()
    data = json.loads(text)
    assert text == json.dumps(data, indent=2, sort_keys=True) + "\n"  # sorted, indented: diff-friendly
    keys = list(data["entries"])
    assert len(keys) == 3 and keys[0].endswith("| parity.ffn:FeedForward | layer 0000")
    assert run_main(capsys, tiny["gpt2"], "--baseline", baseline)[0] == 0
    for entry in data["entries"].values():  # pretend the stored run was 10x closer
        entry["max_abs_diff"] /= 10
    baseline.write_text(json.dumps(data))
    code, out, _ = run_main(capsys, tiny["gpt2"], "--baseline", baseline, "--json", tmp_path / "r.json",
                            "--junit", tmp_path / "j.xml")
    assert code == 1 and out.count("baseline: ") >= 3 and "grew" in out
    assert len(json.loads((tmp_path / "r.json").read_text())["baseline"]["regressions"]) == 3
    failure = ET.parse(tmp_path / "j.xml").getroot().find(".//failure")
    assert failure.get("type") == "BaselineRegression" and "grew" in failure.get("message")
    assert run_main(capsys, tiny["gpt2"], "--baseline", baseline, "--baseline-factor", "20")[0] == 0


def test_bad_baseline_file_is_exit_2(tiny, tmp_path, capsys):
    bad = write(tmp_path / "b.json", '{"not": "a baseline"}')
    code, _, err = run_main(capsys, tiny["gpt2"], "--baseline", bad)
    assert code == 2 and "not a parity baseline" in err
    with pytest.raises(BaselineError):
        load_baseline(bad)
    assert run_main(capsys, tiny["gpt2"], "--update-baseline")[0] == 2


# -- light commands -------------------------------------------------------------------------------------

@pytest.mark.slow  # a fresh interpreter: what `parity check --help` imports
def test_subcommand_help_is_light():
    code = ("import sys, contextlib, io, parity.cli as c\n"
            "for argv in (['check', '--help'], ['inspect', '--help'], ['--help']):\n"
            "    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):\n"
            "        c.main(argv)\n"
            "    assert 'usage' in out.getvalue(), argv\n"
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert probe.stdout.strip() == "False False", probe.stderr


# -- layers whose module cannot even be loaded (shape mismatch: no metrics) ----------------------

def test_shape_failure_reaches_junit_and_baseline_as_a_failure(tiny, tmp_path, capsys):
    junit, baseline = tmp_path / "junit.xml", tmp_path / "base.json"
    args = [tiny["llama"], "--layer", "1", "--target", "tests.mutants:llama_four_d"]
    code, _, err = run_main(capsys, *args, "--junit", junit, "--baseline", baseline, "--update-baseline")
    assert code == 1 and "internal error" not in err
    failure = ET.parse(junit).getroot().find(".//failure")
    assert failure is not None and "intermediate_size_mismatch" in failure.get("message")
    assert json.loads(baseline.read_text())["entries"].popitem()[1]["max_abs_diff"] is None
    code, _, err = run_main(capsys, *args, "--baseline", baseline)
    assert code == 1 and "internal error" not in err


def test_passing_layer_that_now_cannot_load_is_a_regression(tiny, tmp_path, capsys):
    baseline, mapping = tmp_path / "base.json", tmp_path / "llama.toml"
    text = (builtin_mapping_dir() / "llama.toml").read_text()
    mapping.write_text(text.replace('hidden_dim = "config.intermediate_size", ', ""))  # the module falls back to 4d
    assert run_main(capsys, tiny["llama"], "--layer", "0", "--baseline", baseline, "--update-baseline")[0] == 0
    code, out, _ = run_main(capsys, tiny["llama"], "--layer", "0", "--mapping", mapping, "--baseline", baseline)
    assert code == 1 and "passed in the baseline, fails now" in out and "cannot be loaded" in out


def test_mapping_target_class_imported_from_the_working_directory(tiny, tmp_path, capsys, monkeypatch):
    (tmp_path / "mymodel_for_parity.py").write_text((Path(__file__).parent / "mutants.py").read_text())
    text = (builtin_mapping_dir() / "gpt2.toml").read_text()
    mapping = tmp_path / "m.toml"
    mapping.write_text(text.replace("parity.ffn:FeedForward", "mymodel_for_parity:gpt2_exact_gelu_module"))
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(capsys, tiny["gpt2"], "--layer", "0", "--mapping", mapping)
    assert code == 1 and "gelu_exact_instead_of_tanh" in out, err  # the module loaded and was diagnosed


@pytest.mark.parametrize("atol", ["0", "-1", "nan"])
def test_atol_must_be_positive(tiny, atol, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main([str(tiny["gpt2"]), "--atol", atol])
    assert info.value.code == 2 and "positive" in capsys.readouterr().err
