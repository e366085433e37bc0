"""Your own module in one command: routes read off parameter names (no mapping file), saved mappings,
mappings that extend a built-in, constructor arguments, the Python API's target forms, report
rendering, the pytest fixture, and the conventions around them (-k, parent project files, --json
FILE|- with schema_version, the JSON Schema, messages for missing paths, no foreign progress bars).

The modules under test are written here the way their authors wrote them (nanoGPT's MLP, Meta's
FeedForward, transformers' names); `--target tests.test_own_module:NAME` imports them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import parity
from parity.definitions.aliases import load_aliases
from parity.definitions.mapping_parser import load_mapping
from parity.errors import MappingError

from .builders import FeedForward
from .conftest import build_model, save
from .support import ROOT, run_json, run_main, run_parity

HERE = "tests.test_own_module"


# -- modules as their authors wrote them --------------------------------------------------------------

@dataclass
class GPTConfig:  # nanoGPT's config: bias and dropout, which transformers' GPT2Config lacks
    n_embd: int = 768
    bias: bool = True
    dropout: float = 0.0


class MLP(nn.Module):  # nanoGPT model.py, verbatim but for the GELU's tanh form
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


def nano_mlp(config):  # the one-line factory: GPTConfig from the checkpoint's GPT2Config
    return MLP(GPTConfig(n_embd=config.n_embd, bias=True, dropout=0.0))


def nano_mlp_exact_gelu(config):
    mlp = nano_mlp(config)
    mlp.gelu = nn.GELU()
    return mlp


def meta_feed_forward(config):  # tiny llama: d = 32, 4d = 128 -> 2/3 -> 85 -> multiple_of 8 -> 88 = intermediate_size
    return FeedForward(config.hidden_size, 4 * config.hidden_size, multiple_of=8, ffn_dim_multiplier=None)


class SwappedFeedForward(FeedForward):
    def forward(self, x):
        return self.w2(self.w1(x) * F.silu(self.w3(x)))  # the activation on the up branch


def meta_swapped(config):
    return SwappedFeedForward(config.hidden_size, 4 * config.hidden_size, multiple_of=8, ffn_dim_multiplier=None)


class HFNamedSwiGLU(nn.Module):  # transformers' names, the repository's constructor
    def __init__(self, emb_size, dropout=0.1, hidden_dim=None, bias=True):
        super().__init__()
        self.gate_proj = nn.Linear(emb_size, hidden_dim, bias=bias)
        self.up_proj = nn.Linear(emb_size, hidden_dim, bias=bias)
        self.down_proj = nn.Linear(hidden_dim, emb_size, bias=bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):  # the FFN under a submodule prefix ("mlp."), biases as bare parameters
    def __init__(self, config):
        super().__init__()
        d, ff = config.n_embd, 4 * config.n_embd
        self.mlp = nn.Module()
        self.mlp.w1 = nn.Parameter(torch.empty(ff, d))
        self.mlp.b1 = nn.Parameter(torch.empty(ff))
        self.mlp.w2 = nn.Parameter(torch.empty(d, ff))
        self.mlp.b2 = nn.Parameter(torch.empty(d))

    def forward(self, x):
        hidden = F.gelu(F.linear(x, self.mlp.w1, self.mlp.b1), approximate="tanh")
        return F.linear(hidden, self.mlp.w2, self.mlp.b2)


class Conv1DMLP(nn.Module):  # transformers' own Conv1D layers: weights stored [in, out], as GPT-2's
    def __init__(self, config):
        from transformers.pytorch_utils import Conv1D

        super().__init__()
        d, ff = config.n_embd, config.n_inner or 4 * config.n_embd
        self.c_fc, self.c_proj = Conv1D(ff, d), Conv1D(d, ff)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class LinearSquareMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        d, ff = config.n_embd, config.n_inner
        self.fc1, self.fc2 = nn.Linear(d, ff), nn.Linear(ff, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class Ambiguous(nn.Module):  # two names no table knows, of one shape: which is the gate?
    def __init__(self, config):
        super().__init__()
        self.left = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.right = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.left(x)) * self.right(x))


# -- routes read off names: --target alone ------------------------------------------------------------

def test_nanogpt_mlp_through_a_factory_with_target_alone(tiny, capsys):
    code, report, err = run_json(capsys, tiny["gpt2"], "--target", f"{HERE}:nano_mlp")
    assert code == 0, err
    routes = report["routes"]
    assert routes["inferred"] is True and routes["extends"] == "gpt2"
    assert routes["tensors"] == {  # Conv1D [in, out] in the checkpoint, nn.Linear [out, in] in nanoGPT
        "c_fc.weight": {"from": "c_fc.weight", "transform": "transpose"}, "c_fc.bias": "c_fc.bias",
        "c_proj.weight": {"from": "c_proj.weight", "transform": "transpose"}, "c_proj.bias": "c_proj.bias"}
    assert "routes      c_fc.weight ← c_fc.weight.T, c_fc.bias ← c_fc.bias" in err  # the table went to stderr
    assert "(inferred from parameter names" in err


def test_inferred_routes_still_show_the_modules_mistake(tiny, capsys):
    code, report, _ = run_json(capsys, tiny["gpt2"], "--layer", "0", "--target", f"{HERE}:nano_mlp_exact_gelu")
    assert code == 1 and report["layers"][0]["diagnosis"]["id"] == "gelu_exact_instead_of_tanh"


def test_meta_feed_forward_with_target_alone(tiny, capsys):
    code, report, err = run_json(capsys, tiny["llama"], "--target", f"{HERE}:meta_feed_forward")
    assert code == 0, err
    assert report["routes"]["tensors"] == {"w1.weight": "gate_proj.weight", "w2.weight": "down_proj.weight",
                                           "w3.weight": "up_proj.weight"}


def test_meta_gate_up_confusion_is_diagnosed_not_hidden(tiny, capsys):
    """Assignment is by name: parity does not try w1/w3 both ways until the module passes."""
    code, report, _ = run_json(capsys, tiny["llama"], "--layer", "0", "--target", f"{HERE}:meta_swapped")
    assert code == 1 and report["layers"][0]["diagnosis"]["id"] == "gate_up_swapped"


def test_transformers_names_with_the_repositorys_constructor(tiny, capsys):
    code, report, err = run_json(capsys, tiny["llama"], "--layer", "1", "--target", f"{HERE}:HFNamedSwiGLU")
    assert code == 0, err
    assert report["routes"]["tensors"]["gate_proj.weight"] == "gate_proj.weight"
    assert report["routes"]["args"]["emb_size"] == "config.hidden_size"  # the built-in mapping's args fit it


def test_transformers_own_mlp_class_built_from_the_config(tiny, capsys):
    code, report, err = run_json(capsys, tiny["llama"], "--layer", "0", "--target",
                                 "transformers.models.llama.modeling_llama:LlamaMLP")
    assert code == 0, err
    assert report["routes"]["args"] == {"config": "config"} and report["routes"]["inferred"] is True


def test_a_plain_values_constructor_built_to_the_wrong_size_gets_a_factory_that_passes(tiny, tmp_path, capsys,
                                                                                        monkeypatch):
    """Meta's FeedForward(dim, hidden_dim, multiple_of, ffn_dim_multiplier): bound by name it keeps 2/3 of the
    checkpoint's d_ff; parity compares the built shapes first, names the argument and prints a factory, which,
    written to a file exactly as printed, passes."""
    code, _, err = run_main(capsys, tiny["llama"], "--layer", "0", "--target", f"{HERE}:FeedForward")
    assert code == 2
    assert "by parameter name" in err and "hidden_dim=88 most likely means something else" in err
    factory = err[err.index("def make_ffn(config):"):].strip()
    assert "..." not in factory and "dim=config.hidden_size" in factory, factory
    (tmp_path / "written_factory.py").write_text(f"from tests.builders import FeedForward\n\n\n{factory}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code, _, err = run_main(capsys, tiny["llama"], "--layer", "0", "--target", "written_factory:make_ffn")
    assert code == 0, err


def test_bare_parameters_under_a_submodule_prefix(tiny, capsys):
    code, report, err = run_json(capsys, tiny["gpt2"], "--layer", "2", "--target", f"{HERE}:Block")
    assert code == 0, err
    assert report["routes"]["tensors"]["mlp.w1"] == {"from": "c_fc.weight", "transform": "transpose"}
    assert report["routes"]["tensors"]["mlp.b2"] == "c_proj.bias"


@pytest.fixture(scope="module")
def gpt2_square(tmp_path_factory):
    """d_ff = d: every weight square, so only the family's stored layout and the owner's class tell."""
    return save(build_model("gpt2", seed=21, n_inner=32), tmp_path_factory.mktemp("square") / "gpt2")


@pytest.mark.parametrize("target, transform", [("Conv1DMLP", "none"), ("LinearSquareMLP", "transpose")])
def test_orientation_of_square_weights(gpt2_square, capsys, target, transform):
    code, report, err = run_json(capsys, gpt2_square, "--layer", "0", "--target", f"{HERE}:{target}")
    assert code == 0, err
    first = next(iter(report["routes"]["tensors"].values()))
    assert (first.get("transform", "none") if isinstance(first, dict) else "none") == transform


def test_conv1d_target_on_gpt2_needs_no_transpose(tiny, capsys):
    code, report, err = run_json(capsys, tiny["gpt2"], "--layer", "0", "--target", f"{HERE}:Conv1DMLP")
    assert code == 0, err
    assert report["routes"]["tensors"]["c_fc.weight"] == "c_fc.weight"


def test_ambiguous_names_exit_2_with_a_mapping_to_edit(tiny, tmp_path, capsys):
    code, _, err = run_main(capsys, tiny["llama"], "--layer", "0", "--target", f"{HERE}:Ambiguous")
    assert code == 2
    assert "'left.weight' is no name in aliases.toml" in err and "never tries assignments" in err
    assert "left.weight       [88, 32]" in err and "gate_proj.weight  [88, 32]        gate weight" in err
    assert err.rstrip().splitlines()[-1].startswith("parity: error: cannot tell which checkpoint tensor")
    mapping = err[err.index('extends = "llama"'):err.index("parity: error:")]
    assert f'class = "{HERE}:Ambiguous"' in mapping
    assert ('"left.weight" = "?"   # [88, 32]: UNCERTAIN, 2 tensors fit: "gate_proj.weight"; or "up_proj.weight"'
            in mapping)  # two fit: the names must decide, never a trial of both
    assert '"down_proj.weight" = "down_proj.weight"' in mapping
    # the printed mapping is ready to edit: fill in the two "?" and it runs
    edited = mapping.replace('"left.weight" = "?"', '"left.weight" = "gate_proj.weight"', 1)
    edited = edited.replace('"right.weight" = "?"', '"right.weight" = "up_proj.weight"', 1)
    (tmp_path / "mine.toml").write_text(edited)
    code, report, err = run_json(capsys, tiny["llama"], "--layer", "0", "--mapping", tmp_path / "mine.toml")
    assert code == 0, err
    assert report["routes"]["inferred"] is False and report["target"] == f"{HERE}:Ambiguous"


def test_mapping_routes_that_do_not_fit_a_user_target_are_not_forced(tiny, capsys):
    """--target with parity's own parameter names keeps the built-in routes (nothing inferred)."""
    code, report, _ = run_json(capsys, tiny["llama"], "--layer", "0", "--target", "tests.mutants:SwappedSwiGLU")
    assert code == 1 and report["routes"]["inferred"] is False


def test_saved_mapping_reproduces_the_run(tiny, tmp_path, capsys):
    saved = tmp_path / "saved.toml"
    code, first, _ = run_json(capsys, tiny["gpt2"], "--layers", "0,2", "--target", f"{HERE}:nano_mlp",
                              "--save-mapping", saved)
    assert code == 0 and saved.is_file()
    text = saved.read_text()
    assert 'extends = "gpt2"' in text and f'class = "{HERE}:nano_mlp"' in text
    code, again, _ = run_json(capsys, tiny["gpt2"], "--layers", "0,2", "--mapping", saved)
    assert code == 0
    assert again["routes"]["tensors"] == first["routes"]["tensors"] and again["target"] == first["target"]
    assert [r["max_abs_diff"] for r in again["layers"]] == [r["max_abs_diff"] for r in first["layers"]]


def test_alias_table_is_data_with_one_role_per_name_within_a_kind():
    aliases = load_aliases()
    assert aliases.path.name == "aliases.toml" and aliases.path.parent.name == "mappings"
    assert {"gate", "up", "down", "gate_up", "fc_in", "fc_out"} <= set(aliases.roles)
    assert aliases.roles_of("mlp.w1.weight") == {("gate", "weight"), ("fc_in", "weight")}  # the kind decides
    assert aliases.roles_of("feed_forward.gate_proj.bias") == {("gate", "bias")}
    assert aliases.roles_of("c_fc") == {("fc_in", "weight")} and aliases.roles_of("b2") >= {("fc_out", "bias")}
    assert aliases.roles_of("norm.weight") == set()


# -- mapping files: extends, None ---------------------------------------------------------------------

def test_mapping_extends_a_builtin_and_passes_none(tiny, tmp_path, capsys):
    mapping = tmp_path / "meta.toml"
    mapping.write_text(f'''extends = "llama"

[target]
class = "{HERE}:FeedForward"
args = {{ dim = "config.hidden_size", hidden_dim = 128, multiple_of = 8, ffn_dim_multiplier = {{ none = true }} }}

[tensors]
"w1.weight" = "gate_proj.weight"
"w2.weight" = "down_proj.weight"
"w3.weight" = "up_proj.weight"
''')
    loaded = load_mapping(mapping)
    assert loaded.layer_key == "model.layers.{layer}.mlp" and loaded.reference_module == "model.layers.{layer}.mlp"
    assert [r.target for r in loaded.tensors] == ["w1.weight", "w2.weight", "w3.weight"]  # replaced, not merged
    code, report, err = run_json(capsys, tiny["llama"], "--layer", "0", "--mapping", mapping)
    assert code == 0, err


def test_mapping_extends_overrides_single_keys_and_files(tmp_path):
    base = tmp_path / "base.toml"
    base.write_text('extends = "gpt2"\nname = "my-gpt2"\n[target.args]\nemb_size = "config.n_embd"\n'
                    'activation = "gelu"\ndropout = 0.0\n')
    child = tmp_path / "sub" / "child.toml"
    child.parent.mkdir()
    child.write_text('extends = "../base.toml"\n[target]\nargs = { emb_size = "config.n_embd", '
                     'activation = "gelu_tanh", dropout = 0.0 }\n')
    loaded = load_mapping(child)
    assert loaded.name == "my-gpt2" and loaded.target_class == "parity.ffn:FeedForward"
    assert loaded.target_args["activation"] == "gelu_tanh" and loaded.tensors[0].transform == "transpose"
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\nextends = "gtp2"\n')
    with pytest.raises(MappingError, match=r"bad.toml:2: key 'extends': no built-in mapping 'gtp2'"):
        load_mapping(bad)
    loop = tmp_path / "loop.toml"
    loop.write_text('extends = "loop.toml"\n')
    with pytest.raises(MappingError, match="circle"):
        load_mapping(loop)


# -- the Python API -----------------------------------------------------------------------------------

def test_an_instance_is_checked_in_a_copy_and_left_unmodified(tiny):
    from transformers import AutoConfig

    instance = nano_mlp(AutoConfig.from_pretrained(tiny["gpt2"]))
    before = {name: tensor.clone() for name, tensor in instance.state_dict().items()}
    report = parity.check(str(tiny["gpt2"]), target=instance, layers=[0, 1])
    assert report.passed and report.target == f"{HERE}:MLP"
    after = instance.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert instance.training  # not even switched to eval mode
    loaded = parity.load_ffn(str(tiny["gpt2"]), layer=1, target=instance)
    assert loaded is not instance and not loaded.training


def test_a_string_target_is_imported_from_the_working_directory(tiny, tmp_path, monkeypatch):
    (tmp_path / "my_ffn_module.py").write_text(
        "from torch import nn\n"
        "class MyGPT2MLP(nn.Module):\n"
        "    def __init__(self, config):\n"
        "        super().__init__()\n"
        "        self.fc1 = nn.Linear(config.n_embd, 4 * config.n_embd)\n"
        "        self.fc2 = nn.Linear(4 * config.n_embd, config.n_embd)\n"
        "        self.act = nn.GELU(approximate='tanh')\n"
        "    def forward(self, x):\n"
        "        return self.fc2(self.act(self.fc1(x)))\n")
    monkeypatch.chdir(tmp_path)
    path_before = list(sys.path)
    report = parity.check(str(tiny["gpt2"]), target="my_ffn_module:MyGPT2MLP", layers=[0])
    assert report.passed and report.routes["args"] == {"config": "config"}
    assert sys.path == path_before


def test_report_prints_as_the_table_and_renders_for_notebooks(tiny):
    report = parity.check(str(tiny["llama"]), layers=[0])
    text = str(report)
    assert text == parity.render(report)
    assert text.startswith("parity: ") and "PASS: 1 layer(s)" in text and "routes      _gate.weight ←" in text
    html = report._repr_html_()
    assert html.startswith('<div class="parity-report">') and "PASS: 1 layer(s)" in html
    assert parity.render_html(report) == html


# -- pytest -------------------------------------------------------------------------------------------

@pytest.mark.slow  # a user's own pytest run, in its own process, with the plugin loaded as its users load it
def test_pytest_failure_first_line_and_layer_parametrization(tiny, tmp_path):
    (tmp_path / "test_user.py").write_text(f'''
import pytest

@pytest.mark.parametrize("layer", [0, 1])
def test_ffn_layer(parity_check, layer):
    parity_check({str(tiny["gpt2"])!r}, target="{HERE}:nano_mlp", layers=[layer])

def test_broken(parity_check):
    parity_check({str(tiny["gpt2"])!r}, target="{HERE}:nano_mlp_exact_gelu", layers=[1])
''')
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "HF_HUB_OFFLINE": "1",
           "COLUMNS": "400"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "--tb=line", "-rf", "-p", "no:parity", "-p",
                          "parity.pytest_plugin", "-p", "no:cacheprovider", str(tmp_path / "test_user.py")],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert "1 failed, 2 passed" in out.stdout, out.stdout + out.stderr
    crash = next(line for line in out.stdout.splitlines() if line.startswith(str(tmp_path / "test_user.py")))
    # --tb=line's line is the plugin's short line too: the diagnosis first, then where
    assert re.search(r":9: gelu_exact_instead_of_tanh at gpt2\[1\] \(MISMATCH, \S+x tol\)$", crash), crash
    summary = next(line for line in out.stdout.splitlines() if line.startswith("FAILED"))
    assert "test_broken - gelu_exact_instead_of_tanh at gpt2[1] (MISMATCH, " in summary  # the plugin's short line
    assert "parity/engine" not in out.stdout  # parity's own frames are hidden


# -- conventions ----------------------------------------------------------------------------------------

def test_check_finds_the_project_file_in_a_parent_and_selects_with_k(tiny, tmp_path, monkeypatch, capsys):
    (tmp_path / "parity.toml").write_text(f'''
[defaults]
require_real = false
[[checks]]
name = "gpt2 nano"
model = {str(tiny["gpt2"])!r}
layers = [0]
target = "{HERE}:nano_mlp"
[[checks]]
name = "llama meta"
model = {str(tiny["llama"])!r}
layers = [0]
target = "{HERE}:meta_feed_forward"
''')
    (tmp_path / "src" / "deep").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "src" / "deep")
    code, out, err = run_main(capsys, "check", "-k", "nano and not llama", "--json", "-")
    assert code == 0, err
    document = json.loads(out)
    assert [c["name"] for c in document["checks"]] == ["gpt2 nano"] and document["schema_version"] == 1
    code, out, err = run_main(capsys, "check", "-k", "(meta or nano) and not gpt2", "-q")
    assert code == 0 and "1 check(s)" in out, err
    code, _, err = run_main(capsys, "check", "-k", "mistral")
    assert code == 2 and "selects none of the 2 check(s)" in err


def test_inspect_json_takes_file_or_dash_with_schema_version(tiny, tmp_path, capsys):
    code, out, _ = run_main(capsys, "inspect", tiny["gpt2"], "--json", "-")
    assert code == 0 and json.loads(out)["schema_version"] == 1
    code, out, _ = run_main(capsys, "inspect", tiny["gpt2"], "--json", tmp_path / "i.json")
    assert code == 0 and "parity inspect:" in out
    assert json.loads((tmp_path / "i.json").read_text())["kind"] == "inspection"


def validate(document: dict, schema: dict) -> list[str]:
    """jsonschema when installed; else the small subset of JSON Schema the report's schema uses."""
    try:
        import jsonschema
    except ImportError:
        return _errors(document, schema, schema, "$")
    return [error.message for error in jsonschema.Draft202012Validator(schema).iter_errors(document)]


_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None), "integer": int,
          "number": (int, float)}


def _errors(value, rule: dict, root: dict, at: str) -> list[str]:
    if "$ref" in rule:
        rule = root["$defs"][rule["$ref"].rsplit("/", 1)[-1]]
    kinds = rule.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if not any(isinstance(value, _TYPES[k]) and not (k in ("integer", "number") and isinstance(value, bool))
                   for k in kinds):
            return [f"{at}: {value!r} is not {kinds}"]
    found = [f"{at}: {value!r} not in {rule['enum']}"] if "enum" in rule and value not in rule["enum"] else []
    found += [f"{at}: {value!r} != {rule['const']}"] if "const" in rule and value != rule["const"] else []
    if "oneOf" in rule and sum(not _errors(value, r, root, at) for r in rule["oneOf"]) != 1:
        found.append(f"{at}: matches not exactly one of oneOf")
    if "not" in rule and not _errors(value, rule["not"], root, at):
        found.append(f"{at}: matches a 'not'")
    if isinstance(value, dict):
        found += [f"{at}: '{key}' is required" for key in rule.get("required", []) if key not in value]
        for key, item in value.items():
            sub = rule.get("properties", {}).get(key, rule.get("additionalProperties", True))
            found += [f"{at}.{key}: not allowed"] if sub is False else (
                _errors(item, sub, root, f"{at}.{key}") if isinstance(sub, dict) else [])
    if isinstance(value, list) and isinstance(rule.get("items"), dict):
        for index, item in enumerate(value):
            found += _errors(item, rule["items"], root, f"{at}[{index}]")
    return found


def test_reports_validate_against_the_shipped_json_schema(tiny, tmp_path, capsys):
    from parity.engine.results import SCHEMA_FILE

    schema = json.loads(SCHEMA_FILE.read_text())
    assert SCHEMA_FILE.parent.parent == Path(parity.__file__).parent  # inside the package: it ships in the wheel
    _, single, _ = run_json(capsys, tiny["gpt2"], "--layer", "0", "--target", f"{HERE}:nano_mlp_exact_gelu")
    (tmp_path / "parity.toml").write_text(f'[[checks]]\nmodel = {str(tiny["llama"])!r}\nlayers = [1]\n'
                                          'require_real = false\n[[checks]]\nmodel = "no/such-model"\n')
    run_main(capsys, "check", "--config", tmp_path / "parity.toml", "--json", tmp_path / "suite.json")
    suite = json.loads((tmp_path / "suite.json").read_text())
    _, inspection, _ = run_json(capsys, "inspect", tiny["llama"])
    for document in (single, suite, inspection):
        assert validate(document, schema) == []
    broken = json.loads(json.dumps(single))
    broken["layers"][0]["status"] = "maybe"
    assert validate(broken, schema) != []
    assert _errors(broken, schema, schema, "$") != [] and _errors(single, schema, schema, "$") == []


def test_a_missing_local_looking_path_is_neither_folder_nor_repository(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_main(capsys, "ckpt/does-not-exist", "--layer", "0")
    assert code == 2 and "no such folder" in err and "no such hub repository" in err
    assert str(tmp_path / "ckpt" / "does-not-exist") in err


@pytest.mark.slow  # a fresh process: what transformers and huggingface_hub draw on its stderr
def test_no_foreign_progress_bars_in_a_log_with_logits(tiny):
    out = run_parity(tiny["gpt2"], "--layer", "0", "--logits",
                     env={"PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert out.returncode == 0, out.stderr
    assert "logits impact" in out.stdout
    assert "Loading weights" not in out.stderr and "\r" not in out.stderr


class TupleSwiGLU(nn.Module):
    """Returns (output, None), as some blocks return (hidden, aux): compared on its first element, and said."""

    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)), None


def test_a_tuple_output_is_compared_on_its_first_element_and_said(tiny):
    report = parity.check(str(tiny["llama"]), target=TupleSwiGLU, layers=[0, 1])
    assert report.passed
    notes = [n for n in report.notes if "returns a tuple (Tensor, NoneType)" in n]
    assert len(notes) == 1 and "its first element is compared" in notes[0]


def test_the_summary_line_names_the_layers_and_the_diagnosis(tiny, capsys):
    code, out, err = run_main(capsys, tiny["llama"], "--layers", "0-1", "--target", f"{HERE}:meta_swapped", "--quiet")
    assert code == 1
    assert (out + err).strip().splitlines()[-1] == ("FAIL: 2 of 2 layer(s) deviate from transformers: layers 0, 1 — "
                                            "gate_up_swapped")


def test_a_classic_ffn_on_a_gated_checkpoint_is_told_so(tiny, capsys):
    """nanoGPT's two-matrix MLP pointed at LLaMA: the first thing said is that the kinds differ, not '?' routes."""
    code, out, err = run_main(capsys, tiny["llama"], "--layer", "0", "--target", f"{HERE}:nano_mlp")
    assert code == 2
    last = err.strip().splitlines()[-1]
    assert "from their names: the target's parameter names make it a classic FFN (fc_in, fc_out), but this " \
           "checkpoint's layers are a gated FFN" in last
