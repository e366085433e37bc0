"""Mixture-of-experts families no mapping file serves: their layout derived from transformers itself
(parity/engine/layout/derive.py, parity/engine/layout/experts.py).

Each family is a tiny checkpoint built with transformers' own classes (from_config + save_pretrained), so what is
on disk is what transformers writes: one tensor per expert that its load-time conversion merges (Qwen3-MoE, OLMoE,
PhiMoE's w1/w3/w2, MiniMax), fused tensors under another name (Granite MoE's input_linear), fused [E, d, 2·ff]
tensors computed as x @ W beside a shared expert (Llama 4), a shared expert (Qwen2-MoE), dense layers before MoE
ones (DeepSeek V3's first_k_dense_replace), interleaved gate/up with biases (GPT-OSS).  For each: ``parity compare
A A`` passes on every unit, a broken export fails on the broken units only and is named, the default target passes
(or is the one-line exit 2 where no module of parity.ffn expresses the experts), and ports pass with --target alone.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from .derived_checkpoints import MOE, build, build_all, in_report_order
from .support import run_json, run_main

EXPERTS = [(layer, expert, None) for layer in (0, 1) for expert in range(4)]


def with_unit(unit: str, layers=(0, 1), experts_in=(0, 1)) -> list[tuple]:
    return in_report_order([(layer, expert, None) for layer in experts_in for expert in range(4)]
                           + [(layer, None, unit) for layer in layers])


# model_type -> (config values, every unit a compare judges, how layer 1 is broken, the units that must fail, the
# diagnosis they must carry)
FAMILIES = {
    "qwen3_moe": (MOE, EXPERTS, ("gate_up", 2), {(1, 2, None)}, "gate_up_exchanged"),
    "olmoe": (MOE, EXPERTS, ("experts", 1, 2), {(1, 1, None), (1, 2, None)}, "expert_shifted"),
    "phimoe": (MOE, EXPERTS, ("gate_up", 0), {(1, 0, None)}, "gate_up_exchanged"),  # w1/w3/w2 per expert
    "minimax": (MOE, EXPERTS, ("negate", "experts.3.w2"), {(1, 3, None)}, "sign_flipped"),
    "granitemoe": (MOE, EXPERTS, ("halves", "input_linear"), {(1, e, None) for e in range(4)}, "gate_up_exchanged"),
    "llama4_text": (MOE, with_unit("shared_expert"), ("halves", "experts.gate_up_proj"),
                    {(1, e, None) for e in range(4)}, "gate_up_exchanged"),
    "qwen2_moe": (MOE, with_unit("shared_expert"), ("negate", "shared_expert.down_proj"),
                  {(1, None, "shared_expert")}, "sign_flipped"),
    "deepseek_v3": (dict(MOE, num_hidden_layers=3, first_k_dense_replace=1, n_group=2, topk_group=1),  # 0 dense
                    in_report_order([(0, None, "mlp"), *with_unit("shared_experts", (1, 2), (1, 2))]),
                    ("negate", "experts.1.down_proj"), {(1, 1, None)}, "sign_flipped"),
    "gpt_oss": (MOE, EXPERTS, ("interleaving", "experts.gate_up_proj"), {(1, e, None) for e in range(4)},
                "gate_up_reordered"),
}


def broken_copy(folder: Path, dest: Path, how: tuple) -> Path:
    """A copy of the checkpoint with layer 1 broken the way ``how`` says, written with safetensors."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, dest)
    tensors = load_file(dest / "model.safetensors")
    layer = {name: t for name, t in tensors.items() if ".layers.1." in name}
    kind, *args = how
    if kind == "gate_up":  # one expert's gate and up exchanged (per-expert tensors)
        gate = next(n for n in layer if f".experts.{args[0]}." in n and (".gate_proj." in n or ".w1." in n))
        up = gate.replace(".gate_proj.", ".up_proj.").replace(".w1.", ".w3.")
        tensors[gate], tensors[up] = layer[up].clone(), layer[gate].clone()
    elif kind == "experts":  # two experts exchanged, every tensor of each
        for name in [n for n in layer if f".experts.{args[0]}." in n]:
            other = name.replace(f".experts.{args[0]}.", f".experts.{args[1]}.")
            tensors[name], tensors[other] = layer[other].clone(), layer[name].clone()
    elif kind == "negate":
        name = next(n for n in layer if args[0] in n and "bias" not in n)
        tensors[name] = -layer[name]
    else:  # a fused gate/up: its halves exchanged, or its interleaved rows written as halves
        name = next(n for n in layer if args[0] in n and "bias" not in n)
        fused = layer[name]
        dim = 2 if fused.shape[1] == 32 else 1  # the 2·ff axis ([E, d, 2ff] computed as x @ W, or [E, 2ff, d])
        if kind == "halves":
            first, second = fused.chunk(2, dim=dim)
            tensors[name] = torch.cat([second, first], dim=dim).contiguous()
        else:
            rows = fused.movedim(dim, 0)
            tensors[name] = torch.cat([rows[0::2], rows[1::2]]).movedim(0, dim).contiguous()
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


@pytest.fixture(scope="session")
def moe_families(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """model_type -> (its tiny checkpoint, a broken export of it)."""
    return build_all(tmp_path_factory.mktemp("derived-moe"), FAMILIES, broken_copy)


def units(report: dict) -> list[tuple]:
    """The report's units but the whole blocks (tests/test_moe_block.py and blocks_of judge those)."""
    return [(r["layer"], r["expert"], r["unit"]) for r in report["layers"] if r["unit"] != "block"]


def blocks_of(report: dict) -> set[int]:
    """The layers whose whole MoE block a compare judged."""
    return {r["layer"] for r in report["layers"] if r["unit"] == "block"}


@pytest.mark.parametrize("model_type", FAMILIES)
def test_compare_against_itself_judges_every_unit(capsys, moe_families, model_type):
    """Every expert, shared expert and dense layer is a unit of its own, each judged and passing."""
    folder, _ = moe_families[model_type]
    code, report, err = run_json(capsys, "compare", folder, folder)
    assert code == 0 and report["passed"], err
    assert units(report) == FAMILIES[model_type][1]
    assert blocks_of(report) == {layer for layer, expert, _ in units(report) if expert is not None}
    assert report["mapping"].startswith("derived from transformers")


@pytest.mark.parametrize("model_type", FAMILIES)
def test_broken_export_fails_on_the_broken_units_only_and_is_named(capsys, moe_families, model_type):
    folder, broken = moe_families[model_type]
    _, _, _, failing, named = FAMILIES[model_type]
    code, report, err = run_json(capsys, "compare", folder, broken)
    assert code == 1, err
    failed = {(r["layer"], r["expert"], r["unit"]) for r in report["layers"] if not r["passed"]}
    # the whole blocks judge what no other unit reads (the router, ...): a broken expert or shared expert is its own
    assert failed == failing
    assert {r["diagnosis"]["id"] for r in report["layers"] if not r["passed"]} == {named}


@pytest.mark.parametrize("model_type", [t for t in FAMILIES if t != "gpt_oss"])
def test_default_target_checks_every_unit(capsys, moe_families, model_type):
    """SwiGLU of each unit's own width (an expert's moe_intermediate_size, the dense layers' intermediate_size)."""
    folder, _ = moe_families[model_type]
    code, report, err = run_json(capsys, folder)
    assert code == 0 and report["passed"], err
    assert units(report) == FAMILIES[model_type][1] and report["target"] == "parity.ffn:SwiGLU"


def test_gpt_oss_default_target_refuses_in_one_line(capsys, moe_families):
    """No module of parity.ffn computes GPT-OSS's clamped activation: exit 2 in one line, with both ways on."""
    code, out, err = run_main(capsys, moe_families["gpt_oss"][0])
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, out + err
    assert "GptOssExperts" in lines[0] and "alpha, limit" in lines[0] and "--target" in lines[0]


# -- ports, written the way each family's own ports are -------------------------------------------------------------
class GatedExpert(nn.Module):
    """One expert (or a dense FFN of the same shape), its sizes by parameter name: built per unit by parity."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.w1 = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.w3 = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.w2 = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class OssExpert(nn.Module):
    """GPT-OSS's expert as a port writes it: biased projections, gate clamped above, up clamped both ways, (up + 1)."""

    def __init__(self, config, clamp: bool = True):
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(d, f), nn.Linear(d, f), nn.Linear(f, d)
        self.alpha, self.limit, self.clamp = config.swiglu_alpha, config.swiglu_limit, clamp

    def forward(self, x):
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.clamp:
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return self.down_proj((up + 1) * gate * torch.sigmoid(gate * self.alpha))


def oss_expert(config):
    return OssExpert(config)


def oss_expert_unclamped(config):
    return OssExpert(config, clamp=False)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "qwen2_moe", "phimoe"])
def test_a_port_passes_with_target_alone(capsys, moe_families, model_type):
    """Routes read off the port's names (w1/w3/w2), each unit built at its own width by parameter name."""
    code, report, err = run_json(capsys, moe_families[model_type][0], "--target",
                                 "tests.test_derived_experts:GatedExpert")
    assert code == 0 and report["passed"], err
    assert units(report) == FAMILIES[model_type][1]


def test_gpt_oss_port_passes_and_one_without_the_clamp_fails(capsys, moe_families):
    """The interleaved gate/up and the biases reach the port as its own gate/up/down.  The clamp only changes the
    output where a pre-activation passes swiglu_limit (7): the experts hold no activation module, so parity's probe
    reads both branches (the smaller of the gate's largest positive value and up's largest magnitude) and scales the
    inputs to reach 8 on it: every expert of the unclamped port fails."""
    folder = moe_families["gpt_oss"][0]
    code, report, err = run_json(capsys, folder, "--target", "tests.test_derived_experts:oss_expert")
    assert code == 0 and report["passed"], err
    assert all(r["preactivation_range"] and max(map(abs, r["preactivation_range"])) > 7 for r in report["layers"])
    code, report, err = run_json(capsys, folder, "--target", "tests.test_derived_experts:oss_expert_unclamped")
    assert code == 1 and not any(r["passed"] for r in report["layers"]), err


def test_inspect_shows_the_unit_of_the_layer_asked(capsys, moe_families):
    """DeepSeek's layer 0 is a dense MLP of intermediate_size, its later layers experts of moe_intermediate_size."""
    folder = moe_families["deepseek_v3"][0]
    for layer, width, module in ((0, 72, "DeepseekV3MLP"), (2, 24, "DeepseekV3Experts")):
        code, info, err = run_json(capsys, "inspect", folder, "--layer", layer)
        assert code == 0, err
        assert info["intermediate_size"] == width and info["reference"].endswith(module)


@pytest.mark.parametrize("model_type", ["phi3", "glm"])  # phi3: mappings/phi3.toml; glm: derived
def test_a_dense_fused_gate_up_with_its_halves_exchanged_is_named(capsys, tmp_path, model_type):
    """One fused gate_up_proj [2·ff, d] whose halves are exchanged is gate and up exchanged, not a corrupted value;
    written interleaved where transformers reads halves, it is the layout mistake."""
    from safetensors.torch import load_file, save_file

    folder = build(model_type, tmp_path / model_type, 5, intermediate_size=72, num_key_value_heads=2, head_dim=16)
    for how, named in (("halves", "gate_up_exchanged"), ("interleaving", "gate_up_reordered")):
        broken = tmp_path / f"{model_type}-{how}"
        shutil.copytree(folder, broken)
        tensors = load_file(broken / "model.safetensors")
        name = next(n for n in tensors if ".layers.1." in n and "gate_up_proj" in n)
        first, second = tensors[name].chunk(2)
        tensors[name] = (torch.cat([second, first]) if how == "halves"
                         else torch.stack([first, second], dim=1).flatten(0, 1)).contiguous()
        save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
        code, report, err = run_json(capsys, "compare", folder, broken)
        assert code == 1, err
        assert [(r["layer"], r["diagnosis"]["id"]) for r in report["layers"] if not r["passed"]] == [(1, named)]


def test_a_hub_id_from_the_cache_is_derived_like_a_folder(capsys, monkeypatch, tmp_path, moe_families):
    """A derived MoE family named by hub id, read through huggingface_hub's offline cache (laid out as the hub lays
    it), compares unit for unit against the same model as a local folder, and checks with the default target."""
    from .support import cache_repo, use_hf_home

    folder = moe_families["deepseek_v3"][0]
    cache_repo(tmp_path / "hf_home", "tiny-org/deepseek", folder)
    use_hf_home(monkeypatch, tmp_path / "hf_home")
    code, report, err = run_json(capsys, "compare", "tiny-org/deepseek", folder)
    assert code == 0 and report["passed"] and units(report) == FAMILIES["deepseek_v3"][1], err
    code, report, err = run_json(capsys, "tiny-org/deepseek", "--layers", "0-1")
    assert code == 0 and report["passed"] and report["weights"] == "real", err


def test_load_ffn_takes_each_unit_of_a_layer(moe_families):
    """parity.load_ffn: an expert (expert=N), a named unit (unit='shared_experts'), a dense leading layer's FFN; a
    layer of several units without either is refused, naming them."""
    import parity
    from parity.errors import LayerRangeError

    folder = str(moe_families["deepseek_v3"][0])
    widths = {(0, None, None): 72, (1, 2, None): 24, (1, None, "shared_experts"): 24}
    for (layer, expert, unit), width in widths.items():
        module = parity.load_ffn(folder, layer=layer, expert=expert, unit=unit)
        assert module._gate.weight.shape == (width, 32)
    with pytest.raises(LayerRangeError, match="routed experts .expert=N., shared_experts: pass expert=N or unit"):
        parity.load_ffn(folder, layer=1)
    with pytest.raises(LayerRangeError, match="has no unit 'mlp'"):
        parity.load_ffn(folder, layer=1, unit="mlp")


def test_per_expert_and_fused_stores_of_one_model_compare_equal(capsys, tmp_path, moe_families):
    """transformers' own fused layout on disk (save_pretrained(save_original_format=False): gate_up_proj
    [E, 2ff, d]) is read as such, and judged unit for unit against the per-expert store of the same model."""
    from transformers import AutoModelForCausalLM

    folder = moe_families["qwen3_moe"][0]
    fused = tmp_path / "qwen3_moe-fused"
    AutoModelForCausalLM.from_pretrained(folder).save_pretrained(fused, save_original_format=False)
    code, report, err = run_json(capsys, "compare", folder, fused)
    assert code == 0 and report["passed"] and units(report) == EXPERTS, err
    assert all(r["conversion"]["identical"] for r in report["layers"])
    code, report, err = run_json(capsys, fused)
    assert code == 0 and report["passed"] and units(report) == EXPERTS, err


class ConfigMLP(nn.Module):
    """A port with transformers' own signature, MLP(config, intermediate_size=None): the config's width by default."""

    def __init__(self, config, intermediate_size=None):
        super().__init__()
        d, f = config.hidden_size, intermediate_size or config.intermediate_size
        self.gate_proj, self.up_proj = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def test_a_port_taking_the_config_gets_each_units_width(capsys, moe_families):
    """Built as transformers builds its MLPs: the config, and intermediate_size where a unit's differs (an expert's
    moe_intermediate_size, the shared expert's); the dense leading layer keeps the config's."""
    code, report, err = run_json(capsys, moe_families["deepseek_v3"][0], "--target",
                                 "tests.test_derived_experts:ConfigMLP")
    assert code == 0 and report["passed"] and units(report) == FAMILIES["deepseek_v3"][1], err


def test_inspect_shows_a_layout_whose_default_target_no_module_expresses(capsys, moe_families):
    """GPT-OSS: inspect shows the layout and tensors, and the target's one-line refusal where a check would stop."""
    code, out, err = run_main(capsys, "inspect", moe_families["gpt_oss"][0])
    assert code == 2 and "model.layers.0.mlp.experts.gate_up_proj" in out and "cannot be built" in out, out + err
    assert out.splitlines()[0].count("derived from transformers") == 1
