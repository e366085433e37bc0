"""Dense FFNs of shapes derive.py once refused, derived from transformers itself (parity/engine/layout/structure.py).

- a seq2seq family's ForCausalLM (BART): the decoder alone, ``decoder_layers`` long while num_hidden_layers counts
  the encoder's layers;
- an FFN split over two children (BERT, RoBERTa, ELECTRA): intermediate.dense + its activation, then output.dense;
- an MLP whose forward adds the residual (Bloom): run with a zero residual, once the module is seen to add it;
- an activation with buffers saved in the checkpoint (Apertus's xIELU beta and eps).

Each is a tiny checkpoint built with transformers' own classes (test_derived_families.build).  For each: ``parity
compare A A`` passes, a broken export (layer 1's output projection negated) is named on layer 1 only, a port
written the family's way passes with ``--target``, and the default target passes or is the documented one-line
exit 2.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from .derived_checkpoints import TwoLayer, assert_layer_one_named, broken_copy, build, one_line, tanh_gelu
from .support import run_json, run_main

KV = dict(num_key_value_heads=2, head_dim=16)
# model_type -> (config values beyond test_derived_families.COMMON, the port --target names, layer 1's output
# projection (negated in the broken export), the derived layout's reference as the header names it)
SHAPES = {
    "bart": (dict(num_hidden_layers=3, decoder_layers=2, decoder_ffn_dim=128), "bart_port", "fc2",
             "BartDecoderLayer's fc1+activation_fn+fc2 at model.decoder.layers.{layer}"),
    "bert": (dict(intermediate_size=128, is_decoder=True), "bert_port", "output.dense",
             "BertLayer's intermediate.dense+intermediate.intermediate_act_fn+output.dense at bert.encoder.layer"),
    "roberta": (dict(intermediate_size=128, is_decoder=True), "bert_port", "output.dense",
                "RobertaLayer's intermediate.dense+intermediate.intermediate_act_fn+output.dense"),
    "electra": (dict(intermediate_size=128, is_decoder=True), "bert_port", "output.dense",
                "ElectraLayer's intermediate.dense+intermediate.intermediate_act_fn+output.dense"),
    "bloom": (dict(), "bloom_port", "mlp.dense_4h_to_h", "BloomMLP(x, residual=0) at transformer.h.{layer}.mlp"),
    "apertus": (dict(intermediate_size=72, **KV), "apertus_port", "mlp.down_proj", "ApertusMLP at model.layers"),
}
# no module of parity.ffn expresses these: the default target is exit 2, naming what parity.ffn lacks
REFUSED = {"apertus": "ApertusMLP: it runs XIELUActivation, and parity.ffn.FeedForward runs ReLU, exact GELU or "
                      "tanh GELU"}


@pytest.fixture(scope="session")
def shapes(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """model_type -> (its tiny checkpoint, a broken export of it)."""
    root = tmp_path_factory.mktemp("dense-shapes")
    built = {}
    for seed, (model_type, (values, _, change, _)) in enumerate(SHAPES.items()):
        folder = build(model_type, root / model_type, 40 + seed, **values)
        built[model_type] = folder, broken_copy(folder, root / f"{model_type}-broken", change)
    return built


# -- ports, written each family's way ------------------------------------------------------------------------------
class BertPort(nn.Module):
    """BERT's FFN as its own code holds it: intermediate.dense, the activation, output.dense."""

    def __init__(self, config):
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        self.intermediate, self.output = nn.Module(), nn.Module()
        self.intermediate.dense, self.output.dense = nn.Linear(d, f), nn.Linear(f, d)

    def forward(self, x):
        return self.output.dense(F.gelu(self.intermediate.dense(x)))


def bloom_gelu(x):
    """Bloom's tanh GELU, with its rounded constants."""
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


class XIELU(nn.Module):
    """xIELU with its two learned parameters; beta and eps are the constants transformers saves as buffers."""

    def __init__(self, beta: float = 0.5, eps: float = -1e-6):
        super().__init__()
        self.alpha_p, self.alpha_n = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))
        self.beta, self.eps = beta, eps

    def forward(self, x):
        alpha_p, alpha_n = F.softplus(self.alpha_p), self.beta + F.softplus(self.alpha_n)
        negative = (torch.expm1(torch.clamp(x, max=self.eps)) - x) * alpha_n + self.beta * x
        return torch.where(x > 0, alpha_p * x * x + self.beta * x, negative)


class ApertusPort(nn.Module):
    def __init__(self, config):
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        self.up_proj, self.down_proj = nn.Linear(d, f, bias=False), nn.Linear(f, d, bias=False)
        self.act_fn = XIELU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.up_proj(x)))


def bart_port(config):
    return TwoLayer(config.d_model, config.decoder_ffn_dim, ("fc1", "fc2"), F.gelu)


def bert_port(config):
    return BertPort(config)


def bloom_port(config):
    return TwoLayer(config.hidden_size, 4 * config.hidden_size, ("dense_h_to_4h", "dense_4h_to_h"), bloom_gelu)


def bloom_exact_gelu_port(config):
    return TwoLayer(config.hidden_size, 4 * config.hidden_size, ("dense_h_to_4h", "dense_4h_to_h"), F.gelu)


def bloom_tanh_port(config):
    return TwoLayer(config.hidden_size, 4 * config.hidden_size, ("dense_h_to_4h", "dense_4h_to_h"), tanh_gelu)


def apertus_port(config):
    return ApertusPort(config)


# -- the checks ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model_type", sorted(SHAPES))
def test_default_target(capsys, shapes, model_type):
    """The parity.ffn module the FFN's structure calls for passes every layer, and the header names the derived
    reference; where none expresses it, exit 2 in one line saying what parity.ffn lacks, with the two ways on."""
    code, out, err = run_main(capsys, shapes[model_type][0], "--layers", "all")
    if model_type in REFUSED:
        line = one_line(err)
        assert code == 2 and REFUSED[model_type] in line, out + err
        assert "--target" in line and "parity compare A B" in line
        return
    assert code == 0, out + err
    assert SHAPES[model_type][3] in out.splitlines()[0]
    assert "PASS: 2 layer(s)" in out


@pytest.mark.parametrize("model_type", sorted(SHAPES))
def test_port_with_target(capsys, shapes, model_type):
    code, out, err = run_main(capsys, shapes[model_type][0], "--layers", "all", "--target",
                              f"tests.test_derived_dense_shapes:{SHAPES[model_type][1]}")
    assert code == 0, out + err
    assert "PASS: 2 layer(s)" in out


@pytest.mark.parametrize("model_type", sorted(SHAPES))
def test_compare_broken_export(capsys, shapes, model_type):
    """B with layer 1's output projection negated: layer 0 passes, layer 1 fails and is named."""
    assert_layer_one_named(capsys, *shapes[model_type], "sign_flipped")


@pytest.mark.parametrize("model_type", sorted(SHAPES))
def test_compare_with_itself(capsys, shapes, model_type):
    code, out, err = run_main(capsys, "compare", shapes[model_type][0], shapes[model_type][0])
    assert code == 0, out + err
    assert "PASS: 2 layer(s) of B bit-identical to A's" in out


def test_saved_buffers_are_read_from_the_checkpoint(capsys, shapes, tmp_path):
    """xIELU's beta is a buffer the checkpoint holds: B whose layer 1 saved another beta computes another function,
    and compare names layer 1 only (a reference that kept its own constant would pass it)."""
    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(shapes["apertus"][0], tmp_path / "apertus-beta")
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.1.mlp.act_fn.beta"
    assert math.isclose(float(tensors[name]), 0.5)
    tensors[name] = torch.full_like(tensors[name], 0.25)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    code, out, err = run_main(capsys, "compare", shapes["apertus"][0], folder, "--json", "-")
    assert code == 1, out + err
    verdicts = {layer["layer"]: layer["passed"] for layer in json.loads(out)["layers"]}
    assert verdicts == {0: True, 1: False}


# -- the structure, on modules of the shapes it tells apart --------------------------------------------------------
class AddsResidual(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.fc_in, self.fc_out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, hidden_states, residual):
        return self.fc_out(F.gelu(self.fc_in(hidden_states))) + residual


class ScalesResidual(AddsResidual):
    def forward(self, hidden_states, residual):
        return self.fc_out(F.gelu(self.fc_in(hidden_states))) + 0.5 * residual


class GatesOnResidual(AddsResidual):
    def forward(self, hidden_states, residual):
        return self.fc_out(F.gelu(self.fc_in(hidden_states) * residual.sum())) + residual


@pytest.mark.parametrize("d", [8, 512])  # 512: over PROBE_ELEMENTS, probed at a small width
@pytest.mark.parametrize("kind, adds", [(AddsResidual, True), (ScalesResidual, False), (GatesOnResidual, False)])
def test_residual_is_seen_added_not_assumed(kind, adds, d):
    """A forward of (x, residual) is cut down to the FFN only where the module is seen to add the residual at the
    end, in float64 on random values (meta-device parameters, as derive holds them)."""
    from parity.engine.layout.structure import PROBE_ELEMENTS, adds_second_input

    with torch.device("meta"):
        meta = kind(d)
    assert (sum(p.numel() for p in meta.parameters()) > PROBE_ELEMENTS) == (d == 512)
    assert adds_second_input(meta, d, 4 * d) is adds


class RoundedTanhGelu(nn.Module):
    def __init__(self, constant: float):
        super().__init__()
        self.constant = constant

    def forward(self, x):
        return x * 0.5 * (1.0 + torch.tanh(self.constant * x * (1 + 0.044715 * x * x)))


@pytest.mark.parametrize("constant, named", [(0.79788456, "gelu_tanh"), (0.7978, None), (1.0, None)])
def test_activation_of_its_own_class_is_measured(constant, named):
    """Bloom's constant (0.79788456) is tanh GELU's sqrt(2/pi) within a tenth of float32's resolution; one rounded
    to 0.7978 is a function float32 tells apart (up to 6e-4 relative), and is named as none."""
    from parity.engine.reference import measured_function

    assert measured_function(RoundedTanhGelu(constant)) == named


def test_two_lists_of_layers_none_of_the_configs_count(capsys, shapes):
    """The seq2seq case the selection rests on: num_hidden_layers (3, the encoder's) names no list; the one list
    of layers is the decoder's 2, and every one of its layers is checked."""
    config = json.loads((shapes["bart"][0] / "config.json").read_text())
    assert (config["encoder_layers"], config["decoder_layers"]) == (3, 2)  # num_hidden_layers reads encoder_layers
    code, out, err = run_main(capsys, shapes["bart"][0], "--layers", "all", "--target",
                              "tests.test_derived_dense_shapes:bart_port")
    assert code == 0 and "PASS: 2 layer(s)" in out, out + err


def test_tanh_gelu_port_passes_bloom(capsys, shapes):
    """A port running torch's tanh GELU passes Bloom's own formula: the same function within float32 noise."""
    code, out, err = run_main(capsys, shapes["bloom"][0], "--layers", "all", "--target",
                              "tests.test_derived_dense_shapes:bloom_tanh_port")
    assert code == 0 and "PASS: 2 layer(s)" in out, out + err


class Intermediate(nn.Module):
    def __init__(self, d: int, f: int):
        super().__init__()
        self.dense, self.act_fn = nn.Linear(d, f), nn.GELU()

    def forward(self, x):
        return self.act_fn(self.dense(x))


class ScaledIntermediate(Intermediate):
    def forward(self, x):
        return 2.0 * self.act_fn(self.dense(x))


class SplitLayer(nn.Module):
    """A BERT-like layer: attention, then the FFN over two children."""

    def __init__(self, intermediate: type[Intermediate], d: int = 8, f: int = 32):
        super().__init__()
        self.query, self.intermediate, self.output = nn.Linear(d, d), intermediate(d, f), nn.Module()
        self.output.dense = nn.Linear(f, d)


@pytest.mark.parametrize("intermediate, steps", [
    (Intermediate, ("intermediate.dense", "intermediate.act_fn", "output.dense")),
    (ScaledIntermediate, None),
])
def test_split_ffn_is_cut_only_where_the_child_computes_just_it(intermediate, steps):
    """The child holding the first projection and the activation is cut into the FFN's steps only where its
    forward computes just those two (seen on random values): one that does more is no FFN parity reads."""
    from parity.engine.layout.structure import find_ffn

    with torch.device("meta"):
        layer = SplitLayer(intermediate)
    found = find_ffn(layer, 8)
    assert (found.inline if found is not None else None) == steps
    if found is not None:
        assert sorted(found.module.state_dict()) == ["intermediate.dense.bias", "intermediate.dense.weight",
                                                      "output.dense.bias", "output.dense.weight"]


class GatedOnTheLayer(nn.Module):
    """gate, up, down and the activation directly on the layer: a gated FFN that no three-step cut computes."""

    def __init__(self, d: int = 8, f: int = 32):
        super().__init__()
        self.query = nn.Linear(d, d)
        self.gate, self.up, self.act_fn, self.down = nn.Linear(d, f), nn.Linear(d, f), nn.SiLU(), nn.Linear(f, d)


def test_gated_projections_on_the_layer_are_not_cut_into_a_classic_ffn():
    from parity.engine.layout.structure import find_ffn

    with torch.device("meta"):
        layer = GatedOnTheLayer()
    assert find_ffn(layer, 8) is None


class TwoStacks(nn.Module):
    """An encoder and a decoder of linear layers, 3 and 2 long."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.encoder = nn.ModuleList(nn.Sequential(nn.Linear(d, d)) for _ in range(3))
        self.decoder = nn.ModuleList(nn.Sequential(nn.Linear(d, d)) for _ in range(2))


@pytest.mark.parametrize("count, chosen", [(2, "decoder"), (3, "encoder"), (4, None)])
def test_which_list_of_layers(count, chosen):
    """Of two lists of layers, the one num_hidden_layers long; with none that long, refused naming both (one list
    alone, as a seq2seq ForCausalLM's decoder, is taken whatever num_hidden_layers says: the bart case above)."""
    from types import SimpleNamespace

    from parity.engine.layout.structure import decoder_layers
    from parity.errors import MappingError

    config = SimpleNamespace(num_hidden_layers=count, model_type="twostacks")
    if chosen is not None:
        assert decoder_layers(TwoStacks(), config)[0] == chosen
        return
    with pytest.raises(MappingError) as caught:
        decoder_layers(TwoStacks(), config)
    assert "found: encoder (3), decoder (2)" in str(caught.value) and "\n" not in str(caught.value)


def test_bloom_port_with_exact_gelu_is_named(capsys, shapes):
    """Bloom's own GELU class is measured as tanh GELU, so the known mistake of a port running exact GELU is
    replayed on transformers' BloomMLP (its activation replaced) and named."""
    code, out, err = run_main(capsys, shapes["bloom"][0], "--layers", "all", "--target",
                              "tests.test_derived_dense_shapes:bloom_exact_gelu_port")
    assert code == 1 and "gelu_exact_instead_of_tanh" in out, out + err
    assert "(activation: gelu_pytorch_tanh)" in out


GEMMA3N = dict(num_hidden_layers=4, intermediate_size=[64, 96, 64, 96], num_key_value_heads=2, head_dim=16,
               layer_types=["sliding_attention", "full_attention"] * 2,
               activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0],
               hidden_size_per_layer_input=8, vocab_size_per_layer_input=64, num_kv_shared_layers=0, laurel_rank=4,
               altup_num_inputs=2)


def test_gemma3n_widths_and_activation_sparsity(capsys, tmp_path):
    """Gemma 3n: d_ff differs layer by layer and its first layer keeps only the largest gate activations.  Each kind
    of layer is a unit of its own (compare judges every one, a broken layer 1 fails alone); no repository module
    computes the sparsity, measured on transformers' module: the default target is exit 2 in one line, never a
    false alarm on a correct checkpoint."""
    folder = build("gemma3n_text", tmp_path / "gemma3n", 3, **GEMMA3N)
    code, report, err = run_json(capsys, "compare", folder, folder)
    assert code == 0 and [(r["layer"], r["unit"]) for r in report["layers"]] == [(i, "mlp") for i in range(4)], err
    broken = broken_copy(folder, tmp_path / "gemma3n-broken", "mlp.down_proj")
    code, report, err = run_json(capsys, "compare", folder, broken)
    assert code == 1 and [(r["layer"], r["diagnosis"]["id"]) for r in report["layers"] if not r["passed"]] == \
        [(1, "sign_flipped")], err
    code, out, err = run_main(capsys, folder)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "activation sparsity" in lines[0] and "--target" in lines[0], out + err
