"""GGUF files of mixture-of-experts architectures no mapping file names: the layout derived from transformers' own
model, each unit (routed experts, a shared expert, dense layers before MoE ones) spelled in gguf's own tensor names
for the architecture (parity/engine/layout/gguf.py, parity/engine/layout/gguf_experts.py).

Each file is written with gguf's GGUFWriter from a tiny checkpoint built with transformers' own classes, its experts
stacked the way llama.cpp's converter stacks them (spelled out here per family, not looked up in gguf): per-expert
tensors stacked along a new first dim (Qwen2-MoE, Qwen3-MoE, MiniMax-M2's w1/w3/w2, DeepSeek V3), GPT-OSS's fused,
interleaved, x @ W gate_up_proj transposed to [out, in] and split into its even rows (gate) and odd rows (up), gate
and up stacked as one [gate; up] tensor (Qwen3-Next's ffn_gate_up_exps).  ``parity compare HF
FILE.gguf`` passes on every unit, F32 and Q8_0; a broken export fails on the broken units only and is named; ``parity
FILE.gguf`` checks every unit with the default target.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from .derived_checkpoints import build, in_report_order
from .gguf_files import VALUES, Q, moe_gguf_of_folder, per_expert
from .support import run_json, run_main


def gpt_oss(state: dict, layer: int) -> dict[str, np.ndarray]:
    """GPT-OSS as llama.cpp's converter writes it: gate_up_proj [E, d, 2ff] (x @ W, gate and up interleaved) to
    [E, 2ff, d], its rows 0::2 the gate and 1::2 the up, each with its bias; down_proj [E, ff, d] to [E, d, ff]."""
    stem = f"model.layers.{layer}.mlp.experts."
    gate_up, bias = state[stem + "gate_up_proj"].transpose(0, 2, 1), state[stem + "gate_up_proj_bias"]
    return {"ffn_gate_exps.weight": gate_up[:, 0::2], "ffn_up_exps.weight": gate_up[:, 1::2],
            "ffn_down_exps.weight": state[stem + "down_proj"].transpose(0, 2, 1),
            "ffn_gate_exps.bias": bias[:, 0::2], "ffn_up_exps.bias": bias[:, 1::2],
            "ffn_down_exps.bias": state[stem + "down_proj_bias"]}


def routed(layers=(0, 1)) -> list[tuple]:
    return [(layer, expert, None) for layer in layers for expert in range(4)]


# GGUF architecture -> (transformers model_type, config values, layer_tensors, every unit a compare judges, the
# default target (None: no module of parity.ffn expresses the experts))
FAMILIES = {
    "qwen3moe": ("qwen3_moe", VALUES, per_expert(), routed(), "parity.ffn:SwiGLU"),
    "qwen2moe": ("qwen2_moe", VALUES, per_expert("shared_expert"),
                 in_report_order(routed() + [(0, None, "shared_expert"), (1, None, "shared_expert")]),
                 "parity.ffn:SwiGLU"),
    "gpt-oss": ("gpt_oss", dict(VALUES, intermediate_size=32), gpt_oss, routed(), None),
    "minimax-m2": ("minimax_m2", dict(VALUES, intermediate_size=32),  # Mixtral's w1/w3/w2 per expert
                   per_expert(experts_at="block_sparse_moe.experts", names={
                       "w1.weight": "ffn_gate_exps.weight", "w3.weight": "ffn_up_exps.weight",
                       "w2.weight": "ffn_down_exps.weight"}), routed(), "parity.ffn:SwiGLU"),
}


def exchange_experts(layer: int, tensors: dict) -> dict:
    """Layer 1's experts 1 and 2 exchanged in every stacked tensor."""
    if layer == 1:
        for name, values in tensors.items():
            if "_exps" in name:
                values = values.copy()
                values[[1, 2]] = values[[2, 1]]
                tensors[name] = values
    return tensors


def exchange_gate_up(layer: int, tensors: dict) -> dict:
    """Layer 1's expert 2: its gate and up exchanged (weights and biases)."""
    if layer == 1:
        for leaf in ("weight", "bias"):
            gate, up = f"ffn_gate_exps.{leaf}", f"ffn_up_exps.{leaf}"
            if gate in tensors:
                tensors[gate], tensors[up] = tensors[gate].copy(), tensors[up].copy()
                tensors[gate][2], tensors[up][2] = tensors[up][2].copy(), tensors[gate][2].copy()
    return tensors


BROKEN = {"experts": (exchange_experts, {(1, 1, None), (1, 2, None)}, "expert_shifted"),
          "gate_up": (exchange_gate_up, {(1, 2, None)}, "gate_up_exchanged")}


@pytest.fixture(scope="session")
def files(tmp_path_factory) -> dict[str, dict[str, Path]]:
    """arch -> {'hf': the tiny checkpoint, 'F32'/'Q8_0': its GGUF, 'experts'/'gate_up': a broken Q8_0 GGUF}."""
    root = tmp_path_factory.mktemp("gguf-moe")
    built = {}
    for seed, (arch, (model_type, values, layer_tensors, _, _)) in enumerate(FAMILIES.items()):
        hf = build(model_type, root / model_type, 60 + seed, **values)
        built[arch] = {"hf": hf, **{q.name: moe_gguf_of_folder(hf, root / f"{arch}-{q.name}.gguf", arch, layer_tensors,
                                                                q) for q in (Q.F32, Q.Q8_0)},
                       **{kind: moe_gguf_of_folder(hf, root / f"{arch}-{kind}.gguf", arch, layer_tensors, Q.Q8_0,
                                                   edit) for kind, (edit, _, _) in BROKEN.items()}}
    return built


def units(report: dict) -> list[tuple]:
    return [(r["layer"], r["expert"], r["unit"]) for r in report["layers"]]


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
@pytest.mark.parametrize("arch", FAMILIES)
def test_compare_hf_against_its_gguf_judges_every_unit(capsys, files, arch, qtype):
    code, report, err = run_json(capsys, "compare", files[arch]["hf"], files[arch][qtype])
    assert code == 0 and report["passed"], err
    with_blocks = [u for layer in (0, 1) for u in [*(u for u in FAMILIES[arch][3] if u[0] == layer),
                                                   (layer, None, "block")]]
    assert units(report) == with_blocks  # each layer's whole block too: its router written, as llama.cpp writes it
    candidate = report["comparison"]["candidate"]["mapping"]
    assert candidate.startswith("derived from transformers ") and candidate.endswith(f"'{arch}' map")


@pytest.mark.parametrize("kind", BROKEN)
@pytest.mark.parametrize("arch", FAMILIES)
def test_broken_gguf_fails_on_the_broken_units_only_and_is_named(capsys, files, arch, kind):
    code, report, err = run_json(capsys, "compare", files[arch]["hf"], files[arch][kind])
    assert code == 1, err
    _, failing, named = BROKEN[kind]
    assert {u for u, r in zip(units(report), report["layers"], strict=True) if not r["passed"]} == failing
    assert {r["diagnosis"]["id"] for r in report["layers"] if not r["passed"]} == {named}


@pytest.mark.parametrize("arch", FAMILIES)
def test_check_with_the_default_target(capsys, files, arch):
    """SwiGLU at each unit's own width (an expert's expert_feed_forward_length, the shared expert's); GPT-OSS's
    clamped experts: exit 2 in one line, as for its Hugging Face folder."""
    if FAMILIES[arch][4] is None:
        code, out, err = run_main(capsys, files[arch]["Q8_0"])
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and "GptOssExperts" in lines[0] and "--target" in lines[0], out + err
        return
    code, report, err = run_json(capsys, files[arch]["Q8_0"], "--layers", "all")
    assert code == 0 and report["passed"], err
    assert units(report) == FAMILIES[arch][3] and report["target"] == FAMILIES[arch][4]
    assert report["mapping"].endswith(f"'{arch}' map")


def test_the_experts_are_read_from_ggufs_stacked_tensors(files):
    """The derived layout names gguf's own stacked tensors, each expert read as stored ([out, in], gate and up
    apart: llama.cpp's converter de-interleaves GPT-OSS's), biases where transformers' experts have them."""
    from parity.engine.layout.resolve import resolve

    for arch, biased in (("qwen3moe", False), ("gpt-oss", True)):
        experts = resolve(str(files[arch]["F32"])).mapping.experts
        assert [r.source for r in experts.routes[:3]] == ["ffn_gate_exps.weight", "ffn_up_exps.weight",
                                                          "ffn_down_exps.weight"]
        assert not experts.transposed and not any(r.interleaved or r.chunk for r in experts.routes)
        assert [r.source for r in experts.biases] == (["ffn_gate_exps.bias", "ffn_up_exps.bias",
                                                       "ffn_down_exps.bias"] if biased else [])


# -- dense layers before MoE ones: DeepSeek V2/V3 ('deepseek2'), GLM-4.5 ('glm4moe') -----------------------------------
# transformers' GGUF tables (transformers.integrations.ggml.GGUF_CONFIG_MAPPING) read neither architecture; parity
# reads the keys llama.cpp's converter writes for them (parity/sources/gguf_config.py).  Below, the config the file
# stands for is given as the Hugging Face folder's own, and every unit of DeepSeek V3 (the dense layer 0, the routed
# and shared experts of layers 1 and 2) is read from gguf's 'deepseek2' names.

DEEPSEEK = dict(VALUES, num_hidden_layers=3, first_k_dense_replace=1)
DEEPSEEK_UNITS = in_report_order([(0, None, "mlp"), *routed((1, 2)), (1, None, "shared_experts"),
                                  (2, None, "shared_experts")])


@pytest.fixture(scope="session")
def deepseek(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-deepseek")
    hf = build("deepseek_v3", root / "deepseek_v3", 70, **DEEPSEEK)
    tensors = per_expert("shared_experts", dense_before=1)
    return {"hf": hf, "Q8_0": moe_gguf_of_folder(hf, root / "deepseek2.gguf", "deepseek2", tensors, Q.Q8_0),
            "broken": moe_gguf_of_folder(hf, root / "deepseek2-broken.gguf", "deepseek2", tensors, Q.Q8_0,
                                         exchange_experts)}


# A file of either architecture, its config read from the keys llama.cpp's converter writes:
# tests/test_derived_leftovers2.py


@pytest.fixture
def config_of_the_folder(monkeypatch, deepseek):
    """The GGUF's config given as the Hugging Face folder's (the step transformers' tables cannot do for deepseek2)."""
    import json

    import parity.sources.gguf as gguf_source

    config = json.loads((deepseek["hf"] / "config.json").read_text())
    monkeypatch.setattr(gguf_source, "config_from_metadata", lambda header: (dict(config), []))


def test_dense_layers_before_moe_ones_are_units_in_gguf_names(capsys, deepseek, config_of_the_folder):
    code, report, err = run_json(capsys, "compare", deepseek["hf"], deepseek["Q8_0"])
    assert code == 0 and report["passed"], err
    assert [u for u in units(report) if u[2] != "block"] == DEEPSEEK_UNITS
    code, report, err = run_json(capsys, "compare", deepseek["hf"], deepseek["broken"])
    assert code == 1, err
    assert {u for u, r in zip(units(report), report["layers"], strict=True) if not r["passed"]} == {(1, 1, None),
                                                                                                    (1, 2, None)}
    assert {r["diagnosis"]["id"] for r in report["layers"] if not r["passed"]} == {"expert_shifted"}
    code, report, err = run_json(capsys, deepseek["Q8_0"], "--layers", "all")
    assert code == 0 and report["passed"], err
    assert [u for u in units(report) if u[2] != "block"] == DEEPSEEK_UNITS


def test_each_unit_is_named_in_ggufs_own_names(deepseek, config_of_the_folder):
    from parity.engine.layout.resolve import resolve

    mapping = resolve(str(deepseek["Q8_0"])).mapping
    layouts = {unit.unit: unit for unit in (mapping, *mapping.parts)}
    assert layouts[None].layers == (1, 2) and layouts[None].experts.stacked[0] == "ffn_gate_exps.weight"
    assert layouts["mlp"].layers == (0,) and {r.source for r in layouts["mlp"].tensors} == {
        "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"}
    assert layouts["shared_experts"].layers == (1, 2) and {r.source for r in layouts["shared_experts"].tensors} == {
        "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight"}


def drop_up(layer: int, tensors: dict) -> dict:
    if layer == 1:
        tensors.pop("ffn_up_exps.weight")
    return tensors


def three_experts(layer: int, tensors: dict) -> dict:
    if layer == 1:
        tensors["ffn_up_exps.weight"] = tensors["ffn_up_exps.weight"][:3]
    return tensors


@pytest.mark.parametrize("edit, said", [
    (drop_up, "layer 1's FFN tensors are missing"),
    (three_experts, "'blk.1.ffn_up_exps.weight' (shape [3, 32, 32]) stacks 3 experts, the config says 4"),
])
def test_a_stacked_tensor_missing_or_short_is_named(capsys, files, tmp_path, edit, said):
    """Exit 2 in one line naming the file's tensor, not a traceback or a mismatch of every expert."""
    path = moe_gguf_of_folder(files["qwen3moe"]["hf"], tmp_path / "bad.gguf", "qwen3moe", per_expert(), Q.Q8_0, edit)
    code, out, err = run_main(capsys, path)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and said in lines[0] and "blk.1.ffn_up_exps.weight" in lines[0], out + err


# -- gate and up fused in one stacked tensor: gguf's FFN_GATE_UP_EXP ('ffn_gate_up_exps', [E, 2·ff, d], gate rows
# first), which gguf lists for Qwen3-Next among others.  transformers' GGUF tables do not read 'qwen3next' either: the
# config is given as the folder's, as for DeepSeek above.

NEXT = dict(VALUES, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)


def fused_gate_up(state: dict, layer: int) -> dict[str, np.ndarray]:
    out = per_expert("shared_expert")(state, layer)
    out["ffn_gate_up_exps.weight"] = np.concatenate([out.pop("ffn_gate_exps.weight"),
                                                     out.pop("ffn_up_exps.weight")], axis=1)
    return out


def halves_exchanged(layer: int, tensors: dict) -> dict:
    """Layer 1's fused gate_up written up first: every expert's gate and up exchanged."""
    if layer == 1:
        gate, up = np.split(tensors["ffn_gate_up_exps.weight"], 2, axis=1)
        tensors["ffn_gate_up_exps.weight"] = np.concatenate([up, gate], axis=1)
    return tensors


@pytest.fixture
def qwen3_next(tmp_path_factory, monkeypatch) -> dict[str, Path]:
    import json

    import parity.sources.gguf as gguf_source

    root = tmp_path_factory.mktemp("gguf-qwen3next")
    hf = build("qwen3_next", root / "qwen3_next", 80, **NEXT)
    config = json.loads((hf / "config.json").read_text())
    monkeypatch.setattr(gguf_source, "config_from_metadata", lambda header: (dict(config), []))
    return {"hf": hf, "Q8_0": moe_gguf_of_folder(hf, root / "next.gguf", "qwen3next", fused_gate_up, Q.Q8_0),
            "broken": moe_gguf_of_folder(hf, root / "next-broken.gguf", "qwen3next", fused_gate_up, Q.Q8_0,
                                         halves_exchanged)}


def test_a_fused_gate_up_exps_is_read_as_its_halves(capsys, qwen3_next):
    from parity.engine.layout.resolve import resolve

    experts = resolve(str(qwen3_next["Q8_0"])).mapping.experts
    assert [(r.source, r.chunk) for r in (experts.gate, experts.up)] == [("ffn_gate_up_exps.weight", (0, 2)),
                                                                         ("ffn_gate_up_exps.weight", (1, 2))]
    every = in_report_order(routed() + [(0, None, "shared_expert"), (1, None, "shared_expert")])
    code, report, err = run_json(capsys, "compare", qwen3_next["hf"], qwen3_next["Q8_0"])
    assert code == 0 and report["passed"], err
    assert [u for u in units(report) if u[2] != "block"] == every  # and each layer's block, its router written
    code, report, err = run_json(capsys, "compare", qwen3_next["hf"], qwen3_next["broken"])
    assert code == 1, err
    failed = [r for u, r in zip(units(report), report["layers"], strict=True) if not r["passed"]]
    assert {(r["layer"], r["expert"]) for r in failed} == {(1, e) for e in range(4)}
    assert {r["diagnosis"]["id"] for r in failed} == {"gate_up_exchanged"}
