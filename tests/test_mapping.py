"""Mapping files are validated on load; errors name the file and the key."""

from pathlib import Path

import pytest

from parity.definitions.datafiles import builtin_mapping_dir
from parity.definitions.mapping_parser import load_mapping
from parity.definitions.registry import builtin_mappings, mapping_for_model_type
from parity.errors import MappingError

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
        if mapping.synthetic_config is not None:
            assert mapping.default_checkpoint and mapping.synthetic_config["model_type"] in mapping.model_types
    # the families checked by name work offline (synthetic stand-in); Mixtral is too large for one
    for name in ("gpt2", "openai-gpt", "llama", "mistral", "qwen2", "gemma", "phi3"):
        assert mappings[name].default_checkpoint and mappings[name].synthetic_config


def test_format_mappings_are_chosen_by_the_tensor_names_present():
    def holding(*names):
        return lambda name: name in names

    gguf = holding("blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight", "blk.0.ffn_down_exps.weight")
    meta = holding("layers.0.feed_forward.w1.weight", "layers.0.feed_forward.w2.weight",
                   "layers.0.feed_forward.w3.weight")
    hf = holding(*(f"model.layers.0.mlp.{n}_proj.weight" for n in ("gate", "up", "down")))
    # dense GGUF files have no mapping file: their layout is derived (tests/test_gguf_any_arch.py)
    assert mapping_for_model_type("mixtral", gguf).name == "mixtral-gguf"
    assert mapping_for_model_type("llama", meta).name == "llama-meta"
    assert mapping_for_model_type("llama", hf).name == "llama"
    # nothing fits: the HF mapping names what is missing
    assert mapping_for_model_type("llama", holding()).name == "llama"
    assert mapping_for_model_type("mixtral", holding("model.layers.0.mlp.experts.gate_up_proj",
                                                     "model.layers.0.mlp.experts.down_proj")).name == "mixtral-fused"


def test_expert_placeholder_needs_an_experts_table(tmp_path):
    text = GPT2.replace('layer_key = "h.{layer}.mlp"', 'layer_key = "h.{layer}.mlp.experts.{expert}"')
    with pytest.raises(MappingError, match="checkpoint.layer_key.*no \\[experts\\] table"):
        load_mapping(write(tmp_path, text))
    text += '\n[experts]\ncount = "config.n_experts"\ngate = "w1.weight"\nup = "w3.weight"\n'
    with pytest.raises(MappingError, match="'experts.down'"):
        load_mapping(write(tmp_path, text))


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


@pytest.mark.parametrize("value", ['"?"', '{ from = "?", transform = "transpose" }', '""'])
def test_unfilled_placeholder_is_named_not_looked_up(tmp_path, value):
    """The mapping parity prints for an ambiguous module leaves '?' where it could not tell: saved as is, it must
    say so, not look for a tensor called 'model.layers.0.mlp.?'."""
    path = write(tmp_path, 'extends = "llama"\n[tensors]\n"a.weight" = ' + value + "\n")
    with pytest.raises(MappingError, match=r":3: key 'tensors.\"a.weight\"': is still the placeholder"):
        load_mapping(path)
