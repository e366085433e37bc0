"""Layouts the first derivation refused, now served from transformers itself (parity/engine/layout/flat_experts.py,
parity/engine/check/routes.py), each a tiny checkpoint built with transformers' own classes (from_config +
save_pretrained), broken exports written with safetensors, ports written here from scratch:

- DBRX keeps its experts as three matrices flattened over experts (``w1``, ``v1``, ``w2``: [E·ff, d] each, w2 read as
  ``h @ w2``): which is gate, up and down, and which is read transposed, is measured on transformers' module;
- a GPT-OSS port holding transformers' own fused, interleaved ``gate_up_proj`` [d, 2·ff] with ``gate_up_proj_bias``
  is filled by --target alone, interleaved as transformers' module lays it out (never guessed from the port's
  forward); a port reading the halves fails, named.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from .derived_checkpoints import MOE, build, one_line
from .support import run_json, run_main

FF, EXPERTS = 24, 4
DBRX_UNITS = [(layer, expert, None) for layer in (0, 1) for expert in range(EXPERTS)]


def build_dbrx(folder: Path, seed: int) -> Path:
    """A two-layer DBRX, d = 32, four experts of d_ff 24 (DBRX's own config keys: d_model, ffn_config, ...)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "dbrx", d_model=32, n_heads=2, n_layers=2, max_seq_len=128, vocab_size=64, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, attn_config=dict(kv_n_heads=2, rope_theta=10000.0),
        ffn_config=dict(ffn_hidden_size=FF, moe_num_experts=EXPERTS, moe_top_k=2))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.05)
    model.save_pretrained(folder)
    return folder


def broken_dbrx(folder: Path, dest: Path, how: str) -> Path:
    """Layer 1 of a DBRX broken: experts 1 and 2 exchanged in all three matrices, or expert 0's gate and up
    (w1 and v1 rows) exchanged."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, dest)
    tensors = load_file(dest / "model.safetensors")
    stem = "transformer.blocks.1.ffn.experts.mlp."
    if how == "experts":
        for name in ("w1", "v1", "w2"):
            rows = tensors[stem + name].view(EXPERTS, FF, -1).clone()
            rows[[1, 2]] = rows[[2, 1]]
            tensors[stem + name] = rows.reshape(EXPERTS * FF, -1).contiguous()
    else:
        gate, up = tensors[stem + "w1"].clone(), tensors[stem + "v1"].clone()
        gate[:FF], up[:FF] = tensors[stem + "v1"][:FF], tensors[stem + "w1"][:FF]
        tensors[stem + "w1"], tensors[stem + "v1"] = gate, up
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


@pytest.fixture(scope="session")
def dbrx(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dbrx")
    good = build_dbrx(root / "dbrx", 0)
    return {"good": good, **{how: broken_dbrx(good, root / how, how) for how in ("experts", "gate_up")}}


def units(report: dict) -> list[tuple]:
    """The report's units but the whole MoE blocks (tests/test_moe_block.py judges those)."""
    return [(r["layer"], r["expert"], r["unit"]) for r in report["layers"] if r["unit"] != "block"]


def fails_only(capsys, good: Path, broken: Path, failing: set, named: str) -> None:
    """`parity compare good broken` fails on exactly the ``failing`` units (layer, expert, unit), each named
    ``named``."""
    code, report, err = run_json(capsys, "compare", good, broken)
    assert code == 1, err
    failed = {(r["layer"], r["expert"], r["unit"]) for r in report["layers"] if not r["passed"]}
    assert failed == failing  # the whole blocks judge the router and what else no unit reads: they pass
    assert {r["diagnosis"]["id"] for r in report["layers"] if not r["passed"]} == {named}


def test_dbrx_compare_against_itself_judges_every_expert(capsys, dbrx):
    code, report, err = run_json(capsys, "compare", dbrx["good"], dbrx["good"])
    assert code == 0 and report["passed"], err
    assert units(report) == DBRX_UNITS
    assert report["mapping"] == ("derived from transformers " + __import__("transformers").__version__
                                 + " DbrxExperts at transformer.blocks.{layer}.ffn.experts")


@pytest.mark.parametrize("how, failing, named", [
    ("experts", {(1, 1, None), (1, 2, None)}, "expert_shifted"),
    ("gate_up", {(1, 0, None)}, "gate_up_exchanged"),
])
def test_dbrx_broken_export_fails_on_the_broken_experts_only_and_is_named(capsys, dbrx, how, failing, named):
    fails_only(capsys, dbrx["good"], dbrx[how], failing, named)


def test_dbrx_default_target_checks_every_expert(capsys, dbrx):
    """w1 is the gate, v1 the up, w2 the down read transposed: measured, and the default SwiGLU filled so."""
    code, report, err = run_json(capsys, dbrx["good"])
    assert code == 0 and report["passed"], err
    assert units(report) == DBRX_UNITS and report["target"] == "parity.ffn:SwiGLU"
    assert report["routes"]["tensors"]["_down.weight"] == {"from": "w2", "transform": "transpose"}
    assert report["reference_activation"] == "silu"  # DbrxExperts.mlp.activation_fn, one level down


class LinearExpert(nn.Module):
    """One expert as nn.Linear projections with transformers' names."""

    def __init__(self, hidden_size: int, intermediate_size: int, swapped: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.swapped = swapped

    def forward(self, x):
        gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(gate * F.silu(up) if self.swapped else F.silu(gate) * up)


def swapped_expert(hidden_size: int, intermediate_size: int) -> nn.Module:
    return LinearExpert(hidden_size, intermediate_size, swapped=True)


def test_dbrx_port_passes_with_target_alone_and_a_swapped_one_is_named(capsys, dbrx):
    code, report, err = run_json(capsys, dbrx["good"], "--target", "tests.test_derived_leftovers:LinearExpert")
    assert code == 0 and report["passed"] and units(report) == DBRX_UNITS, err
    code, report, err = run_json(capsys, dbrx["good"], "--layers", "1", "--target",
                                 "tests.test_derived_leftovers:swapped_expert")
    assert code == 1 and {r["diagnosis"]["id"] for r in report["layers"]} == {"gate_up_swapped"}, err


class DbrxStorageExpert(nn.Module):
    """One DBRX expert written in DbrxExpertGLU's own storage: bare w1, v1, w2, each [ff, d], w2 read as h @ w2."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(intermediate_size, hidden_size))
        self.v1 = nn.Parameter(torch.empty(intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(intermediate_size, hidden_size))

    def forward(self, x):
        return (F.silu(x @ self.w1.t()) * (x @ self.v1.t())) @ self.w2


def test_dbrx_port_in_its_own_storage_passes_with_target_alone(capsys, dbrx):
    """v1 reads as up (aliases.toml); w2 is filled as DBRX stores it, [ff, d], not turned into nn.Linear's."""
    code, report, err = run_json(capsys, dbrx["good"], "--target", "tests.test_derived_leftovers:DbrxStorageExpert")
    assert code == 0 and report["passed"] and units(report) == DBRX_UNITS, err
    assert report["routes"]["tensors"]["w2"] == "w2"


# -- GPT-OSS: a port holding transformers' own fused, interleaved gate_up_proj -----------------------------------------
class FusedOssExpert(nn.Module):
    """One GPT-OSS expert written from scratch in transformers' own storage: gate_up_proj [d, 2·ff] computed as
    x @ W, gate and up in alternate columns (``halves``: a broken port reading [gate | up] halves instead), its bias
    laid out alike, down_proj [ff, d]; the clamp at swiglu_limit, alpha, (up + 1)."""

    def __init__(self, config, halves: bool = False):
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(d, 2 * f))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(2 * f))
        self.down_proj = nn.Parameter(torch.empty(f, d))
        self.down_proj_bias = nn.Parameter(torch.empty(d))
        self.alpha, self.limit, self.halves = config.swiglu_alpha, config.swiglu_limit, halves

    def forward(self, x):
        both = x @ self.gate_up_proj + self.gate_up_proj_bias
        gate, up = both.chunk(2, dim=-1) if self.halves else (both[..., 0::2], both[..., 1::2])
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return ((up + 1) * gate * torch.sigmoid(gate * self.alpha)) @ self.down_proj + self.down_proj_bias


def fused_oss(config):
    return FusedOssExpert(config)


def halves_oss(config):
    return FusedOssExpert(config, halves=True)


@pytest.fixture(scope="session")
def gpt_oss(tmp_path_factory) -> dict[str, Path]:
    """GPT-OSS at d_ff 72 (gate_up_proj [32, 144]) and at d_ff 16, where [d, 2·ff] is square: only transformers'
    module (is_transposed) says its orientation."""
    root = tmp_path_factory.mktemp("gpt-oss")
    return {"wide": build("gpt_oss", root / "wide", 0, **MOE),
            "square": build("gpt_oss", root / "square", 1, **dict(MOE, intermediate_size=16))}


@pytest.mark.parametrize("size", ["wide", "square"])
def test_fused_interleaved_gpt_oss_port_passes_with_target_alone(capsys, gpt_oss, size):
    code, report, err = run_json(capsys, gpt_oss[size], "--target", "tests.test_derived_leftovers:fused_oss")
    assert code == 0 and report["passed"], err
    assert len(report["layers"]) == 2 * EXPERTS and not report["notes"], err
    routes = report["routes"]
    assert routes["inferred"]
    assert routes["tensors"]["gate_up_proj"] == {"from": "gate_up_proj", "transform": "transpose"}
    assert routes["tensors"]["gate_up_proj_bias"] == "gate_up_proj_bias"


def test_a_port_reading_halves_of_the_interleaved_gate_up_fails_named(capsys, gpt_oss):
    code, report, err = run_json(capsys, gpt_oss["wide"], "--target", "tests.test_derived_leftovers:halves_oss")
    assert code == 1 and not any(r["passed"] for r in report["layers"]), err
    assert {r["diagnosis"]["id"] for r in report["layers"]} == {"gate_up_reordered"}


def test_gpt_oss_default_target_stays_one_line(capsys, gpt_oss):
    code, out, err = run_main(capsys, gpt_oss["wide"])
    assert code == 2 and "GptOssExperts" in one_line(err) and "--target" in one_line(err), out + err


# -- NemotronH: ungated experts, layers without an FFN, `backbone.` on disk -----------------------------------------
NEMOTRON_H = dict(MOE, moe_shared_expert_intermediate_size=24)  # its four blocks: Mamba, MoE, attention, MLP
NEMOTRON_H_UNITS = [(1, e, None) for e in range(EXPERTS)] + [(1, None, "shared_experts"), (3, None, "mixer")]


def broken_nemotron_h(folder: Path, dest: Path, how: str) -> Path:
    """Experts 1 and 2 of layer 1 exchanged (every tensor of each), or layer 3's MLP down projection negated."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, dest)
    tensors = load_file(dest / "model.safetensors")
    if how == "experts":
        for name in [n for n in tensors if ".layers.1.mixer.experts.1." in n]:
            other = name.replace(".experts.1.", ".experts.2.")
            tensors[name], tensors[other] = tensors[other].clone(), tensors[name].clone()
    else:
        tensors["backbone.layers.3.mixer.down_proj.weight"] = -tensors["backbone.layers.3.mixer.down_proj.weight"]
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


@pytest.fixture(scope="session")
def nemotron_h(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("nemotron-h")
    good = build("nemotron_h", root / "nemotron_h", 0, **NEMOTRON_H)
    return {"good": good, **{how: broken_nemotron_h(good, root / how, how) for how in ("experts", "down")}}


def test_nemotron_h_compare_against_itself_skips_the_layers_without_an_ffn(capsys, nemotron_h):
    from safetensors import safe_open

    with safe_open(nemotron_h["good"] / "model.safetensors", "pt") as f:
        assert all(key.startswith(("backbone.", "lm_head.")) for key in f.keys())  # what save_pretrained writes
    code, report, err = run_json(capsys, "compare", nemotron_h["good"], nemotron_h["good"])
    assert code == 0 and report["passed"], err
    assert units(report) == NEMOTRON_H_UNITS
    assert any("layers 0, 2 hold no FFN" in note and "not counted as a failure" in note for note in report["notes"])


@pytest.mark.parametrize("how, failing, named", [
    ("experts", {(1, 1, None), (1, 2, None)}, "expert_shifted"),
    ("down", {(3, None, "mixer")}, "sign_flipped"),
])
def test_nemotron_h_broken_export_fails_on_the_broken_unit_only_and_is_named(capsys, nemotron_h, how, failing, named):
    fails_only(capsys, nemotron_h["good"], nemotron_h[how], failing, named)


class Relu2Expert(nn.Module):
    """An ungated expert (or MLP) with relu², its width by parameter name: built per unit by parity."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.relu(self.up_proj(x)) ** 2)


class ReluExpert(Relu2Expert):
    def forward(self, x):
        return self.down_proj(F.relu(self.up_proj(x)))


def test_nemotron_h_default_target_refuses_in_one_line_and_a_port_passes(capsys, nemotron_h):
    """relu² is no activation of parity.ffn's: exit 2 in one line; a port passes every unit at its own width, one
    without the square fails every unit."""
    code, out, err = run_main(capsys, nemotron_h["good"])
    line = one_line(err)
    assert code == 2 and "NemotronH" in line and "ReLUSquaredActivation" in line and "--target" in line, out + err
    code, report, err = run_json(capsys, nemotron_h["good"], "--target", "tests.test_derived_leftovers:Relu2Expert")
    assert code == 0 and report["passed"] and units(report) == NEMOTRON_H_UNITS, err
    code, report, err = run_json(capsys, nemotron_h["good"], "--target", "tests.test_derived_leftovers:ReluExpert")
    assert code == 1 and not any(r["passed"] for r in report["layers"]), err


# -- JetMoE: a block that routes x to its experts itself ---------------------------------------------------------------
JETMOE = dict(intermediate_size=FF, num_local_experts=EXPERTS, num_experts_per_tok=2, num_key_value_heads=2,
              kv_channels=16)


def broken_jetmoe(folder: Path, dest: Path, how: str) -> Path:
    """Layer 1: experts 1 and 2 exchanged in both stacks, or expert 3's [gate; up] halves exchanged."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, dest)
    tensors = load_file(dest / "model.safetensors")
    stem = "model.layers.1.mlp."
    if how == "experts":
        for name in ("input_linear.weight", "output_linear.weight"):
            stack = tensors[stem + name].clone()
            stack[[1, 2]] = stack[[2, 1]]
            tensors[stem + name] = stack
    else:
        stack = tensors[stem + "input_linear.weight"].clone()
        gate, up = stack[3].chunk(2)
        stack[3] = torch.cat([up, gate])
        tensors[stem + "input_linear.weight"] = stack
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


@pytest.fixture(scope="session")
def jetmoe(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("jetmoe")
    good = build("jetmoe", root / "jetmoe", 0, **JETMOE)
    return {"good": good, **{how: broken_jetmoe(good, root / how, how) for how in ("experts", "halves")}}


def test_jetmoe_compare_against_itself_judges_every_expert_and_says_what_it_leaves(capsys, jetmoe):
    code, report, err = run_json(capsys, "compare", jetmoe["good"], jetmoe["good"])
    assert code == 0 and report["passed"], err
    assert units(report) == DBRX_UNITS and report["mapping"].endswith("JetMoeMoE at model.layers.{layer}.mlp")
    assert any("bias, router.layer.weight belong to the whole block" in note for note in report["notes"])


@pytest.mark.parametrize("how, failing, named", [
    ("experts", {(1, 1, None), (1, 2, None)}, "expert_shifted"),
    ("halves", {(1, 3, None)}, "gate_up_exchanged"),
])
def test_jetmoe_broken_export_fails_on_the_broken_experts_only_and_is_named(capsys, jetmoe, how, failing, named):
    fails_only(capsys, jetmoe["good"], jetmoe[how], failing, named)


def test_jetmoe_default_target_and_ports(capsys, jetmoe):
    """The block's first half of input_linear is the gate (measured): SwiGLU passes, a port passes with --target
    alone, one with gate and up exchanged is named."""
    code, report, err = run_json(capsys, jetmoe["good"])
    assert code == 0 and report["passed"] and report["target"] == "parity.ffn:SwiGLU", err
    code, report, err = run_json(capsys, jetmoe["good"], "--target", "tests.test_derived_leftovers:LinearExpert")
    assert code == 0 and report["passed"] and units(report) == DBRX_UNITS, err
    code, report, err = run_json(capsys, jetmoe["good"], "--layers", "0", "--target",
                                 "tests.test_derived_leftovers:swapped_expert")
    assert code == 1 and {r["diagnosis"]["id"] for r in report["layers"]} == {"gate_up_swapped"}, err


# -- RoBERTa-PreLayerNorm: its intermediate normalises before its projection ------------------------------------------
class BertStyleFFN(nn.Module):
    """A port in BERT's own names (aliases.toml's group): intermediate.dense -> exact GELU -> output.dense."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.intermediate, self.output = nn.Module(), nn.Module()
        self.intermediate.dense = nn.Linear(hidden_size, intermediate_size)
        self.output.dense = nn.Linear(intermediate_size, hidden_size)

    def forward(self, x):
        return self.output.dense(F.gelu(self.intermediate.dense(x)))


@pytest.fixture(scope="session")
def prelayernorm(tmp_path_factory) -> dict[str, Path]:
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("prelayernorm")
    good = build("roberta-prelayernorm", root / "good", 0, intermediate_size=128, is_decoder=True)
    broken = root / "broken"
    shutil.copytree(good, broken)
    tensors = load_file(broken / "model.safetensors")
    name = next(n for n in tensors if ".layer.1.output.dense.weight" in n)
    tensors[name] = -tensors[name]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    return {"good": good, "broken": broken}


def test_prelayernorm_ffn_is_cut_after_its_norm_and_said_so(capsys, prelayernorm):
    """intermediate computes dense(LayerNorm(x)) then its activation: the LayerNorm is the FFN's pre-norm (measured),
    outside the FFN as every layer's norms are; compare, the default target (FeedForward, d_ff = 4d, exact GELU) and a
    port pass, and a negated output.dense fails on layer 1 only, named."""
    code, report, err = run_json(capsys, "compare", prelayernorm["good"], prelayernorm["good"])
    assert code == 0 and report["passed"] and [r["layer"] for r in report["layers"]] == [0, 1], err
    assert any("intermediate.LayerNorm normalises the FFN's input" in note for note in report["notes"])
    code, report, err = run_json(capsys, "compare", prelayernorm["good"], prelayernorm["broken"])
    assert code == 1 and [r["passed"] for r in report["layers"]] == [True, False], err
    assert report["layers"][1]["diagnosis"]["id"] == "sign_flipped"
    code, report, err = run_json(capsys, prelayernorm["good"])
    assert code == 0 and report["passed"] and report["target"] == "parity.ffn:FeedForward", err
    code, report, err = run_json(capsys, prelayernorm["good"], "--target", "tests.test_derived_leftovers:BertStyleFFN")
    assert code == 0 and report["passed"], err
