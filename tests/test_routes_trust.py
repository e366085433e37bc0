"""Inputs that used to pass silently or mislead now stop with exit 2 and a message naming the problem:
mapping routes to parameters the module does not have, two weight files holding the same tensors,
and empty option values."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

import parity
import parity.cli
from parity.definitions.datafiles import builtin_mapping_dir
from parity.definitions.mapping import check_reference_routes
from parity.definitions.mapping_parser import load_mapping
from parity.errors import CheckpointError, MappingError, ParityError

from . import mutants as m
from .support import run_main, run_parity

GPT2 = (builtin_mapping_dir() / "gpt2.toml").read_text()


def variant(tmp_path: Path, old: str, new: str, name: str = "mine.toml") -> Path:
    assert old in GPT2
    path = tmp_path / name
    path.write_text(GPT2.replace(old, new))
    return path


def line_with(path: Path, text: str) -> int:
    return next(number for number, row in enumerate(path.read_text().splitlines(), 1) if text in row)


def cli(capsys, *args) -> tuple[int, str]:
    """parity.cli.main in this process (the `parity` command's code) -> (exit code, last stderr line)."""
    code, _, err = run_main(capsys, *args)
    err = err.strip()
    assert "Traceback" not in err
    return code, err.splitlines()[-1] if err else ""


# -- [tensors]: every key names a parameter of the target -------------------------------------
def test_route_to_a_parameter_the_target_lacks_exit_2(tiny, tmp_path, capsys):
    mapping = variant(tmp_path, '"_layer1.weight" = {', '"_layr1.weight" = {')
    code, message = cli(capsys, tiny["gpt2"], "--mapping", mapping, "--layer", "0")
    assert code == 2, message
    line = line_with(mapping, '"_layr1.weight"')
    assert f"{mapping}:{line}: key 'tensors.\"_layr1.weight\"'" in message
    assert "has no parameter '_layr1.weight'" in message and "did you mean '_layer1.weight'?" in message
    assert "Its parameters are: _layer1.weight, _layer1.bias, _layer2.weight, _layer2.bias" in message
    assert "on the left of [tensors]" in message


def test_misspelt_bias_route_is_not_taken_for_a_module_without_bias(tiny, tmp_path, capsys):
    """A bias route whose module does not exist routes nothing: before, it was skipped with a note and the
    real bias zeroed, so the check failed with a misleading bias_dropped (exit 1)."""
    mapping = variant(tmp_path, '"_layer2.bias" = "c_proj.bias"', '"layer2.bias" = "c_proj.bias"')
    code, message = cli(capsys, tiny["gpt2"], "--mapping", mapping, "--layer", "0")
    assert code == 2, message
    line = line_with(mapping, '"layer2.bias"')
    assert f"{mapping}:{line}: key 'tensors.\"layer2.bias\"'" in message
    assert "did you mean '_layer2.bias'?" in message and "_layer1.weight, _layer1.bias" in message


def test_every_unknown_route_is_named_with_its_line(tiny, tmp_path, capsys):
    mapping = variant(tmp_path, '"_layer1.weight" = {', '"fc1.weight" = {')
    mapping.write_text(mapping.read_text().replace('"_layer2.weight" = {', '"fc2.weight" = {'))
    code, message = cli(capsys, tiny["gpt2"], "--mapping", mapping, "--layer", "0")
    assert code == 2
    for name in ("fc1.weight", "fc2.weight"):
        assert f"{mapping}:{line_with(mapping, name)}: key 'tensors.\"{name}\"'" in message


def test_bias_route_to_a_module_built_without_that_bias_is_still_noted_not_an_error(tiny):
    report = parity.check(str(tiny["gpt2"]), target=m.gpt2_no_output_bias, layers=[0])
    assert not report.passed and report.layers[0].diagnosis["id"] == "bias_dropped"
    assert any("no parameter '_layer2.bias'" in note for note in report.notes)


def test_optional_routes_are_skipped_for_a_module_without_biases(tiny):
    assert parity.check(str(tiny["llama"]), layers=[0]).passed  # llama.toml: optional bias routes, bias=False


# -- [reference.tensors]: every key names a parameter of transformers' MLP -------------------
REFERENCE_NAMES = ["c_fc.weight", "c_fc.bias", "c_proj.weight", "c_proj.bias"]


def reference_variant(tmp_path: Path, key: str) -> Path:
    return variant(tmp_path, "[target]\n", f'[reference.tensors]\n"{key}" = "c_fc.weight"\n\n[target]\n', "ref.toml")


def test_check_reference_routes_names_file_line_and_the_real_names(tmp_path):
    path = reference_variant(tmp_path, "c_fc.wieght")
    mapping = load_mapping(path)
    with pytest.raises(MappingError) as info:
        check_reference_routes(mapping, REFERENCE_NAMES)
    message = str(info.value)
    assert f"{path}:{line_with(path, 'c_fc.wieght')}: key 'reference.tensors.\"c_fc.wieght\"'" in message
    assert "did you mean 'c_fc.weight'?" in message
    assert "Its parameters are: c_fc.weight, c_fc.bias, c_proj.weight, c_proj.bias" in message
    check_reference_routes(load_mapping(reference_variant(tmp_path, "c_fc.weight")), REFERENCE_NAMES)  # fine
    gguf_style = variant(tmp_path, "[target]\n", '[reference.tensors]\n"c_fc.weight" = { from = "ffn_up.weight", '
                         'transform = "transpose" }\n"c_proj.bias" = "ffn_down.bias"\n\n[target]\n', "gguf.toml")
    check_reference_routes(load_mapping(gguf_style), REFERENCE_NAMES)  # routes from other names, transposed: fine


def test_reference_route_to_a_parameter_transformers_lacks_exit_2(tiny, tmp_path, capsys):
    """Needs parity/runner.py's Session to call check_reference_routes (before, the route was ignored)."""
    path = reference_variant(tmp_path, "c_fc.wieght")
    code, message = cli(capsys, tiny["gpt2"], "--mapping", path, "--layer", "0")
    assert code == 2, message
    assert f"{path}:{line_with(path, 'c_fc.wieght')}:" in message and "c_fc.weight, c_fc.bias" in message


def test_reference_tensors_with_experts_is_refused_on_load(tmp_path):
    text = (builtin_mapping_dir() / "mixtral.toml").read_text()
    path = tmp_path / "moe.toml"
    path.write_text(text.replace("[experts]", '[reference.tensors]\n"w1.weight" = "w1.weight"\n\n[experts]', 1))
    with pytest.raises(MappingError,
                       match=r"moe\.toml:\d+: key 'reference.tensors': is not used by a mapping with \[experts\]"):
        load_mapping(path)


# -- two weight files holding the same tensors, no index --------------------------------------
@pytest.fixture()
def stray_copy(tiny, tmp_path) -> Path:
    """tiny llama plus model2-stale.safetensors: the same tensor names, other values."""
    folder = shutil.copytree(tiny["llama"], tmp_path / "llama")
    stale = {name: tensor * 2 for name, tensor in load_file(str(folder / "model.safetensors")).items()}
    save_file(stale, str(folder / "model2-stale.safetensors"), metadata={"format": "pt"})
    return folder


def test_stray_weight_file_with_the_same_tensors_exit_2(stray_copy, capsys):
    code, message = cli(capsys, stray_copy, "--layer", "0")
    assert code == 2, message
    assert f"{stray_copy}: model.safetensors and model2-stale.safetensors both hold tensor(s)" in message
    assert "model.embed_tokens.weight" in message and "more" in message  # the first few, then a count
    assert "Remove" in message and "model.safetensors.index.json" in message
    with pytest.raises(CheckpointError, match="model2-stale.safetensors"):
        parity.check(str(stray_copy), layers=[0])


def test_stray_weight_file_is_fine_when_the_file_or_an_index_says_which(stray_copy):
    assert parity.check(str(stray_copy / "model.safetensors"), layers=[0]).passed
    names = load_file(str(stray_copy / "model.safetensors"))
    index = {"metadata": {}, "weight_map": {name: "model.safetensors" for name in names}}
    (stray_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    assert parity.check(str(stray_copy), layers=[0]).passed


def test_weight_files_with_distinct_tensors_still_combine(tiny, tmp_path):
    """Shards without an index (each tensor in one file) stay a valid checkpoint."""
    folder = shutil.copytree(tiny["llama"], tmp_path / "llama")
    tensors = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[::2]}, str(folder / "part-a.safetensors"), metadata={"format": "pt"})
    save_file({n: tensors[n] for n in names[1::2]}, str(folder / "part-b.safetensors"), metadata={"format": "pt"})
    assert parity.check(str(folder), layers=[1]).passed


# -- empty values: a usage error, not another question ----------------------------------------
@pytest.mark.parametrize("args, option", [
    (["llama", "--checkpoint", ""], "--checkpoint"),
    (["llama", "--mapping", ""], "--mapping"),
    (["llama", "--target", ""], "--target"),
    (["llama", "--revision", ""], "--revision"),
    ([""], "MODEL"),
    (["inspect", "llama", "--checkpoint", ""], "--checkpoint"),
])
def test_empty_option_value_is_a_usage_error(args, option, capsys):
    with pytest.raises(SystemExit) as info:
        parity.cli.main(args)
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert f"argument {option}: the value is empty ('')" in err and "not a mapping name" not in err


@pytest.mark.slow  # the real executable: its argument parsing and exit, before anything heavy is imported
def test_empty_checkpoint_exit_2_from_the_executable():
    out = run_parity("llama", "--checkpoint", "")
    assert out.returncode == 2 and "argument --checkpoint: the value is empty" in out.stderr
    assert "HF_HUB_OFFLINE" not in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("kwargs, name", [
    (dict(model="llama", checkpoint=""), "checkpoint"),
    (dict(model="llama", checkpoint="  "), "checkpoint"),
    (dict(model="llama", mapping=""), "mapping"),
    (dict(model="llama", revision=""), "revision"),
    (dict(model=""), "model"),
])
def test_empty_value_in_the_python_api_raises(kwargs, name):
    with pytest.raises(ParityError, match=rf"^{name} is empty \('\s*'\)"):
        parity.check(**kwargs)


def test_empty_target_in_the_python_api_raises(tiny):
    with pytest.raises(ParityError, match="--target is empty"):
        parity.check(str(tiny["llama"]), target="", layers=[0])
