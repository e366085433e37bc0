"""What the derivation still refused after its first rounds, each a tiny checkpoint built with transformers' own
classes (from_config + save_pretrained), broken copies written with safetensors:

- ``--save-mapping FILE`` of a run whose layout was derived (no mapping file) writes that layout in full as a
  mapping file; ``--mapping FILE`` then gives the same routes and the same verdicts (a dense family, experts fused on
  disk, GPT-OSS's interleaved gate/up with biases); a layout the format cannot express is exit 2 naming the part.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from .derived_checkpoints import COMMON, KV, MOE, build, one_line
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
