"""What the derivation still refused after its first rounds, each a tiny checkpoint built with transformers' own
classes (from_config + save_pretrained), broken copies written with safetensors:

- ``--save-mapping FILE`` of a run whose layout was derived (no mapping file) writes that layout in full as a
  mapping file; ``--mapping FILE`` then gives the same routes and the same verdicts (a dense family, experts fused on
  disk, GPT-OSS's interleaved gate/up with biases); a layout the format cannot express is exit 2 naming the part;
- GGUF files of 'deepseek2' (DeepSeek V2 and V3) and 'glm4moe' (GLM-4.5), whose metadata transformers' GGUF tables
  do not read: their config comes from the keys llama.cpp's converter writes (dense leading layers, expert and
  shared-expert counts and widths; V3 told from V2 by its selection bias), each written here with GGUFWriter's own
  calls (tests/gguf_files.py: converted_moe_gguf); compare HF-vs-GGUF passes on every unit and names a broken one;
- HRM keeps its decoder layers in two lists (the H and L levels, each a stack of the same layer), each layer's MLP
  a unit named after its list, its gate and up stored as one gate_up_proj that transformers' load-time conversion
  cuts in two (Chunk(dim=0)): read as those chunks;
- LongCat-Flash: each decoder layer holds two attentions and two MLPs in lists (``mlps.0``, ``mlps.1``, each a unit)
  and a mixture whose gate_up_proj also stacks zero-computation (identity) experts past down_proj's count: the
  routed experts are the units;
- Inkling: a fused experts module whose router also scores its shared experts (its weight [E + S, d]), the shared
  experts held as stacks, not projections (no unit of their own: said, and judged within the whole block);
  Inkling 2 stores each layer's experts as one w13_weight whose gate and up rows alternate, which transformers'
  conversion de-interleaves (Interleave(dim=1)): read as alternate rows; its softcapped SwiGLU has no repository
  module (exit 2 in one line).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from .derived_checkpoints import COMMON, KV, MOE, build, in_report_order, one_line
from .gguf_files import Q, converted_moe_gguf
from .support import run_json, run_main


def build_fused(model_type: str, folder: Path, seed: int, **values) -> Path:
    """``build``, written in transformers' own fused layout (save_original_format=False): gate_up_proj
    [E, 2·ff, d] and down_proj [E, d, ff] on disk, as the module holds them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{**COMMON, **values})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.05)
    model.save_pretrained(folder, save_original_format=False)
    return folder


@pytest.fixture(scope="session")
def saved_families(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("save-mapping")
    return {"qwen3": build("qwen3", root / "qwen3", 11, intermediate_size=72, **KV),
            "qwen3_moe": build_fused("qwen3_moe", root / "qwen3_moe", 12, **MOE),
            "gpt_oss": build("gpt_oss", root / "gpt_oss", 13, **MOE),
            "deepseek_v3": build("deepseek_v3", root / "deepseek_v3", 14,
                                 **dict(MOE, num_hidden_layers=3, first_k_dense_replace=1, n_group=2, topk_group=1))}


def verdicts(report: dict) -> list[tuple]:
    return [(r["layer"], r.get("expert"), r.get("unit"), r["passed"], (r.get("diagnosis") or {}).get("id"))
            for r in report["layers"]]


# model_type -> (the --target of a port that passes, of one that fails; None: the default target)
ROUND_TRIPS = {
    "qwen3": (None, "parity.examples:SwappedSwiGLU"),
    "qwen3_moe": (None, "parity.examples:SwappedSwiGLU"),
    "gpt_oss": ("tests.test_derived_experts:oss_expert", "tests.test_derived_experts:oss_expert_unclamped"),
}


@pytest.mark.parametrize("model_type", sorted(ROUND_TRIPS))
def test_a_derived_layout_saved_as_a_mapping_gives_the_same_routes_and_verdicts(capsys, saved_families, tmp_path,
                                                                                model_type):
    folder = saved_families[model_type]
    for passes, target in zip((True, False), ROUND_TRIPS[model_type], strict=True):
        path = tmp_path / f"{model_type}-{passes}.toml"
        chosen = ["--target", target] if target else []
        code, derived, err = run_json(capsys, folder, *chosen, "--save-mapping", path)
        assert code == (0 if passes else 1) and derived["mapping"].startswith("derived from transformers"), err
        text = path.read_text()
        assert "extends" not in text and "[reference]" in text and "[checkpoint]" in text
        code, saved, err = run_json(capsys, folder, "--mapping", path)
        assert code == (0 if passes else 1), err
        assert not saved["mapping"].startswith("derived from") and saved["target"] == derived["target"]
        assert saved["routes"]["tensors"] == derived["routes"]["tensors"]
        assert saved["reference_routes"] == derived["reference_routes"]
        assert verdicts(saved) == verdicts(derived) and len(verdicts(saved)) >= 2
        assert all(v[3] == passes for v in verdicts(saved))
        if not passes and target.startswith("parity.examples"):
            assert {v[4] for v in verdicts(saved)} == {"gate_up_swapped"}


def test_the_saved_fused_layout_reads_each_expert_out_of_the_stacks(capsys, saved_families, tmp_path):
    """Experts fused on disk: the file's [experts] names the stacked tensors and each expert's halves."""
    import tomllib

    path = tmp_path / "fused.toml"
    code, _, err = run_main(capsys, saved_families["qwen3_moe"], "--save-mapping", path)
    assert code == 0, err
    experts = tomllib.loads(path.read_text())["experts"]
    assert experts["count"] == 4 and experts["stacked"] == ["down_proj", "gate_up_proj"]
    assert experts["gate"] == {"from": "gate_up_proj", "chunk": [0, 2]}
    assert experts["up"] == {"from": "gate_up_proj", "chunk": [1, 2]}
    gpt_oss = tmp_path / "oss.toml"
    code, _, err = run_main(capsys, saved_families["gpt_oss"], "--target", "tests.test_derived_experts:oss_expert",
                            "--save-mapping", gpt_oss)
    experts = tomllib.loads(gpt_oss.read_text())["experts"]
    assert code == 0 and experts["gate"]["interleaved"] and experts["up_bias"]["interleaved"], err


def test_a_derived_layout_a_mapping_file_cannot_express_is_exit_2_naming_the_part(capsys, saved_families, tmp_path):
    """DeepSeek V3: a dense layer 0, then routed and shared experts: three units, and a mapping file holds one."""
    path = tmp_path / "deepseek.toml"
    code, out, err = run_main(capsys, saved_families["deepseek_v3"], "--save-mapping", path)
    line = one_line(err)
    assert code == 2 and not path.exists(), out + err
    assert "--save-mapping" in line and "3 kinds of unit" in line and "shared_experts" in line
    assert "nothing written" in line and "Traceback" not in out + err


def test_the_json_report_holds_no_layout_object(capsys, saved_families):
    code, report, err = run_json(capsys, saved_families["qwen3"])
    assert code == 0 and "layout" not in report, err
    json.dumps(report)


# -- GGUF: deepseek2 and glm4moe ------------------------------------------------------------------------------------
# widths Q8_0's 32-value blocks divide; layer 0 dense, layers 1 and 2 routed experts and a shared expert
GGUF_MOE = dict(intermediate_size=64, num_key_value_heads=2, head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=32, n_shared_experts=1, num_hidden_layers=3, first_k_dense_replace=1)
GGUF_FAMILIES = {"deepseek_v3": ("deepseek2", dict(n_group=2, topk_group=1)), "deepseek_v2": ("deepseek2", {}),
                 "glm4_moe": ("glm4moe", {})}
GGUF_UNITS = in_report_order([(0, None, "mlp"), *[(layer, e, None) for layer in (1, 2) for e in range(4)],
                              (1, None, "shared_experts"), (2, None, "shared_experts")])


def break_gguf(layer: int, tensors: dict) -> dict:
    """Layer 1: experts 1 and 2 exchanged in every stacked tensor; layer 2: expert 0's gate and up exchanged."""
    if layer == 1:
        for name in ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"):
            tensors[name] = tensors[name][[0, 2, 1, 3]]
    if layer == 2:
        gate, up = tensors["ffn_gate_exps.weight"].copy(), tensors["ffn_up_exps.weight"].copy()
        gate[0], up[0] = up[0].copy(), gate[0].copy()
        tensors["ffn_gate_exps.weight"], tensors["ffn_up_exps.weight"] = gate, up
    return tensors


@pytest.fixture(scope="session")
def gguf_moe(tmp_path_factory) -> dict[str, tuple[Path, Path, Path]]:
    """model_type -> (the Hugging Face folder, its Q8_0 GGUF, a broken Q8_0 GGUF)."""
    root = tmp_path_factory.mktemp("gguf-moe-beyond")
    built = {}
    for seed, (model_type, (arch, values)) in enumerate(GGUF_FAMILIES.items()):
        folder = build(model_type, root / model_type, 40 + seed, **GGUF_MOE, **values)
        built[model_type] = (folder, converted_moe_gguf(folder, root / f"{model_type}.gguf", arch, Q.Q8_0),
                             converted_moe_gguf(folder, root / f"{model_type}-broken.gguf", arch, Q.Q8_0, break_gguf))
    return built


def gguf_units(report: dict) -> list[tuple]:
    return [(r["layer"], r.get("expert"), r.get("unit")) for r in report["layers"]]


@pytest.mark.parametrize("model_type", sorted(GGUF_FAMILIES))
def test_a_gguf_of_deepseek2_or_glm4moe_compares_unit_by_unit(capsys, gguf_moe, model_type):
    folder, gguf, _ = gguf_moe[model_type]
    code, report, err = run_json(capsys, "compare", folder, gguf)
    assert code == 0 and report["passed"], err
    # each MoE layer's whole block too: its router and selection bias read through gguf's name map
    assert sorted(gguf_units(report), key=str) == sorted(GGUF_UNITS + [(1, None, "block"), (2, None, "block")], key=str)
    said = [note for note in report["notes"] if "GGUF architecture" in note]
    assert said and f"model_type '{model_type}'" in said[0], report["notes"]


@pytest.mark.parametrize("model_type", sorted(GGUF_FAMILIES))
def test_a_broken_gguf_of_deepseek2_or_glm4moe_fails_on_the_broken_units_only(capsys, gguf_moe, model_type):
    folder, _, broken = gguf_moe[model_type]
    code, report, err = run_json(capsys, "compare", folder, broken)
    assert code == 1, err
    failed = {u: r["diagnosis"]["id"] for u, r in zip(gguf_units(report), report["layers"], strict=True)
              if not r["passed"]}
    assert failed == {(1, 1, None): "expert_shifted", (1, 2, None): "expert_shifted",
                      (2, 0, None): "gate_up_exchanged"}, failed


@pytest.mark.parametrize("model_type", sorted(GGUF_FAMILIES))
def test_a_gguf_of_deepseek2_or_glm4moe_is_checked_with_the_default_target(capsys, gguf_moe, model_type):
    code, report, err = run_json(capsys, gguf_moe[model_type][1], "--layers", "all")
    assert code == 0 and report["passed"], err
    assert gguf_units(report) == GGUF_UNITS and "GGUF names from gguf" in report["mapping"]


# -- HRM: two lists of decoder layers, a fused gate_up_proj on disk --------------------------------------------------
HRM_UNITS = [(layer, None, unit) for layer in (0, 1) for unit in ("L_module.mlp", "H_module.mlp")]


@pytest.fixture(scope="session")
def hrm(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny HRM (two layers per level) and a copy whose H level's layer 1 has its gate and up halves exchanged."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("hrm")
    folder = build("hrm_text", root / "hrm_text", 21, intermediate_size=72, head_dim=16)
    broken = root / "hrm-broken"
    shutil.copytree(folder, broken)
    tensors = load_file(broken / "model.safetensors")
    name = "model.H_module.layers.1.mlp.gate_up_proj.weight"
    gate, up = tensors[name].chunk(2)
    tensors[name] = torch.cat([up, gate]).contiguous()
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    return folder, broken


def test_hrm_compares_each_levels_mlp_as_a_unit(capsys, hrm):
    code, report, err = run_json(capsys, "compare", hrm[0], hrm[0])
    assert code == 0 and report["passed"], err
    assert sorted(gguf_units(report)) == sorted(HRM_UNITS)


def test_hrm_broken_export_fails_on_that_level_and_layer_only(capsys, hrm):
    code, report, err = run_json(capsys, "compare", hrm[0], hrm[1])
    assert code == 1, err
    failed = {u: r["diagnosis"]["id"] for u, r in zip(gguf_units(report), report["layers"], strict=True)
              if not r["passed"]}
    assert failed == {(1, None, "H_module.mlp"): "gate_up_exchanged"}, failed


def test_hrm_is_checked_with_the_default_target_reading_the_fused_tensors_halves(capsys, hrm):
    code, report, err = run_json(capsys, hrm[0])
    assert code == 0 and report["passed"] and sorted(gguf_units(report)) == sorted(HRM_UNITS), err
    assert report["routes"]["tensors"]["_gate.weight"] == {"from": "gate_up_proj.weight", "chunk": [0, 2]}
    assert report["routes"]["tensors"]["_up.weight"] == {"from": "gate_up_proj.weight", "chunk": [1, 2]}


# -- LongCat-Flash: two dense MLPs in a list, routed experts beside zero-computation ones ---------------------------
LONGCAT = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=2, n_routed_experts=4, num_experts_per_tok=2,
               expert_ffn_hidden_size=24, intermediate_size=72, head_dim=16)  # 4 sublayers: 2 decoder layers
LONGCAT_UNITS = [(layer, e, None) for layer in (0, 1) for e in range(4)] + [
    (layer, None, unit) for layer in (0, 1) for unit in ("mlps.0", "mlps.1")]


@pytest.fixture(scope="session")
def longcat(tmp_path_factory) -> tuple[Path, Path]:
    """A two-layer LongCat-Flash (zero_expert_num at its default: 256 identity experts beside the 4 routed ones)
    and a copy whose layer 1 has experts 1 and 2 exchanged and mlps.1's gate and up exchanged."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    root = tmp_path_factory.mktemp("longcat")
    config = AutoConfig.for_model("longcat_flash", vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                  **LONGCAT)
    torch.manual_seed(31)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.05)
    folder, broken = root / "longcat_flash", root / "longcat-broken"
    model.save_pretrained(folder)
    shutil.copytree(folder, broken)
    tensors = load_file(broken / "model.safetensors")
    stem = "model.layers.1."
    for part in ("gate_proj", "up_proj", "down_proj"):
        one, two = f"{stem}mlp.experts.1.{part}.weight", f"{stem}mlp.experts.2.{part}.weight"
        tensors[one], tensors[two] = tensors[two].clone(), tensors[one].clone()
    gate, up = f"{stem}mlps.1.gate_proj.weight", f"{stem}mlps.1.up_proj.weight"
    tensors[gate], tensors[up] = tensors[up].clone(), tensors[gate].clone()
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    return folder, broken


def test_longcat_compares_its_routed_experts_and_both_mlps(capsys, longcat):
    """Each routed expert and both dense MLPs, every layer; and where transformers' LongcatFlashMoE calls its experts
    as a block parity runs (5.25: ``experts(hidden, top_k_index, top_k_weights)``, the identity experts routed around
    them; 5.24 kept them inside the experts), each layer's whole block too, on every layer alike."""
    code, report, err = run_json(capsys, "compare", longcat[0], longcat[0])
    assert code == 0 and report["passed"], err
    units = gguf_units(report)
    assert sorted((u for u in units if u[2] != "block"), key=str) == sorted(LONGCAT_UNITS, key=str)
    assert [u for u in units if u[2] == "block"] in ([], [(0, None, "block"), (1, None, "block")])


def test_longcat_broken_export_fails_on_the_broken_units_only(capsys, longcat):
    code, report, err = run_json(capsys, "compare", longcat[0], longcat[1])
    assert code == 1, err
    failed = {u: r["diagnosis"]["id"] for u, r in zip(gguf_units(report), report["layers"], strict=True)
              if not r["passed"]}
    assert failed == {(1, 1, None): "expert_shifted", (1, 2, None): "expert_shifted",
                      (1, None, "mlps.1"): "gate_up_exchanged"}, failed


def test_longcat_is_checked_with_the_default_target(capsys, longcat):
    code, report, err = run_json(capsys, longcat[0], "--layers", "all")
    assert code == 0 and report["passed"], err
    assert sorted(gguf_units(report), key=str) == sorted(LONGCAT_UNITS, key=str)


# -- Inkling: routed experts whose router also scores the shared ones; shared experts as stacks ----------------------
@pytest.fixture(scope="session")
def inkling(tmp_path_factory) -> tuple[Path, Path]:
    """A two-layer Inkling, both layers MoE, and a copy whose layer 1 has experts 1 and 2 exchanged (in both fused
    stacks) and whose layer 0 has its shared experts' gate and up exchanged."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("inkling")
    folder = build("inkling_text", root / "inkling_text", 51, **dict(MOE, mlp_layer_types=["sparse", "sparse"]))
    broken = root / "inkling-broken"
    shutil.copytree(folder, broken)
    tensors = load_file(broken / "model.safetensors")
    for name in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        stack = tensors[name].clone()
        stack[[1, 2]] = stack[[2, 1]]
        tensors[name] = stack.contiguous()
    gate, up = "model.layers.0.mlp.shared_experts.gate_proj", "model.layers.0.mlp.shared_experts.up_proj"
    tensors[gate], tensors[up] = tensors[up].clone(), tensors[gate].clone()
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    return folder, broken


def test_inkling_compares_its_experts_and_whole_blocks(capsys, inkling):
    code, report, err = run_json(capsys, "compare", inkling[0], inkling[0])
    assert code == 0 and report["passed"], err
    assert gguf_units(report) == [unit for layer in (0, 1)
                                  for unit in [*((layer, e, None) for e in range(4)), (layer, None, "block")]]


def test_inkling_broken_export_fails_on_the_broken_units_only(capsys, inkling):
    code, report, err = run_json(capsys, "compare", inkling[0], inkling[1])
    assert code == 1, err
    failed = {u: r["diagnosis"]["id"] for u, r in zip(gguf_units(report), report["layers"], strict=True)
              if not r["passed"]}
    assert failed == {(1, 1, None): "expert_shifted", (1, 2, None): "expert_shifted",
                      (0, None, "block"): "block_tensor_changed"}, failed


def test_inkling_check_says_its_shared_experts_are_not_a_unit(capsys, inkling):
    code, report, err = run_json(capsys, inkling[0])
    assert code == 0 and report["passed"] and len(report["layers"]) == 8, err
    said = [note for note in report["notes"] if "shared_experts.gate_proj" in note]
    assert said and "not checked on their own" in said[0] and "whole block" in said[0]


@pytest.fixture(scope="session", params=["inkling2_text", "inkling2_loop_text"])
def inkling2(tmp_path_factory, request) -> tuple[Path, Path]:
    """A two-layer Inkling 2 (its config needs a vocabulary past its 200k special tokens) and a copy whose layer 1
    expert 0 has gate and up exchanged (in w13_weight's alternate rows) and whose layer 0 has experts 2 and 3
    exchanged.  Inkling 2 Loop's conversion reads w13_weight with its quantization scales, amax and denominator
    and dequantizes before it de-interleaves; saved unquantized, it holds w13_weight alone, which that
    dequantization returns unchanged (measured: engine.layout.renaming.lone_source)."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("inkling2")
    folder = build(request.param, root / request.param, 61, **dict(MOE, vocab_size=200_100))
    broken = root / "inkling2-broken"
    shutil.copytree(folder, broken)
    tensors = load_file(broken / "model.safetensors")
    name = "model.llm.layers.1.mlp.experts.w13_weight"
    fused = tensors[name].clone()
    fused[0, 0::2], fused[0, 1::2] = tensors[name][0, 1::2], tensors[name][0, 0::2]
    tensors[name] = fused.contiguous()
    for name in ("model.llm.layers.0.mlp.experts.w13_weight", "model.llm.layers.0.mlp.experts.w2_weight"):
        stack = tensors[name].clone()
        stack[[2, 3]] = stack[[3, 2]]
        tensors[name] = stack.contiguous()
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    return folder, broken


def test_inkling2_reads_its_interleaved_w13_expert_by_expert(capsys, inkling2):
    code, report, err = run_json(capsys, "compare", inkling2[0], inkling2[0])
    assert code == 0 and report["passed"], err
    assert {u[:2] for u in gguf_units(report)} >= {(layer, e) for layer in (0, 1) for e in range(4)}
    code, report, err = run_json(capsys, "compare", inkling2[0], inkling2[1])
    assert code == 1, err
    failed = {u: r["diagnosis"]["id"] for u, r in zip(gguf_units(report), report["layers"], strict=True)
              if not r["passed"]}
    assert failed == {(1, 0, None): "gate_up_exchanged", (0, 2, None): "expert_shifted",
                      (0, 3, None): "expert_shifted"}, failed


def test_inkling2_default_target_refuses_in_one_line(capsys, inkling2):
    code, out, err = run_main(capsys, inkling2[0])
    line = one_line(err)
    assert code == 2 and "Experts" in line and "--target" in line, out + err


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_a_lone_source_keeps_an_operation_that_reorders_any_dimension(dim):
    """lone_source drops only what returns its one tensor unchanged: transformers' Interleave along any dimension
    reorders it (probed on [2, 4, 6], Interleave(dim=0) came back unchanged and was dropped: an independent review),
    a Concatenate of one tensor is that tensor."""
    from transformers.core_model_loading import Concatenate, Interleave, WeightConverter

    from parity.engine.layout.renaming import lone_source

    def reduced(op):
        return lone_source(WeightConverter(source_patterns=[r"w\.x", r"w\.scale"], target_patterns="w.y",
                                           operations=[op]))

    kept = reduced(Interleave(dim=dim))
    assert kept is not None and [type(op) for op in kept.operations] == [Interleave]
    assert kept.source_patterns == [r"w\.x"]
    assert reduced(Concatenate(dim=dim)) is None
