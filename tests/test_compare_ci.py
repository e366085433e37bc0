"""`parity compare` in CI: `--baseline` / `--update-baseline` (a check's baseline file and rules, keyed
`compare A | B | layer N` or `compare NAME | layer N`), and `[[compares]]` in project files, run by `parity check`
beside the `[[checks]]` with the same exit-code rule and validation errors naming the file and the field.
"""

from __future__ import annotations

import json
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace

import pytest
from safetensors.torch import load_file, save_file

from parity.definitions.project import CompareSpec, load_project
from parity.errors import ProjectConfigError

from .builders import tiny_stand_in, written_stand_in
from .conftest import TINY, build_model, save
from .gguf_files import Q, gguf_from_hf
from .support import offline_home, run_json, run_main

SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3)


@pytest.fixture(scope="module")
def sides(tmp_path_factory):
    """A tiny LLaMA (A), its faithful Q8_0 and Q4_0 GGUF exports, and a re-save with layer 1's down_proj doubled."""
    root = tmp_path_factory.mktemp("compare-ci")
    llama = build_model("llama", seed=41, **SIZES)
    a = save(llama, root / "a")
    state = load_file(a / "model.safetensors")
    state["model.layers.1.mlp.down_proj.weight"] = state["model.layers.1.mlp.down_proj.weight"] * 2
    broken = root / "broken"
    broken.mkdir()
    shutil.copy(a / "config.json", broken / "config.json")
    save_file({k: v.contiguous() for k, v in state.items()}, broken / "model.safetensors")
    return SimpleNamespace(root=root, a=a, q8=gguf_from_hf(llama, root / "b-q8.gguf", "llama", Q.Q8_0),
                           q4=gguf_from_hf(llama, root / "b-q4.gguf", "llama", Q.Q4_0), broken=broken)


@pytest.fixture
def here(sides, tmp_path, monkeypatch):
    """A working folder holding A (a symlink) and a copy of the Q8_0 export: baseline keys are relative to it."""
    (tmp_path / "a").symlink_to(sides.a)
    shutil.copy(sides.q8, tmp_path / "b.gguf")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def entries(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))["entries"]


# -- --baseline / --update-baseline ------------------------------------------------------------------------

def test_update_then_compare_against_the_baseline(here, capsys):
    code, out, err = run_main(capsys, "compare", "a", "b.gguf", "--baseline", "base.json", "--update-baseline")
    assert code == 0, err
    assert "baseline: wrote 3 layer entries to base.json" in out
    stored = entries(here / "base.json")
    assert sorted(stored) == [f"compare a | b.gguf | layer {i:04d}" for i in range(3)]  # portable: no tmp path
    for entry in stored.values():
        assert entry["passed"] and entry["max_abs_diff"] > 0 and entry["target"] is None
        assert entry["fingerprint"].startswith("crc32:")
    code, data, err = run_json(capsys, "compare", "a", "b.gguf", "--baseline", "base.json")
    assert code == 0, err
    assert data["status"] == "pass" and data["baseline"]["compared"] == 3 and data["baseline"]["regressions"] == []
    assert [layer["baseline"]["status"] for layer in data["layers"]] == ["ok"] * 3


def test_a_regression_is_a_failure_in_every_view(here, capsys):
    assert run_main(capsys, "compare", "a", "b.gguf", "--baseline", "base.json", "--update-baseline")[0] == 0
    stored = entries(here / "base.json")
    key = "compare a | b.gguf | layer 0002"
    stored[key]["max_abs_diff"] /= 10  # layer 2 "used to be" ten times closer to A
    (here / "base.json").write_text(json.dumps({"parity_baseline": 2, "entries": stored}))
    code, out, err = run_main(capsys, "compare", "a", "b.gguf", "--baseline", "base.json", "--json", "r.json",
                              "--junit", "r.xml", "--html", "r.html")
    assert code == 1, err
    assert "REGRESSED (baseline: max|Δ| grew" in out and f"baseline: {key}: max|Δ| grew" in out
    assert "FAIL: 1 of 3 layer(s) of B regressed against the baseline: layer 2" in out
    data = json.loads((here / "r.json").read_text())
    assert data["status"] == "regressed" and data["passed"] is False
    assert [layer["status"] for layer in data["layers"]] == ["pass", "pass", "regressed"]
    assert [r["key"] for r in data["baseline"]["regressions"]] == [key]
    cases = ET.parse(here / "r.xml").getroot().findall(".//testcase")
    assert [c.find("failure") is not None for c in cases] == [False, False, True]
    assert "REGRESSED" in (here / "r.html").read_text(encoding="utf-8")
    code, out, _ = run_main(capsys, "compare", "a", "b.gguf", "--baseline", "base.json", "--quiet")
    assert code == 1 and out.splitlines()[-1].startswith("FAIL: 1 of 3 layer(s) of B regressed")


def test_a_baseline_of_other_weights_is_exit_2(here, sides, capsys):
    """The fingerprint covers both sides: B replaced by another export at the same path is not compared."""
    assert run_main(capsys, "compare", "a", "b.gguf", "--baseline", "base.json", "--update-baseline")[0] == 0
    shutil.copy(sides.q4, here / "b.gguf")
    code, out, err = run_main(capsys, "compare", "a", "b.gguf", "--baseline", "base.json", "--layers", "0")
    assert code == 2 and "made from other weights" in out and "does not describe these weights" in err


def test_a_baseline_that_matches_nothing_and_a_missing_one_are_exit_2(here, capsys):
    assert run_main(capsys, "compare", "a", "b.gguf", "--baseline", "base.json", "--update-baseline",
                    "--layers", "0")[0] == 0
    shutil.copy(here / "b.gguf", here / "c.gguf")
    code, _, err = run_main(capsys, "compare", "a", "c.gguf", "--baseline", "base.json", "--layers", "0")
    assert code == 2 and "matches none of this run's 1 layer(s)" in err and "compare a | c.gguf | layer 0000" in err
    code, _, err = run_main(capsys, "compare", "a", "b.gguf", "--baseline", "nothing.json")
    assert code == 2 and "baseline file not found" in err and "Traceback" not in err
    code, _, err = run_main(capsys, "compare", "a", "b.gguf", "--update-baseline")
    assert code == 2 and "--update-baseline needs --baseline FILE" in err


# -- [[compares]] in a project file -----------------------------------------------------------------------

PROJECT = '''
baseline = "base.json"

[[checks]]
name = "dense a"
model = "a"
layers = [0]

[[compares]]
name = "q8 export"
a = "a"
b = "b.gguf"

[[compares]]
name = "broken resave"
a = "a"
b = "{broken}"
layers = "0-1"
'''


def test_parity_check_runs_compares_beside_checks_with_one_baseline(here, sides, capsys):
    (here / "parity.toml").write_text(PROJECT.format(broken=sides.broken))
    code, out, err = run_main(capsys, "check", "--update-baseline")
    assert code == 1, err  # the broken re-save's layer 1 differs
    assert f"parity compare q8 export: {here / 'a'} (A, the truth) against {here / 'b.gguf'} (B)" in out
    assert "MISMATCH — tensor_scaled" in out and "Failing: broken resave." in out
    stored = entries(here / "base.json")
    assert sum(k.startswith("compare q8 export | layer ") for k in stored) == 3
    assert sum(k.startswith("compare broken resave | layer ") for k in stored) == 2
    assert sum(not k.startswith("compare ") for k in stored) == 1  # the check's entry, in the same file
    code, data, err = run_json(capsys, "check", "-k", "q8 or not resave")
    assert code == 0, err
    assert [(c["name"], c["kind"]) for c in data["checks"]] == [("dense a", "check"), ("q8 export", "compare")]
    assert data["baseline"]["compared"] == 4 and data["baseline"]["error"] is None
    compare = data["checks"][1]["report"]
    assert compare["comparison"]["candidate"]["mapping"].endswith("'llama' map") and compare["name"] == "q8 export"


def test_a_regressed_compare_fails_parity_check_while_the_check_passes(here, capsys):
    (here / "parity.toml").write_text('baseline = "base.json"\n[[checks]]\nmodel = "a"\nlayers = [0]\n'
                                      '[[compares]]\nname = "q8"\na = "a"\nb = "b.gguf"\nlayers = [1]\n')
    assert run_main(capsys, "check", "--update-baseline", "-q")[0] == 0
    stored = entries(here / "base.json")
    stored["compare q8 | layer 0001"]["max_abs_diff"] /= 10
    (here / "base.json").write_text(json.dumps({"parity_baseline": 2, "entries": stored}))
    code, data, _ = run_json(capsys, "check")
    assert code == 1 and not data["passed"]
    check, compare = (c["report"] for c in data["checks"])
    assert check["status"] == "pass" and compare["status"] == "regressed"


def test_a_project_of_compares_only_and_nothing_compared_is_no_pass(here, capsys):
    (here / "parity.toml").write_text('[[compares]]\na = "a"\nb = "b.gguf"\nlayers = [2]\n')
    code, out, _ = run_main(capsys, "check", "-q")
    assert code == 0 and out.startswith("PASS: 0 check(s) and 1 compare(s), 1 layer(s) checked")
    code, out, _ = run_main(capsys, "check", "-q", "--shard", "2/2")  # the one unit is shard 1's
    assert code == 2 and "Nothing was compared, so this is not a pass." in out


def test_a_compare_that_cannot_run_is_exit_2_and_the_others_still_run(here, capsys):
    (here / "parity.toml").write_text('[[compares]]\na = "a"\nb = "missing.gguf"\n'
                                      '[[compares]]\na = "a"\nb = "b.gguf"\nlayers = [0]\n')
    code, out, err = run_main(capsys, "check", "-q")
    assert code == 2 and "parity.toml: compares[0]" in err and "missing.gguf" in err and "Traceback" not in err
    assert "1 layer(s) checked" in out and "1 could not run" in out


def test_project_compares_require_real_weights(tmp_path, monkeypatch, capsys, sides):
    """A mapping name offline with an empty cache is a synthetic stand-in: refused, unless require_real = false."""
    tiny_stand_in(monkeypatch, tmp_path, "llama", TINY["llama"] | {"architectures": ["LlamaForCausalLM"]})
    b = written_stand_in(capsys, tmp_path, "llama")  # a local copy of the stand-in: a real B
    monkeypatch.chdir(tmp_path)
    (tmp_path / "parity.toml").write_text(f'[[compares]]\na = "llama"\nb = "{b}"\nlayers = [0]\n')
    code, _, err = run_main(capsys, "check")
    assert code == 2 and "compares[0]" in err and "real weights are required" in err
    (tmp_path / "parity.toml").write_text(f'[[compares]]\na = "llama"\nb = "{b}"\nlayers = [0]\n'
                                          'require_real = false\n')
    code, out, err = run_main(capsys, "check", "-q")
    assert code == 0 and "SYNTHETIC" in out, err


def test_compare_entries_are_read_relative_to_the_project_file(here):
    (here / "sub").mkdir()
    (here / "sub" / "parity.toml").write_text('[defaults]\nseed = 3\nlayers = [1]\n'
                                              '[[compares]]\na = "../a"\nb = "../b.gguf"\nrevision_b = "v2"\n')
    (spec,) = load_project(cwd=here / "sub").checks
    assert isinstance(spec, CompareSpec) and Path(spec.a).resolve() == (here / "a").resolve()
    assert (spec.seed, spec.layers, spec.revision_b, spec.require_real) == (3, [1], "v2", True)
    assert spec.label == "compare " + spec.a + " " + spec.b


@pytest.mark.parametrize("text, message", [
    ('[[compares]]\na = "x"\n', "parity.toml: compares[0] ('x'): 'b' is required"),
    ('[[compares]]\nb = "y"\n', "compares[0] ('y'): 'a' is required"),
    ('[[compares]]\na = "x"\nb = "y"\nbaseline = "f.json"\n', "'baseline' is the project's, not a compare's"),
    ('[[compares]]\na = "x"\nb = "y"\nmodel = "gpt2"\n', "compares[0] ('x' and 'y'): unknown key 'model'"),
    ('compares = []\n', "'compares' must be a non-empty array of tables"),
    ('compares = ["x"]\n', "'compares' must be a non-empty array of tables"),
    ('[[compares]]\na = "x"\nb = "y"\nlayers = 1.5\n', "'layers' must be"),
    ('[[compares]]\na = "x"\nb = "y"\nrevision_b = ""\n', "'revision_b' must be a non-empty string"),
    ('[[compares]]\na = "x"\nb = "y"\nseed = "1"\n', "compares[0] ('x' and 'y'): 'seed' must be an integer"),
    ('[[compares]]\na = "x"\nb = 3\n', "'b' is required"),
    ('[[compares]]\na = "x"\nb = "y"\nallow_pickle = "yes"\n', "'allow_pickle' and 'require_real' must be"),
    ('[[compares]]\na = "x"\nb = "y"\nexperts = 1.5\n', "compares[0] ('x' and 'y'): 'experts' must be"),
    ('[[checks]]\nmodel = "gpt2"\n[[compares]]\na = "x"\nb = "y"\n[[compares]]\na = "x"\n', "compares[1]"),
    # one name twice: the two would share baseline keys (red team 4)
    ('[[compares]]\nname = "q8"\na = "x"\nb = "y"\n[[compares]]\nname = "q8"\na = "x"\nb = "z"\n',
     "compares[1]: name 'q8' is also compares[0]'s"),
    ('[[checks]]\nname = "q8"\nmodel = "gpt2"\n[[compares]]\nname = "q8"\na = "x"\nb = "y"\n',
     "compares[0]: name 'q8' is also checks[0]'s"),
    ('[[checks]]\nmodel = "gpt2"\nlayers = [0]\n[[checks]]\nmodel = "gpt2"\nlayers = [1]\n',
     "checks[1]: label (made from its fields: it has no name) 'gpt2' is also checks[0]'s"),
])
def test_a_bad_compare_entry_names_file_and_field(tmp_path, capsys, monkeypatch, text, message):
    (tmp_path / "parity.toml").write_text(text)
    with pytest.raises(ProjectConfigError) as info:
        load_project(cwd=tmp_path)
    assert message in str(info.value)
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(capsys, "check")
    assert code == 2 and message in err and "Traceback" not in err and out == ""


def test_a_bad_compare_entry_in_pyproject_names_the_table(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[tool.parity]\n[[tool.parity.compares]]\na = "x"\nb = "y"\nlayer = 0\n'
                                             'layers = [1]\n')
    with pytest.raises(ProjectConfigError, match=r"pyproject.toml: tool.parity.compares\[0\] \('x' and 'y'\): give "
                                                 "'layer' or 'layers'"):
        load_project(cwd=tmp_path)


def test_a_project_without_checks_or_compares_still_says_what_to_add(tmp_path):
    (tmp_path / "parity.toml").write_text('baseline = "b.json"\n')
    with pytest.raises(ProjectConfigError, match=r"'checks' must be a non-empty array .* unless the file lists "
                                                 r"\[\[compares\]\]"):
        load_project(cwd=tmp_path)


def test_the_check_baseline_keys_are_unchanged():
    """A compare's keys are its own: a check's report (no ``comparison``) keeps its key."""
    from parity.engine.results import LayerResult, Report
    from parity.outputs.baseline import entry_key

    report = Report(model="gpt2", checkpoint="gpt2", weights="real", mapping="gpt2", target="m:F", reference="r",
                    reference_activation="gelu", versions={}, seed=0)
    layer = LayerResult(layer=3, passed=True, max_abs_diff=0.0, max_rel_diff=0.0, mean_abs_diff=0.0, max_at=None,
                        noise_floor=1.0, tolerance=1.0, ratio_to_noise=0.0, preactivation_range=None)
    assert entry_key(report, layer) == "gpt2 | gpt2 | m:F | layer 0003"
    report.name = "mine"
    assert entry_key(report, layer) == "check mine | gpt2 | layer 0003"


def test_update_baseline_of_a_run_that_checked_nothing_writes_no_file(tmp_path, monkeypatch, capsys):
    """Every entry could not run (synthetic weights refused): an empty baseline would make the next run read as
    'matches none of this run's layers' instead of 'not found'."""
    offline_home(monkeypatch, tmp_path)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "parity.toml").write_text('baseline = "b.json"\n[[checks]]\nmodel = "gpt2"\nlayers = [0]\n')
    code, out, err = run_main(capsys, "check", "--update-baseline")
    assert code == 2 and "baseline: not written: no layer was checked" in out, (out, err)
    assert not (tmp_path / "b.json").exists()
    code, _, err = run_main(capsys, "check")
    assert code == 2 and "create it with --update-baseline" in err, err
