"""Families no mapping file serves: their layout derived from transformers itself (parity/engine/layout/derive.py).

Each family is a tiny checkpoint built with transformers' own classes (AutoConfig.for_model + from_config +
save_pretrained).  For each: the default target passes (or is the documented one-line exit 2 where no module of
parity.ffn expresses the FFN), a port written the family's way passes with ``--target`` alone, a broken export
(written with safetensors) fails on the broken layer only and is named by ``parity compare``, and ``parity
compare A A`` passes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch.nn.functional as F
from torch import nn

from .derived_checkpoints import (
    KV,
    TwoLayer,
    assert_layer_one_named,
    broken_copy,
    build,
    build_all,
    one_line,
    tanh_gelu,
)
from .support import run_main

# model_type -> (config values beyond COMMON, the port --target names, the tensor a broken export changes in
# layer 1 (a pair: exchanged; one name: negated), the diagnosis compare must name)
FAMILIES = {
    "qwen3": (dict(intermediate_size=72, **KV), "gated_port", ("mlp.gate_proj", "mlp.up_proj"), "gate_up_exchanged"),
    "olmo2": (dict(intermediate_size=72, **KV), "gated_port", ("mlp.gate_proj", "mlp.up_proj"), "gate_up_exchanged"),
    "granite": (dict(intermediate_size=72, **KV), "gated_port", ("mlp.gate_proj", "mlp.up_proj"),
                "gate_up_exchanged"),
    "stablelm": (dict(intermediate_size=72, num_key_value_heads=2), "gated_port", ("mlp.gate_proj", "mlp.up_proj"),
                 "gate_up_exchanged"),
    "cohere": (dict(intermediate_size=72, num_key_value_heads=2), "gated_port", ("mlp.gate_proj", "mlp.up_proj"),
               "gate_up_exchanged"),
    "exaone4": (dict(intermediate_size=72, **KV), "gated_port", ("mlp.gate_proj", "mlp.up_proj"),
                "gate_up_exchanged"),
    "glm": (dict(intermediate_size=72, **KV), "gated_port", "mlp.down_proj", "sign_flipped"),  # gate_up fused
    "gptj": (dict(rotary_dim=8), "gptj_port", "mlp.fc_out", "sign_flipped"),
    "gpt_neox": (dict(intermediate_size=128), "neox_port", "mlp.dense_4h_to_h", "sign_flipped"),
    "opt": (dict(ffn_dim=128, word_embed_proj_dim=32), "opt_port", "fc2", "sign_flipped"),  # fc1/fc2 on the layer
    "phi": (dict(intermediate_size=128, num_key_value_heads=2), "phi_port", "mlp.fc2", "sign_flipped"),
    "falcon": (dict(), "falcon_port", "mlp.dense_4h_to_h", "sign_flipped"),  # no biases
    "starcoder2": (dict(intermediate_size=128, num_key_value_heads=2), "starcoder2_port", "mlp.c_proj",
                   "sign_flipped"),
    "gpt_bigcode": (dict(), "bigcode_port", "mlp.c_proj", "sign_flipped"),
    "gpt_neo": (dict(attention_types=[[["global", "local"], 1]], intermediate_size=None), "gpt_neo_port",
                "mlp.c_proj", "sign_flipped"),  # intermediate_size None: transformers' 4d
    "nemotron": (dict(intermediate_size=72, **KV), "relu2_port", "mlp.down_proj", "sign_flipped"),
    **{model_type: (dict(intermediate_size=72, **KV), "gated_port", ("mlp.gate_proj", "mlp.up_proj"),
                    "gate_up_exchanged")
       for model_type in ("olmo", "olmo3", "smollm3", "helium", "ministral", "seed_oss", "diffllama")},
    "codegen": (dict(rotary_dim=8), "gptj_port", "mlp.fc_out", "sign_flipped"),
    "biogpt": (dict(intermediate_size=128), "biogpt_port", "fc2", "sign_flipped"),  # fc1/fc2 on the layer
    "xglm": (dict(ffn_dim=128), "xglm_port", "fc2", "sign_flipped"),  # fc1/fc2 on the layer
    # its recurrent block reads d -> width -> d too (with a conv and gates of its own): the MLP is the one that holds
    # nothing but projections and an activation
    "recurrent_gemma": (dict(intermediate_size=72, num_key_value_heads=2, head_dim=16), "recurrent_gemma_port",
                        ("mlp_block.gate_proj", "mlp_block.up_proj"), "gate_up_exchanged"),
    # its FFNs are a list of their own beside the attentions' (transformer.ffns.{layer}: lin1, act, lin2)
    "xlm": (dict(), "xlm_port", "lin2", "sign_flipped"),
}
# no module of parity.ffn expresses these: the default target is exit 2, naming what parity.ffn lacks
REFUSED = {"nemotron": "it runs ReLUSquaredActivation, and parity.ffn.FeedForward runs ReLU, exact GELU or tanh GELU"}


@pytest.fixture(scope="session")
def families(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """model_type -> (its tiny checkpoint, a broken export of it)."""
    return build_all(tmp_path_factory.mktemp("derived"), FAMILIES, broken_copy)


# -- ports, written each family's way (the names its own ports use) ------------------------------------------------
class GatedPort(nn.Module):
    def __init__(self, config):
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        self.gate, self.up = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False)
        self.down = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


def gated_port(config):
    return GatedPort(config)


class BiasedGeGLU(nn.Module):
    """RecurrentGemma's MLP as a port writes it: biased gate/up/down, tanh GELU on the gate, d_ff half the config's."""

    def __init__(self, config):
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size // 2
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(d, f), nn.Linear(d, f), nn.Linear(f, d)

    def forward(self, x):
        return self.down_proj(tanh_gelu(self.gate_proj(x)) * self.up_proj(x))


def xlm_port(config):
    return TwoLayer(config.emb_dim, 4 * config.emb_dim, ("lin1", "lin2"), F.gelu)


def recurrent_gemma_port(config):
    return BiasedGeGLU(config)


def gptj_port(config):
    return TwoLayer(config.hidden_size, config.n_inner or 4 * config.hidden_size, ("fc_in", "fc_out"), tanh_gelu)


def neox_port(config):
    return TwoLayer(config.hidden_size, config.intermediate_size, ("dense_h_to_4h", "dense_4h_to_h"), F.gelu)


def falcon_port(config):
    return TwoLayer(config.hidden_size, config.ffn_hidden_size, ("dense_h_to_4h", "dense_4h_to_h"), F.gelu,
                    bias=False)


def opt_port(config):
    return TwoLayer(config.hidden_size, config.ffn_dim, ("fc1", "fc2"), F.relu)


def biogpt_port(config):
    return TwoLayer(config.hidden_size, config.intermediate_size, ("fc1", "fc2"), F.gelu)


def xglm_port(config):
    return TwoLayer(config.hidden_size, config.ffn_dim, ("fc1", "fc2"), F.gelu)


def phi_port(config):
    return TwoLayer(config.hidden_size, config.intermediate_size, ("fc1", "fc2"), tanh_gelu)


def starcoder2_port(config):
    return TwoLayer(config.hidden_size, config.intermediate_size, ("c_fc", "c_proj"), tanh_gelu)


def bigcode_port(config):
    return TwoLayer(config.hidden_size, 4 * config.hidden_size, ("c_fc", "c_proj"), tanh_gelu)


def gpt_neo_port(config):
    return TwoLayer(config.hidden_size, 4 * config.hidden_size, ("c_fc", "c_proj"), tanh_gelu)


def relu2_port(config):
    return TwoLayer(config.hidden_size, config.intermediate_size, ("up", "down"), lambda x: F.relu(x) ** 2,
                    bias=False)


# -- the checks ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_default_target(capsys, families, model_type):
    """The default target: the parity.ffn module the FFN's structure calls for passes every layer, and the header
    says where the layout came from; where none expresses it, exit 2 in one line saying what parity.ffn lacks."""
    code, out, err = run_main(capsys, families[model_type][0], "--layers", "all")
    if model_type in REFUSED:
        assert code == 2, out + err
        message = err.strip()
        assert "\n" not in message and REFUSED[model_type] in message
        assert "--target" in message and "parity compare A B" in message
        return
    assert code == 0, out + err
    header = out.splitlines()[0]
    assert "— mapping 'derived from transformers " in header
    assert "PASS: 2 layer(s)" in out


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_port_with_target_alone(capsys, families, model_type):
    """A port written with the names the family's own ports use passes with --target alone (routes read off its
    parameter names)."""
    port = FAMILIES[model_type][1]
    code, out, err = run_main(capsys, families[model_type][0], "--layers", "all", "--target",
                              f"tests.test_derived_families:{port}")
    assert code == 0, out + err
    assert "inferred from parameter names" in out
    assert "PASS: 2 layer(s)" in out


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_compare_broken_export(capsys, families, model_type):
    """B with layer 1 broken: layer 0 passes, layer 1 fails and is named."""
    assert_layer_one_named(capsys, *families[model_type], FAMILIES[model_type][3])


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_compare_with_itself(capsys, families, model_type):
    code, out, err = run_main(capsys, "compare", families[model_type][0], families[model_type][0])
    assert code == 0, out + err
    assert "PASS: 2 layer(s) of B bit-identical to A's" in out


class SwappedGatedPort(GatedPort):
    """The activation on the up branch instead of the gate's."""

    def forward(self, x):
        return self.down(self.gate(x) * F.silu(self.up(x)))


def swapped_port(config):
    return SwappedGatedPort(config)


def gpt2_port(config):
    return TwoLayer(config.n_embd, config.n_inner or 4 * config.n_embd, ("c_fc", "c_proj"), tanh_gelu)


@pytest.fixture(scope="session")
def refused(tmp_path_factory) -> dict[str, Path]:
    """Checkpoints whose default target or whose derivation is refused (exit 2, one line)."""
    root = tmp_path_factory.mktemp("refused")
    return {
        "starcoder2": build("starcoder2", root / "starcoder2", 0, intermediate_size=72, num_key_value_heads=2),
        "gpt2": build("gpt2", root / "gpt2", 1, n_inner=72),  # served by mappings/gpt2.toml
        "mamba": build("mamba", root / "mamba", 2, intermediate_size=72),
    }


@pytest.mark.parametrize("case, port, said", [
    ("starcoder2", "starcoder2_port", "its d_ff is 72, and parity.ffn.FeedForward's d_ff is always 4·d (128)"),
    ("gpt2", "gpt2_port", "GPT2MLP of this checkpoint: its d_ff is 72, and parity.ffn.FeedForward's d_ff is always"),
])
def test_classic_ffn_wider_or_narrower_than_4d(capsys, refused, case, port, said):
    """parity.ffn.FeedForward's d_ff is 4d: a classic FFN of another width is no failure of the checkpoint but what
    the repository lacks, in one line with the two ways on; a port of the right width passes, compare needs none."""
    code, out, err = run_main(capsys, refused[case], "--layers", "all")
    line = one_line(err)
    assert code == 2 and said in line and "--target" in line and "parity compare A B" in line, out + err
    code, out, err = run_main(capsys, refused[case], "--layers", "all", "--target",
                              f"tests.test_derived_families:{port}")
    assert code == 0 and "PASS: 2 layer(s)" in out, out + err
    code, out, err = run_main(capsys, "compare", refused[case], refused[case])
    assert code == 0, out + err


@pytest.mark.parametrize("case, said", [
    ("mamba", "MambaBlock holds no module whose projections read d -> d_ff -> d"),
])
def test_derivation_refused(capsys, refused, case, said):
    """Layouts this slice does not derive: exit 2, one line, for a check and a compare alike."""
    for args in ([refused[case]], ["compare", refused[case], refused[case]]):
        code, out, err = run_main(capsys, *args)
        line = one_line(err)
        assert code == 2 and f"no mapping serves model_type '{case}'" in line and said in line, out + err
        assert "--mapping FILE.toml" in line


def test_unknown_to_transformers(capsys, families, tmp_path):
    """A type transformers does not know: exit 2 naming the type and the installed transformers."""
    import transformers

    folder = tmp_path / "odd"
    shutil.copytree(families["qwen3"][0], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "nosuchfamily"}))
    code, out, err = run_main(capsys, folder)
    line = one_line(err)
    assert code == 2 and "model_type 'nosuchfamily'" in line
    assert f"transformers {transformers.__version__} installed here does not know it" in line


def test_broken_port_is_named(capsys, families):
    code, out, err = run_main(capsys, families["qwen3"][0], "--layer", "0", "--target",
                              "tests.test_derived_families:swapped_port")
    assert code == 1 and "gate_up_swapped" in out, out + err


def test_mapping_file_still_serves_and_overrides(capsys, families, tiny):
    """A type a mapping file serves is served by it; --mapping overrides a derived layout."""
    code, out, err = run_main(capsys, tiny["llama"], "--layer", "0")
    assert code == 0 and out.splitlines()[0].endswith("— mapping 'llama'"), out + err
    llama = Path(__file__).resolve().parent.parent / "mappings" / "llama.toml"
    code, out, err = run_main(capsys, families["qwen3"][0], "--layers", "all", "--mapping", llama)
    assert code == 0 and "— mapping 'llama'" in out.splitlines()[0] and "PASS: 2 layer(s)" in out, out + err


def test_json_html_and_list_say_derived(capsys, families, tmp_path):
    page = tmp_path / "report.html"
    code, out, err = run_main(capsys, families["opt"][0], "--layers", "all", "--json", "-", "--html", page)
    assert code == 0, out + err
    said = "derived from transformers"
    assert json.loads(out)["mapping"].startswith(f"{said} ") and "fc1+activation_fn+fc2" in json.loads(out)["mapping"]
    assert said in page.read_text(encoding="utf-8")
    code, out, err = run_main(capsys, "list")
    assert code == 0 and "derived from transformers" in out


def test_one_layer_model(capsys, tmp_path):
    """With one layer, the layer number in the tensor names is the stem's one '0' (no second layer to tell it by)."""
    folder = build("qwen3", tmp_path / "qwen3", 5, intermediate_size=72, num_hidden_layers=1, **KV)
    code, out, err = run_main(capsys, folder, "--layers", "all")
    assert code == 0 and "PASS: 1 layer(s)" in out, out + err


# --save-mapping of a derived layout (written in full, read back by --mapping): tests/test_derived_leftovers2.py
