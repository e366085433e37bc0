"""A target constructor that reads config fields transformers' config lacks: parity's read-only config view
(parity/engine/check/config_view.py, aliases.toml [config_fields]) answers them, and says so in the report."""

import textwrap
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig

from parity.definitions.aliases import aliases_path, load_aliases
from parity.definitions.registry import builtin_mappings
from parity.engine.check.arguments import checkpoint_ffn_bias, checkpoint_ffn_width
from parity.engine.check.config_view import config_view
from parity.errors import MappingError
from tests.conftest import TINY
from tests.support import run_json

NANOGPT_MLP = '''
import torch.nn as nn


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc    = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu    = nn.GELU({gelu})
        self.c_proj  = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)
    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class ReadsAnUnknownField(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, config.frobnicate_width)
'''
FIELDS = load_aliases().config_fields
BIAS_NOTE = "target config: `bias` not in GPT2Config, supplied True (the checkpoint has FFN biases"
DROPOUT_NOTE = "target config: `dropout` not in GPT2Config, supplied 0.0 (parity runs the module in eval mode)"


@pytest.fixture(scope="module")
def gpt2_checkpoint(tmp_path_factory) -> Path:
    """A tiny GPT-2 saved by transformers itself (Conv1D weights stored [in, out], biases, gelu_new)."""
    config = GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=64, vocab_size=64, bos_token_id=0,
                        eos_token_id=0)
    torch.manual_seed(3)
    model = GPT2LMHeadModel._from_config(config)
    with torch.no_grad():  # distinct values everywhere, biases included (transformers inits them to 0)
        for param in model.parameters():
            param.normal_(0.0, 0.05)
    folder = tmp_path_factory.mktemp("gpt2") / "ckpt"
    model.save_pretrained(folder)
    return folder


def write_module(folder: Path, name: str, gelu: str) -> str:
    (folder / f"{name}.py").write_text(textwrap.dedent(NANOGPT_MLP).replace("{gelu}", gelu))
    return name


# -- end to end: nanoGPT's MLP, verbatim, with --target alone -------------------------------------------------

def test_verbatim_nanogpt_mlp_builds_and_its_exact_gelu_is_diagnosed(gpt2_checkpoint, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # `mod:MLP` is imported from the working directory, as in a shell
    module = write_module(tmp_path, "nanogpt_exact_cv", "")
    code, report, err = run_json(capsys, "gpt2", "--checkpoint", gpt2_checkpoint, "--target", f"{module}:MLP")
    assert code == 1, err  # built and run: no construction error, the layers deviate
    assert "cannot construct" not in err
    assert report["routes"]["inferred"] is True
    assert report["routes"]["tensors"]["c_fc.weight"] == {"from": "c_fc.weight", "transform": "transpose"}
    assert report["routes"]["tensors"]["c_proj.bias"] == "c_proj.bias"
    assert [layer["diagnosis"]["id"] for layer in report["layers"]] == ["gelu_exact_instead_of_tanh"] * 2
    assert any(note.startswith(BIAS_NOTE) for note in report["notes"]), report["notes"]
    assert DROPOUT_NOTE in report["notes"]
    assert BIAS_NOTE in err  # the table (on stderr with --json -) shows the notes too


def test_verbatim_nanogpt_mlp_with_the_tanh_gelu_passes(gpt2_checkpoint, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    module = write_module(tmp_path, "nanogpt_tanh_cv", 'approximate="tanh"')
    code, report, err = run_json(capsys, "gpt2", "--checkpoint", gpt2_checkpoint, "--target", f"{module}:MLP",
                            "--save-mapping", tmp_path / "saved.toml")
    assert code == 0, err
    assert report["passed"] is True and len(report["layers"]) == 2
    assert any(note.startswith(BIAS_NOTE) for note in report["notes"])
    # the saved mapping names the transformers config as the argument; the view answers bias/dropout again
    code, again, err = run_json(capsys, "gpt2", "--checkpoint", gpt2_checkpoint, "--mapping", tmp_path / "saved.toml")
    assert code == 0, err
    assert any(note.startswith(BIAS_NOTE) for note in again["notes"])


def test_a_field_neither_config_nor_table_has_is_a_clear_error(gpt2_checkpoint, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    module = write_module(tmp_path, "nanogpt_unknown_cv", "")
    code, _, err = run_json(capsys, "gpt2", "--checkpoint", gpt2_checkpoint, "--target",
                            f"{module}:ReadsAnUnknownField")
    assert code == 2
    assert "config.frobnicate_width" in err and "GPT2Config" in err
    assert "factory" in err and "[target].args" in err
    assert "Traceback" not in err


# -- the view itself ----------------------------------------------------------------------------------------------

def gpt2_config() -> GPT2Config:
    return GPT2Config(n_embd=32, n_layer=2, n_head=2)


def test_view_answers_missing_fields_and_notes_each():
    config = gpt2_config()
    view = config_view(config, FIELDS, {"ffn_bias": (True, "the checkpoint has FFN biases"), "ffn_width": None})
    assert view.n_embd == 32 and view.hidden_size == 32 and view.n_head == 2  # the config's own (attribute_map too)
    assert view.supplied == []  # nothing supplied for fields the config has
    assert view.dim == 32 and view.d_model == 32  # aliases of hidden_size
    assert view.bias is True and view.dropout == 0.0
    assert [s.field for s in view.supplied] == ["dim", "d_model", "bias", "dropout"]
    assert view.notes()[2] == "target config: `bias` not in GPT2Config, supplied True (the checkpoint has FFN biases)"
    assert "supplied 32 (GPT2Config.hidden_size" in view.notes()[0]


def test_view_unknown_field_raises_attribute_error_naming_it():
    view = config_view(gpt2_config(), FIELDS, {"ffn_bias": (True, "why"), "ffn_width": None})
    with pytest.raises(AttributeError, match="frobnicate") as caught:
        view.frobnicate  # noqa: B018
    assert caught.value.name == "frobnicate"
    with pytest.raises(AttributeError, match="hidden_dim"):  # a fact parity does not know: no answer
        view.hidden_dim  # noqa: B018
    assert not hasattr(view, "frobnicate") and getattr(view, "frobnicate", "default") == "default"


def test_view_is_read_only_and_leaves_the_config_alone():
    config = gpt2_config()
    view = config_view(config, FIELDS, {"ffn_bias": (True, "why")})
    with pytest.raises(AttributeError, match="read-only"):
        view.bias = False
    with pytest.raises(AttributeError, match="read-only"):
        del view.n_embd
    assert not hasattr(config, "bias") and config.n_embd == 32


def test_view_aliases_resolve_on_a_llama_config():
    config = LlamaConfig(hidden_size=32, intermediate_size=88, num_hidden_layers=1, num_attention_heads=2)
    view = config_view(config, FIELDS, {"ffn_bias": (False, "no biases"), "ffn_width": checkpoint_ffn_width(config)})
    assert (view.dim, view.n_embd, view.hidden_dim, view.ffn_dim, view.d_ff) == (32, 32, 88, 88, 88)
    assert view.mlp_bias is False and view.bias is False
    assert [s.field for s in view.supplied] == ["dim", "n_embd", "hidden_dim", "ffn_dim", "d_ff", "bias"]


def test_aliases_agree_with_the_fields_configs_already_have():
    """A name the view answers by alias must mean the same where a transformers config has it natively (or through
    its attribute_map): the view never overrides the config, so a disagreement would make the alias a lie."""
    from transformers import AutoConfig

    fields = load_aliases().config_fields
    for model_type, sizes in TINY.items():
        config = AutoConfig.for_model(model_type, **{k: v for k, v in sizes.items() if k != "model_type"})
        for name, own in fields.aliases.items():
            if hasattr(config, name) and getattr(config, name) is not None and hasattr(config, own):
                assert getattr(config, name) == getattr(config, own), (model_type, name, own)


def test_ffn_width_is_what_transformers_builds():
    """GPT-2 leaves n_inner unset (4d); a module reading config.intermediate_size or hidden_dim gets that width."""
    assert checkpoint_ffn_width(gpt2_config()) == (128, "GPT2Config.n_inner is unset: transformers builds 4 x hidden "
                                                        "size")
    assert checkpoint_ffn_width(GPT2Config(n_embd=32, n_inner=80))[0] == 80
    llama = LlamaConfig(hidden_size=32, intermediate_size=88, num_hidden_layers=1, num_attention_heads=2)
    assert checkpoint_ffn_width(llama) == (88, "LlamaConfig.intermediate_size")
    facts = {"ffn_bias": (True, "why"), "ffn_width": checkpoint_ffn_width(gpt2_config())}
    view = config_view(gpt2_config(), FIELDS, facts)
    assert view.intermediate_size == 128 and view.hidden_dim == 128
    assert "`intermediate_size` not in GPT2Config, supplied 128 (GPT2Config.n_inner is unset" in view.notes()[0]


def test_checkpoint_ffn_bias_from_the_mapping():
    mappings = builtin_mappings()
    assert checkpoint_ffn_bias(mappings["gpt2"], gpt2_config())[0] is True
    llama = LlamaConfig(hidden_size=32, intermediate_size=88, num_hidden_layers=1, num_attention_heads=2)
    assert checkpoint_ffn_bias(mappings["llama"], llama)[0] is False
    llama.mlp_bias = True
    assert checkpoint_ffn_bias(mappings["llama"], llama) == (True, "the checkpoint has FFN biases: mapping 'llama' "
                                                                   "target.args.bias")
    assert checkpoint_ffn_bias(mappings["qwen2"], llama)[0] is False


def test_config_fields_table_gives_each_name_one_answer(tmp_path):
    text = aliases_path().read_text(encoding="utf-8")
    clash = tmp_path / "aliases.toml"
    clash.write_text(text.replace("\ndropout = {", '\nn_embd = { value = 1, why = "x" }\ndropout = {', 1))
    with pytest.raises(MappingError, match="'n_embd' is listed in"):
        load_aliases(clash)
    unknown = tmp_path / "unknown.toml"
    unknown.write_text(text.replace("ffn_bias = [", "ffn_colour = ["))
    with pytest.raises(MappingError, match="no such fact"):
        load_aliases(unknown)
