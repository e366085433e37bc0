"""Mapping files are validated on load; errors name the file and the key."""

from pathlib import Path

import pytest

from parity.errors import MappingError
from parity.mapping import builtin_mapping_dir, builtin_mappings, load_mapping, mapping_for_model_type

GPT2 = (builtin_mapping_dir() / "gpt2.toml").read_text()


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "m.toml"
    path.write_text(text)
    return path


def test_builtin_mappings_cover_the_families():
    mappings = builtin_mappings()
    assert {"gpt2", "openai-gpt", "llama", "mistral", "qwen2", "gemma"} <= set(mappings)
    assert mappings["gpt2"].default_checkpoint == "openai-community/gpt2"
    assert mapping_for_model_type("gemma3_text").name == "gemma"
    assert mapping_for_model_type("gemma2").name == "gemma"
    for mapping in mappings.values():
        assert mapping.default_checkpoint and mapping.synthetic_config["model_type"] in mapping.model_types


def test_gpt2_routes_transpose_conv1d():
    routes = {r.target: r for r in builtin_mappings()["gpt2"].tensors}
    assert routes["_layer1.weight"].transform == "transpose" and routes["_layer1.weight"].source == "c_fc.weight"
    assert routes["_layer1.bias"].transform == "none"


@pytest.mark.parametrize("edit, key", [
    (lambda t: t.replace("[tensors]", "[tensors]\nbogus_top = 1\n[x]"), "x"),
    (lambda t: 'extra_top_level = 1\n' + t, "extra_top_level"),
    (lambda t: t.replace('layer_key = "h.{layer}.mlp"', 'layer_key = "h.mlp"'), "checkpoint.layer_key"),
    (lambda t: t.replace('transform = "transpose" }', 'transform = "flip" }', 1), 'tensors."_layer1.weight".transform'),
    (lambda t: t.replace('name = "gpt2"\n', ''), "name"),
    (lambda t: t.replace('class = "parity.ffn:FeedForward"', 'class = "FeedForward"'), "target.class"),
    (lambda t: t.replace('"_layer1.bias" = "c_fc.bias"', '"_layer1.bias" = { from = "c_fc.bias", colour = 1 }'),
     'tensors."_layer1.bias".colour'),
])
def test_invalid_mapping_names_file_and_key(tmp_path, edit, key):
    path = write(tmp_path, edit(GPT2))
    with pytest.raises(MappingError) as info:
        load_mapping(path)
    assert str(path) in str(info.value) and f"'{key}'" in str(info.value)


def test_invalid_toml_names_the_line(tmp_path):
    path = write(tmp_path, GPT2.replace('name = "gpt2"', 'name = "gpt2'))
    with pytest.raises(MappingError, match=r"invalid TOML.*line"):
        load_mapping(path)


def test_valid_copy_loads(tmp_path):
    assert load_mapping(write(tmp_path, GPT2)).name == "gpt2"
