"""Issue 17, the seams: legal input never ends in an internal error, and the smaller things (a duplicated list,
a writable read-only view, a 300-digit ratio)."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import GPT2Config

from parity.definitions import mapping_parser as mapping_module
from parity.definitions.aliases import load_aliases
from parity.definitions.mapping_parser import load_mapping
from parity.definitions.registry import builtin_mappings, mapping_for_model_type
from parity.definitions.run_selection import MAX_SELECTION_DEPTH, select_checks
from parity.engine.check.config_view import config_view
from parity.errors import MappingError
from parity.outputs.baseline import _regression

from .support import run_main, run_parity


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("parity:")]
    assert len(lines) == 1, err
    assert "internal error" not in err and "Traceback" not in err, err
    return lines[0]


def write_project(folder: Path, model: Path) -> None:
    (folder / "parity.toml").write_text(f'[[checks]]\nname = "gpt2 tiny"\nmodel = {json.dumps(str(model))}\n'
                                        "layers = [0]\nrequire_real = false\n")


# -- 1. `parity check -k EXPR` ------------------------------------------------------------------------------------

@pytest.mark.parametrize("expression", ["not " * 5000 + "gpt2", "(" * 3000 + "gpt2" + ")" * 3000,
                                        "not (" * 1500 + "gpt2" + ")" * 1500],
                         ids=["5000 nots", "3000 parentheses", "1500 not-parentheses"])
def test_k_nested_too_deeply_is_a_usage_error(expression, tiny, tmp_path, monkeypatch, capsys):
    write_project(tmp_path, tiny["gpt2"])
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(capsys, "check", "-k", expression)
    assert code == 2
    line = one_error_line(err)
    assert "nests too deeply" in line and len(line) < 300, line  # the 20000-character expression is cut
    assert "PASS" not in out  # refused before anything ran


def test_k_nesting_up_to_the_limit_still_selects():
    checks = [SimpleNamespace(label="gpt2 tiny"), SimpleNamespace(label="llama tiny")]
    even = "not " * MAX_SELECTION_DEPTH + "gpt2"  # an even count of nots: "gpt2"
    assert [c.label for c in select_checks(checks, even)] == ["gpt2 tiny"]
    grouped = "(" * MAX_SELECTION_DEPTH + "llama" + ")" * MAX_SELECTION_DEPTH
    assert [c.label for c in select_checks(checks, grouped)] == ["llama tiny"]
    with pytest.raises(Exception, match="nests too deeply"):
        select_checks(checks, "not " * (MAX_SELECTION_DEPTH + 1) + "gpt2")


def test_empty_k_is_refused_exactly_like_a_blank_one(tiny, tmp_path, monkeypatch, capsys):
    write_project(tmp_path, tiny["gpt2"])
    monkeypatch.chdir(tmp_path)
    blank = run_main(capsys, "check", "-k", " ")
    empty = run_main(capsys, "check", "-k", "")
    assert blank[0] == 2 and "-k needs an expression" in one_error_line(blank[2])
    assert empty == blank  # same exit code, same (empty) stdout, same message: not "every check"


# -- 2. `extends` ------------------------------------------------------------------------------------------------

def test_extends_chain_reads_each_file_once(tmp_path, monkeypatch):
    depth = 12  # before: each level read its base twice, 2**12 reads of the deepest file (5 s)
    (tmp_path / "m0.toml").write_text('extends = "gpt2"\n')
    for level in range(1, depth + 1):
        extra = 'description = "five"\n' if level == 5 else ""
        (tmp_path / f"m{level}.toml").write_text(f'extends = "m{level - 1}.toml"\n{extra}')
    reads: dict[str, int] = {}
    real = mapping_module.read_text

    def counting(path, *args, **kwargs):
        reads[Path(path).name] = reads.get(Path(path).name, 0) + 1
        return real(path, *args, **kwargs)

    monkeypatch.setattr(mapping_module, "read_text", counting)
    loaded = load_mapping(tmp_path / f"m{depth}.toml")
    assert reads == {"gpt2.toml": 1, **{f"m{level}.toml": 1 for level in range(depth + 1)}}
    gpt2 = builtin_mappings()["gpt2"]
    assert loaded.description == "five"  # an override in the middle of the chain reaches the end
    assert loaded.layer_key == gpt2.layer_key and loaded.tensors == gpt2.tensors
    reads.clear()
    load_mapping(tmp_path / f"m{depth}.toml")  # a second load reads the files afresh (they may have changed)
    assert sum(reads.values()) == depth + 2


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_extends_naming_a_fifo_or_a_folder_says_what_it_is(tmp_path, capsys):
    os.mkfifo(tmp_path / "pipe.toml")
    (tmp_path / "folder.toml").mkdir()
    for name, kind in (("pipe.toml", "a FIFO (named pipe)"), ("folder.toml", "a folder")):
        child = tmp_path / f"extends-{name}"
        child.write_text(f'extends = "{name}"\n')
        with pytest.raises(MappingError) as caught:
            load_mapping(child)
        assert f"is {kind}, not a regular file" in str(caught.value) and "not found" not in str(caught.value)
        code, _, err = run_main(capsys, "gpt2", "--mapping", child)
        assert code == 2 and kind in one_error_line(err)
    missing = tmp_path / "extends-missing.toml"
    missing.write_text('extends = "missing.toml"\n')
    with pytest.raises(MappingError, match="missing.toml not found"):  # a missing file is still "not found"
        load_mapping(missing)


# -- 3. names that are not UTF-8 ------------------------------------------------------------------------------------

def non_utf8_copy(source: Path, parent: Path, raw: bytes = b"ck\xff") -> Path:
    """``source`` copied to a folder whose name is not UTF-8 (Python holds that byte as a lone surrogate)."""
    target = parent / os.fsdecode(raw)
    try:
        shutil.copytree(source, target)
    except (OSError, UnicodeEncodeError) as exc:  # macOS and Windows refuse such names
        pytest.skip(f"this file system refuses a name that is not UTF-8: {exc}")
    return target


def test_checkpoint_folder_not_utf8_is_checked_and_shown_escaped(tiny, tmp_path, monkeypatch, capsys):
    folder = non_utf8_copy(tiny["gpt2"], tmp_path)
    monkeypatch.chdir(tmp_path)
    errors = sys.stdout.errors  # pytest's capture: strict UTF-8, which cannot hold a lone surrogate
    code, out, err = run_main(capsys, folder.name, "--layer", "0", "--html", "out.html")
    assert code == 0, err
    assert "internal error" not in err and "re-download" not in err
    assert "ck\\udcff" in out and "PASS" in out  # the name, escaped
    assert sys.stdout.errors == errors  # main() puts the stream's setting back
    page = (tmp_path / "out.html").read_bytes().decode("utf-8")  # a UTF-8 page, no surrogate in it
    assert "ck\\udcff" in page


def test_not_utf8_folder_safetensors_cannot_open_blames_the_name_not_the_file(tiny, tmp_path, monkeypatch, capsys):
    from parity.sources import safetensors_files

    folder = non_utf8_copy(tiny["gpt2"], tmp_path)
    monkeypatch.setattr(safetensors_files, "_FD_DIR", tmp_path / "no-such-fd-dir")  # no way around the name
    monkeypatch.chdir(tmp_path)
    code, _, err = run_main(capsys, folder.name, "--layer", "0", "--html", "out.html")
    assert code == 2
    line = one_error_line(err)
    assert "not valid UTF-8" in line and "rename" in line and "ck\\udcff" in line, line
    assert "re-download" not in line and "not a readable safetensors file" not in line
    assert "ck\\udcff" in (tmp_path / "out.html").read_bytes().decode("utf-8")  # the error page is written too


def test_mapping_file_not_utf8_in_table_error_and_page(tiny, tmp_path, monkeypatch, capsys):
    good = tmp_path / os.fsdecode(b"m\xff.toml")
    try:
        good.write_text('extends = "gpt2"\n')
    except (OSError, UnicodeEncodeError) as exc:
        pytest.skip(f"this file system refuses a name that is not UTF-8: {exc}")
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(capsys, tiny["gpt2"], "--mapping", good.name, "--layer", "0", "--html", "ok.html")
    assert code == 0, err
    assert "m\\udcff" in out and "m\\udcff" in (tmp_path / "ok.html").read_bytes().decode("utf-8")
    bad = tmp_path / os.fsdecode(b"n\xff.toml")
    bad.write_text('extends = "gpt2"\nbogus = 1\n')
    code, out, err = run_main(capsys, tiny["gpt2"], "--mapping", bad.name, "--html", "bad.html")
    assert code == 2
    assert "n\\udcff.toml:2: key 'bogus'" in one_error_line(err)
    assert "n\\udcff.toml" in (tmp_path / "bad.html").read_bytes().decode("utf-8")


@pytest.mark.slow
def test_not_utf8_folder_on_a_strict_utf8_stdout_process(tiny, tmp_path):
    folder = non_utf8_copy(tiny["gpt2"], tmp_path)
    done = run_parity(folder.name, "--layer", "0", "--html", "out.html", cwd=tmp_path,
                      env={"PYTHONIOENCODING": "utf-8:strict"})
    assert done.returncode == 0, done.stderr
    assert "internal error" not in done.stderr and "ck\\udcff" in done.stdout and "PASS" in done.stdout
    assert "ck\\udcff" in (tmp_path / "out.html").read_bytes().decode("utf-8")


# -- 4. unknown model_type ------------------------------------------------------------------------------------------

def test_unknown_model_type_lists_each_known_type_once(tiny, tmp_path, capsys):
    with pytest.raises(MappingError) as caught:
        mapping_for_model_type("nosuchtype")
    listed = re.search(r"known model types: (.*?)\. Write", str(caught.value)).group(1).split(", ")
    served = {t for m in builtin_mappings().values() for t in m.model_types}
    assert sorted(listed) == listed and listed == sorted(served)  # each once (gpt2 and gpt2-gguf share one)
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny["gpt2"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "nosuchtype"}))
    code, _, err = run_main(capsys, folder)
    line = one_error_line(err)
    assert code == 2 and line.count("gpt2, ") == 1 and "no mapping serves model_type 'nosuchtype'" in line


# -- 5. the read-only config view --------------------------------------------------------------------------------

def test_config_view_cannot_be_written_through_any_door():
    config = GPT2Config(n_embd=32, n_layer=2, n_head=2)
    view = config_view(config, load_aliases().config_fields, {"ffn_bias": (True, "the checkpoint has biases")})
    with pytest.raises(AttributeError):
        view.__dict__  # noqa: B018  (was the config's own, writable __dict__)
    with pytest.raises(TypeError):
        vars(view)
    with pytest.raises(TypeError):  # the answers are a read-only mapping
        view._parity_answers["bias"] = (False, "forged")
    with pytest.raises(AttributeError, match="read-only"):
        view.update({"n_embd": 7})  # PretrainedConfig's own writer, through the view
    with pytest.raises(AttributeError, match="read-only"):
        view.n_embd = 7
    with pytest.raises(AttributeError, match="read-only"):
        del view.bias
    assert config.n_embd == 32 and not hasattr(config, "bias")
    assert view.n_embd == 32 and view.bias is True
    assert copy.deepcopy(view) is view and copy.copy(view) is view  # was: AttributeError on '_parity_config'


# -- 6. a baseline ratio ------------------------------------------------------------------------------------------

def test_baseline_ratio_is_a_few_significant_digits():
    message = _regression({"passed": True, "max_abs_diff": 1e-300}, SimpleNamespace(passed=True, max_abs_diff=9e-7),
                          2.0, 1e-8)
    assert "(9e+293x; allowed 2x + 1e-08)" in message and len(message) < 100, message
    grown = _regression({"passed": True, "max_abs_diff": 1e-6}, SimpleNamespace(passed=True, max_abs_diff=2.5e-5),
                        2.0, 0.0)
    assert "(25x;" in grown
    thousand = _regression({"passed": True, "max_abs_diff": 1e-9}, SimpleNamespace(passed=True, max_abs_diff=1e-6),
                           2.0, 0.0)
    assert "(1000x;" in thousand  # not 1e+03x
