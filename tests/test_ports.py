"""Real ports with --target alone: FFN classes written in the style of published from-scratch and framework code
(dict configs, their own parameter names, nn.Sequential, [in, out] bare weights), written for this project.
Each correct one passes with --target alone; each broken variant is named; a module parity cannot route gets a
template whose hints, followed literally, lead to a pass."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import parity

from .support import run_main

HERE = __name__


# -- dict configs (cfg["emb_dim"], cfg["hidden_dim"], cfg["dtype"]) -----------------------------------------------

class OwnGELU(nn.Module):
    def forward(self, x):
        return 0.5 * x * (1 + torch.tanh(torch.sqrt(torch.tensor(2.0 / torch.pi)) * (x + 0.044715 * x.pow(3))))


class DictGPTFeedForward(nn.Module):
    """A GPT-2 FFN of book code: a cfg dict, nn.Sequential(Linear, its own GELU, Linear) named `layers`."""

    def __init__(self, cfg):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(cfg["emb_dim"], 4 * cfg["emb_dim"]), OwnGELU(),
                                    nn.Linear(4 * cfg["emb_dim"], cfg["emb_dim"]))

    def forward(self, x):
        return self.layers(x)


class DictGatedFeedForward(nn.Module):
    """A LLaMA/Qwen FFN of book code: fc1 (gate), fc2 (up), fc3 (down), built in cfg["dtype"]."""

    def __init__(self, cfg):
        super().__init__()
        self.fc1 = nn.Linear(cfg["emb_dim"], cfg["hidden_dim"], dtype=cfg["dtype"], bias=False)
        self.fc2 = nn.Linear(cfg["emb_dim"], cfg["hidden_dim"], dtype=cfg["dtype"], bias=False)
        self.fc3 = nn.Linear(cfg["hidden_dim"], cfg["emb_dim"], dtype=cfg["dtype"], bias=False)

    def act(self, x):
        return F.silu(x)

    def forward(self, x):
        return self.fc3(self.act(self.fc1(x)) * self.fc2(x))


class DictGeGLU(DictGatedFeedForward):
    def act(self, x):
        return F.gelu(x, approximate="tanh")


class SwappedDictGated(DictGatedFeedForward):
    def forward(self, x):
        return self.fc3(self.act(self.fc2(x)) * self.fc1(x))


class ExactGeluDictGPT(DictGPTFeedForward):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.layers[1] = nn.GELU()


# -- a framework's config object, its own names -------------------------------------------------------------------

class FrameworkMLP(nn.Module):
    """In the style of a fine-tuning framework: config.n_embd, config.intermediate_size, config.bias; fc_1/fc_2/proj."""

    def __init__(self, config):
        super().__init__()
        self.fc_1 = nn.Linear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.fc_2 = nn.Linear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.proj = nn.Linear(config.intermediate_size, config.n_embd, bias=config.bias)

    def forward(self, x):
        return self.proj(F.silu(self.fc_1(x)) * self.fc_2(x))


# -- interpretability style: bare [in, out] parameters, zero biases -----------------------------------------------

class InOutMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d, m = cfg["d_model"], cfg["d_mlp"]
        self.W_in, self.b_in = nn.Parameter(torch.empty(d, m)), nn.Parameter(torch.zeros(m))
        self.W_out, self.b_out = nn.Parameter(torch.empty(m, d)), nn.Parameter(torch.zeros(d))

    def forward(self, x):
        return F.gelu(x @ self.W_in + self.b_in, approximate="tanh") @ self.W_out + self.b_out


class InOutGatedMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d, m = cfg["d_model"], cfg["d_mlp"]
        self.W_gate, self.W_in = nn.Parameter(torch.empty(d, m)), nn.Parameter(torch.empty(d, m))
        self.W_out = nn.Parameter(torch.empty(m, d))
        self.b_in, self.b_out = nn.Parameter(torch.zeros(m)), nn.Parameter(torch.zeros(d))

    def forward(self, x):
        return (F.silu(x @ self.W_gate) * (x @ self.W_in + self.b_in)) @ self.W_out + self.b_out


# -- plain values: llama2.c's FeedForward(dim, hidden_dim, multiple_of, dropout), timm's Mlp(in_features, ...) ------

class PlainValuesFeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, multiple_of: int, dropout: float):
        super().__init__()
        if hidden_dim is None:
            hidden_dim = multiple_of * ((int(2 * 4 * dim / 3) + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.w2(F.silu(self.w1(x)) * self.w3(x)))


class PlainValuesMlp(nn.Module):
    """Defaults for another model's size: bound by name they are the checkpoint's, never the defaults."""

    def __init__(self, in_features=768, hidden_features=3072, bias=True, drop=0.1):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features, bias=bias)
        self.fc2 = nn.Linear(hidden_features, in_features, bias=bias)
        self.drop = nn.Dropout(drop)

    def forward(self, x):
        return self.drop(self.fc2(self.drop(F.gelu(self.fc1(x), approximate="tanh"))))


class DropoutOnPlainValues(PlainValuesFeedForward):
    def __init__(self, dim: int, hidden_dim: int, multiple_of: int, dropout: float):
        super().__init__(dim, hidden_dim, multiple_of, dropout)
        self.dropout = nn.Dropout(0.3)

    def train(self, mode=True):  # a port that forces training mode keeps dropout on
        return super().train(True)


CORRECT = [("gpt2", "DictGPTFeedForward"), ("llama", "DictGatedFeedForward"), ("qwen2", "DictGatedFeedForward"),
           ("gemma3_text", "DictGeGLU"), ("qwen2", "FrameworkMLP"), ("llama", "FrameworkMLP"),
           ("gpt2", "InOutMLP"), ("llama", "InOutGatedMLP"), ("llama", "PlainValuesFeedForward"),
           ("qwen2", "PlainValuesFeedForward"), ("gpt2", "PlainValuesMlp")]
BROKEN = [("llama", "SwappedDictGated", "gate_up_swapped"), ("gpt2", "ExactGeluDictGPT", "gelu_exact_instead_of_tanh"),
          ("llama", "DropoutOnPlainValues", "dropout_active")]


@pytest.mark.parametrize(("family", "cls"), CORRECT, ids=[f"{f}-{c}" for f, c in CORRECT])
def test_a_correct_port_passes_with_target_alone(tiny, family, cls, capsys):
    code, out, err = run_main(capsys, tiny[family], "--layers", "0,1", "--target", f"{HERE}:{cls}")
    assert code == 0, out + err
    assert "diagnosis" not in out


@pytest.mark.parametrize(("family", "cls", "mistake"), BROKEN, ids=[c for _, c, _ in BROKEN])
def test_a_broken_port_is_named(tiny, family, cls, mistake, capsys):
    code, out, _ = run_main(capsys, tiny[family], "--layer", "1", "--target", f"{HERE}:{cls}")
    assert code == 1 and f"MISMATCH — {mistake}" in out
    if mistake == "dropout_active":  # no replay: the evidence is the two runs
        assert "evidence: two runs on the same input differ by" in out and "replay" not in out


def test_a_dict_config_gets_float32_and_the_notes_say_so(tiny):
    report = parity.check(str(tiny["llama"]), layers=[0], target=DictGatedFeedForward)
    assert report.passed
    assert any("`dtype`" in note and "float32" in note for note in report.notes), report.notes
    assert any("`emb_dim`" in note for note in report.notes)


def test_bare_biases_without_tensors_are_declared_zero(tiny):
    report = parity.check(str(tiny["llama"]), layers=[0], target=InOutGatedMLP)
    assert report.passed
    assert report.routes["tensors"]["b_in"] == {"zeros": True}
    assert any("'b_in' set to zero: the checkpoint has no tensor for it" in note for note in report.notes)


# -- a module parity cannot route: a template whose hints lead to a pass -------------------------------------------

class Unnamed(nn.Module):
    """Names in no table; nn.Linear weights on a Conv1D ([in, out]) GPT-2 checkpoint."""

    def __init__(self, config):
        super().__init__()
        self.alpha = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.omega = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x):
        return self.omega(F.gelu(self.alpha(x), approximate="tanh"))


def test_the_template_proposes_the_transposed_tensor_and_following_it_passes(tiny, tmp_path, capsys):
    code, _, err = run_main(capsys, tiny["gpt2"], "--layer", "0", "--target", f"{HERE}:Unnamed")
    assert code == 2
    lines = {m[1]: m[2] for m in re.finditer(r'^"?([\w.]+)"? = "\?"\s+# \[[\d, ]+\]: (.*)$', err, re.M)}
    assert lines["alpha.weight"] == '{ from = "c_fc.weight", transform = "transpose" } (c_fc.weight, transposed)'
    assert lines["omega.weight"].startswith('{ from = "c_proj.weight", transform = "transpose" }')
    template = err[err.index("extends = "):err.index("parity: error:")]
    followed = []
    for line in template.splitlines():  # each "?" replaced by what its comment says
        m = re.match(r'^("?[\w.]+"?) = "\?"\s+# \[[\d, ]+\]: '
                     r'(\{ from = "[^"]+"(?:, transform = "transpose")? \}|"[^"]+")', line)
        followed.append(f"{m[1]} = {m[2]}" if m else line)
    mapping = tmp_path / "followed.toml"
    mapping.write_text("\n".join(followed) + "\n")
    code, out, err = run_main(capsys, tiny["gpt2"], "--layers", "0,1", "--target", f"{HERE}:Unnamed", "--mapping",
                              mapping)
    assert code == 0, out + err


def test_zeros_in_a_mapping_file(tiny, tmp_path, capsys):
    mapping = tmp_path / "m.toml"
    mapping.write_text(f'extends = "llama"\n[target]\nclass = "{HERE}:InOutGatedMLP"\nargs = {{ cfg = "config" }}\n'
                       '[tensors]\nW_gate = { from = "gate_proj.weight", transform = "transpose" }\n'
                       'W_in = { from = "up_proj.weight", transform = "transpose" }\n'
                       'W_out = { from = "down_proj.weight", transform = "transpose" }\n'
                       'b_in = { zeros = true }\nb_out = { zeros = true }\n')
    code, out, err = run_main(capsys, tiny["llama"], "--layer", "0", "--mapping", mapping)
    assert code == 0, out + err
    bad = tmp_path / "bad.toml"
    bad.write_text(mapping.read_text().replace("b_out = { zeros = true }", "b_out = { zeros = false }"))
    code, _, err = run_main(capsys, tiny["llama"], "--layer", "0", "--mapping", bad)
    assert code == 2 and "expected exactly { zeros = true }" in err


assert sys.modules[__name__]  # the classes above are importable as tests.test_ports:Name


def test_save_mapping_writes_the_template_when_routes_are_refused(tiny, tmp_path, capsys):
    target = tmp_path / "todo.toml"
    code, _, err = run_main(capsys, tiny["gpt2"], "--layer", "0", "--target", f"{HERE}:Unnamed", "--save-mapping",
                            target)
    assert code == 2 and f"wrote the mapping to complete to {target}" in err
    text = target.read_text()
    assert text.startswith("# Written by `parity --save-mapping`") and '"alpha.weight" = "?"' in text
    code, _, err = run_main(capsys, tiny["gpt2"], "--layer", "0", "--mapping", target)
    assert code == 2 and "placeholder" in err  # the saved template still says what is left to fill in


class ReadsConfigInForward(nn.Module):
    """Keeps its config and reads a field at call time that the checkpoint's config does not have."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate=self.config.gelu_approximate))


def test_a_config_field_read_in_forward_gets_the_same_fix(tiny, capsys):
    code, _, err = run_main(capsys, tiny["gpt2"], "--layer", "0", "--target", f"{HERE}:ReadsConfigInForward")
    assert code == 2
    assert "reads config.gelu_approximate in forward" in err and "def make_ffn(config)" in err


# -- a project's own config class: built from the checkpoint's config ---------------------------------------------

@dataclass
class PortConfig:
    """A framework-style config class with its own field names and defaults."""

    emb_dim: int
    hidden_dim: int
    n_heads: int = 1
    add_bias: bool = True
    drop_rate: float = 0.1


class ConfigClassMLP(nn.Module):
    def __init__(self, cfg: PortConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.emb_dim, cfg.hidden_dim, bias=cfg.add_bias)
        self.fc2 = nn.Linear(cfg.emb_dim, cfg.hidden_dim, bias=cfg.add_bias)
        self.fc3 = nn.Linear(cfg.hidden_dim, cfg.emb_dim, bias=cfg.add_bias)
        self.drop = nn.Dropout(cfg.drop_rate)

    def forward(self, x):
        return self.drop(self.fc3(F.silu(self.fc1(x)) * self.fc2(x)))


@dataclass
class NeedsVocab:
    emb_dim: int
    secret_sauce: int


class NeedsVocabMLP(ConfigClassMLP):
    def __init__(self, cfg: NeedsVocab):
        super().__init__(PortConfig(cfg.emb_dim, 4 * cfg.emb_dim))


def test_a_project_config_class_is_built_from_the_checkpoint_config(tiny):
    report = parity.check(str(tiny["llama"]), layers=[0, 1], target=ConfigClassMLP)
    assert report.passed, [r.diagnosis for r in report.layers]
    built = next(n for n in report.notes if n.startswith("target config: built"))
    assert "PortConfig(emb_dim=32, hidden_dim=88" in built and "drop_rate=0.0" in built


def test_a_config_class_field_nobody_answers_is_named(tiny, capsys):
    code, _, err = run_main(capsys, tiny["llama"], "--layer", "0", "--target", f"{HERE}:NeedsVocabMLP")
    assert code == 2 and "secret_sauce" in err and "NeedsVocab" in err


class ClassicNamesThreeMatrices(nn.Module):
    """Three matrices that fit a gated checkpoint, named as a classic FFN's would be (w_in, w_out, fc)."""

    def __init__(self, config):
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        self.fc = nn.Linear(d, f, bias=False)
        self.w_in = nn.Linear(d, f, bias=False)
        self.w_out = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.w_out(F.silu(self.fc(x)) * self.w_in(x))


def test_a_module_whose_shapes_fit_is_not_told_it_is_the_wrong_kind(tiny, capsys):
    code, _, err = run_main(capsys, tiny["llama"], "--layer", "0", "--target", f"{HERE}:ClassicNamesThreeMatrices")
    assert code == 2  # the names cannot say which is gate and which is up: a template, never a guess
    assert "cannot compute them" not in err and '"fc.weight" = "?"' in err


class ReducesHiddenDim(nn.Module):
    """Reads cfg["hidden_dim"] as Meta's ModelArgs means it (4d, reduced by 2/3 inside), not as d_ff."""

    def __init__(self, cfg):
        super().__init__()
        hidden = 64 * ((int(2 * cfg["hidden_dim"] / 3) + 63) // 64)
        self.w1 = nn.Linear(cfg["dim"], hidden, bias=False)
        self.w2 = nn.Linear(hidden, cfg["dim"], bias=False)
        self.w3 = nn.Linear(cfg["dim"], hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def test_a_module_built_to_the_wrong_size_from_supplied_values_is_exit_2_not_a_diagnosis(tiny, capsys):
    code, out, err = run_main(capsys, tiny["llama"], "--layer", "0", "--target", f"{HERE}:ReducesHiddenDim")
    assert code == 2 and "MISMATCH" not in out
    assert "built with config values parity supplied" in err and "hidden_dim" in err and "make_ffn" in err


class ModuleBuilderFFN(nn.Module):
    """A library FFN built from the modules passed in (torchtune's style): keyword-only projections, an activation."""

    def __init__(self, *, gate_proj: nn.Module, down_proj: nn.Module, up_proj: nn.Module, activation=None):
        super().__init__()
        self.w1, self.w2, self.w3 = gate_proj, down_proj, up_proj
        self.activation = activation or nn.SiLU()

    def forward(self, x):
        return self.w2(self.activation(self.w1(x)) * self.w3(x))


def test_a_builder_taking_modules_gets_them_built(tiny, tmp_path, capsys):
    report = parity.check(str(tiny["llama"]), layers=[0, 1], target=ModuleBuilderFFN)
    assert report.passed, [r.diagnosis for r in report.layers]
    saved = tmp_path / "m.toml"
    assert run_main(capsys, tiny["llama"], "--layer", "0", "--target", f"{HERE}:ModuleBuilderFFN", "--save-mapping",
                    saved)[0] == 0
    assert run_main(capsys, tiny["llama"], "--layer", "1", "--mapping", saved)[0] == 0  # the saved mapping repeats it


class ConstructorBug(nn.Module):
    def __init__(self, config):
        super().__init__()
        raise RuntimeError("my own constructor bug")


class ForwardBug(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x):
        return self.c_proj(self.c_fc(x).t())  # a shape bug of its own


def test_a_failure_in_the_users_code_points_at_their_line_not_at_the_arguments(tiny, capsys):
    code, _, err = run_main(capsys, tiny["gpt2"], "--layer", "0", "--target", f"{HERE}:ConstructorBug")
    assert code == 2 and "failed in its constructor" in err and "my own constructor bug" in err
    assert "test_ports.py:" in err and "in __init__" in err and "[target].args" not in err
    code, _, err = run_main(capsys, tiny["gpt2"], "--layer", "0", "--target", f"{HERE}:ForwardBug")
    assert code == 2 and "test_ports.py:" in err and "in forward" in err


class GroupPlusGain(DictGatedFeedForward):
    """fc1/fc2/fc3 plus a parameter of its own: refused with that parameter named first, not with the names'
    other readings (fc1 as a classic first layer)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.gain_bias = nn.Parameter(torch.zeros(cfg["emb_dim"]))

    def forward(self, x):
        return super().forward(x) * (1 + self.gain_bias)


def test_a_group_plus_an_extra_parameter_names_the_extra_one(tiny, capsys):
    code, _, err = run_main(capsys, tiny["llama"], "--layer", "0", "--target", f"{HERE}:GroupPlusGain")
    last = err.strip().splitlines()[-1]
    assert code == 2 and "'gain_bias' belongs to no projection" in last and "reads as fc_in" not in last
    assert '"fc1.weight" = "gate_proj.weight"' in err  # the template keeps what the group says


def test_plain_values_are_bound_by_name_and_each_is_a_note(tiny):
    report = parity.check(str(tiny["gpt2"]), layers=[0], target=PlainValuesMlp)
    assert report.passed
    notes = "\n".join(report.notes)
    assert "in_features=32 (GPT2Config.hidden_size)" in notes and "drop=0.0" in notes and "bias=True" in notes


def test_a_meta_checkpoint_and_metas_feed_forward_get_metas_own_call(tmp_path, capsys, monkeypatch):
    """Meta's FeedForward keeps 2/3 of its hidden_dim; its own TransformerBlock passes 4 * dim with params.json's
    multiple_of, and that is the factory printed for a Meta checkpoint."""
    from .builders import write_meta

    folder = write_meta(tmp_path / "meta", dim=64, multiple_of=32)
    code, _, err = run_main(capsys, str(folder), "--allow-pickle", "--layer", "0",
                            "--target", "tests.builders:FeedForward")
    assert code == 2
    factory = err[err.index("def make_ffn(config):"):].strip()
    assert "hidden_dim=4 * config.hidden_size, multiple_of=config.multiple_of" in factory, factory
    (tmp_path / "meta_factory.py").write_text(f"from tests.builders import FeedForward\n\n\n{factory}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, err = run_main(capsys, str(folder), "--allow-pickle", "--layer", "0",
                              "--target", "meta_factory:make_ffn")
    assert code == 0, out + err


# -- more framework conventions: litgpt's gelu_approximate, torchtune's optional up_proj, gemma_pytorch's quant,
# -- TransformerLens' Union[Dict, Config] with required fields -----------------------------------------------

@dataclass
class ApproximateConfig:
    """In the style of litgpt's Config: its own default for the GELU form, which the checkpoint must decide."""

    n_embd: int = 4096
    intermediate_size: int = 11008
    bias: bool = False
    gelu_approximate: str = "none"


class ApproximateGemmaMLP(nn.Module):
    def __init__(self, config: ApproximateConfig):
        super().__init__()
        self.fc_1 = nn.Linear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.fc_2 = nn.Linear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.proj = nn.Linear(config.intermediate_size, config.n_embd, bias=config.bias)
        self.approximate = config.gelu_approximate

    def forward(self, x):
        return self.proj(F.gelu(self.fc_1(x), approximate=self.approximate) * self.fc_2(x))


class ModulesWithOptionalUp(nn.Module):
    """In the style of torchtune's FeedForward(*, gate_proj, down_proj, up_proj=None, activation=nn.SiLU())."""

    def __init__(self, *, gate_proj: nn.Module, down_proj: nn.Module, up_proj: nn.Module | None = None,
                 activation: nn.Module | None = None):
        super().__init__()
        self.w1, self.w2, self.w3, self.activation = gate_proj, down_proj, up_proj, activation or nn.SiLU()

    def forward(self, x):
        h = self.activation(self.w1(x))
        return self.w2(h * self.w3(x) if self.w3 is not None else h)


class QuantFlagMLP(nn.Module):
    """In the style of gemma_pytorch's GemmaMLP(hidden_size, intermediate_size, quant)."""

    def __init__(self, hidden_size: int, intermediate_size: int, quant: bool):
        super().__init__()
        assert not quant, "an int8 module: its weights are not the checkpoint's"
        self.gate_proj = nn.Linear(hidden_size, intermediate_size)
        self.up_proj = nn.Linear(hidden_size, intermediate_size)
        self.down_proj = nn.Linear(intermediate_size, hidden_size)

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


@dataclass
class LensConfig:
    """In the style of TransformerLens' HookedTransformerConfig: required fields a transformers config names
    otherwise or lacks (n_ctx, d_head, act_fn)."""

    n_layers: int
    d_model: int
    n_ctx: int
    d_head: int
    act_fn: str | None = None
    d_mlp: int | None = None

    @classmethod
    def unwrap(cls, cfg):
        return cls(**cfg) if isinstance(cfg, dict) else cfg


class LensMLP(nn.Module):
    def __init__(self, cfg: dict | LensConfig):  # TransformerLens writes Union[Dict, HookedTransformerConfig]
        super().__init__()
        self.cfg = LensConfig.unwrap(cfg)
        d, m = self.cfg.d_model, self.cfg.d_mlp
        self.W_in, self.b_in = nn.Parameter(torch.empty(d, m)), nn.Parameter(torch.zeros(m))
        self.W_out, self.b_out = nn.Parameter(torch.empty(m, d)), nn.Parameter(torch.zeros(d))
        self.act = {"gelu_new": lambda z: F.gelu(z, approximate="tanh"), "gelu": F.gelu}[self.cfg.act_fn]

    def forward(self, x):
        return self.act(x @ self.W_in + self.b_in) @ self.W_out + self.b_out


@pytest.mark.parametrize(("family", "cls"), [("gemma3_text", "ApproximateGemmaMLP"), ("llama", "ModulesWithOptionalUp"),
                                             ("gemma", "QuantFlagMLP"), ("gpt2", "LensMLP")])
def test_a_framework_convention_passes_with_target_alone(tiny, family, cls, capsys):
    """The config class's own default (gelu_approximate = "none") is the checkpoint's to decide; an optional
    projection module is built when its kind is the checkpoint's; quant is false; a Union's own class is built."""
    code, out, err = run_main(capsys, tiny[family], "--layers", "0,1", "--target", f"{HERE}:{cls}")
    assert code == 0, out + err


def test_an_unanswered_plain_parameter_gets_a_placeholder_that_is_not_python(tiny, capsys):
    code, _, err = run_main(capsys, tiny["llama"], "--layer", "0", "--target", f"{HERE}:NeedsAMode")
    assert code == 2 and "mode=<mode>" in err and "mode=..." not in err, err


class NeedsAMode(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, mode: str):
        super().__init__()
        self.w1, self.w2, self.w3 = (nn.Linear(dim, hidden_dim, bias=False), nn.Linear(hidden_dim, dim, bias=False),
                                     nn.Linear(dim, hidden_dim, bias=False))
