"""A whole MoE block as one unit (issue 28): a user's block against transformers' own sparse block for the layer.

Checkpoints are tiny ones built with transformers' own classes; the blocks under test are written from scratch in
tests/moe_block_ports.py (correct, and each with one real mistake), or are transformers' own block built from the
config (which must pass: same function)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from parity.api import check

from . import moe_block_ports as ports
from .derived_checkpoints import MOE, build
from .moe_blocks import FAMILIES, recorded_builds, streamed_check
from .support import run_json, run_main

HERE = Path(__file__).resolve().parent

def own_block(model_type: str):
    """transformers' own block for the checkpoint's config, as a user's factory would build it."""
    def make(config):
        from transformers import AutoModelForCausalLM

        layer = AutoModelForCausalLM.from_config(copy.deepcopy(config)).model.layers[-1]
        return getattr(layer, "feed_forward", None) or layer.mlp
    return make


CORRECT = [("mixtral", ports.MixtralBlock), ("qwen2_moe", ports.QwenSharedBlock), ("deepseek_v3", ports.DeepSeekBlock),
           ("gpt_oss", ports.GptOssBlock), ("llama4_text", ports.Llama4Block), ("qwen3_moe", ports.SoftmaxTopK),
           ("qwen2_moe", ports.OwnNamesQwenBlock), ("mixtral", ports.StackedMixtralBlock)]


@pytest.mark.parametrize(("model_type", "port"), CORRECT, ids=[p.__name__ for _, p in CORRECT])
def test_a_correct_block_written_from_scratch_passes_on_every_moe_layer(blocks, model_type, port):
    report = check(str(blocks[model_type]), target=port)
    assert report.passed, report
    moe_layers = [r for r in report.layers]
    assert moe_layers and all(r.unit == "block" and r.expert is None for r in moe_layers)
    for result in moe_layers:
        coverage = result.coverage
        assert coverage["never_chosen"] == [] and len(coverage["tokens_per_expert"]) == 4
        # every token judged picks top-k experts: the counts add up to k per token judged
        assert sum(coverage["tokens_per_expert"]) == 2 * (coverage["tokens"] - coverage["set_aside"])


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_transformers_own_block_passes_as_a_target(blocks, model_type):
    report = check(str(blocks[model_type]), target=own_block(model_type))
    assert report.passed, report
    assert "whole sparse block" in report.reference


MISTAKEN = [("mixtral", ports.MixtralNoRenorm, "router_renormalization_missing"),
            ("qwen2_moe", ports.QwenSharedMissing, "shared_expert_missing"),
            ("qwen2_moe", ports.QwenSharedGateAfterSum, "shared_expert_gate_after_sum"),
            ("deepseek_v3", ports.DeepSeekBiasInWeights, "selection_bias_in_weights"),
            ("deepseek_v3", ports.DeepSeekScalingDropped, "routed_scaling_dropped"),
            ("gpt_oss", ports.GptOssHalves, "gate_up_interleaving_misread"),
            ("gpt_oss", ports.GptOssNoClamp, "swiglu_clamp_missing"),
            ("llama4_text", ports.Llama4ScoreOnOutput, "router_score_on_output"),
            ("mixtral", ports.StackedMixtralGateUpSwapped, "gate_up_swapped")]


@pytest.mark.parametrize(("model_type", "port", "named"), MISTAKEN, ids=[p.__name__ for _, p, _ in MISTAKEN])
def test_a_block_with_a_routing_mistake_fails_on_every_moe_layer_and_is_named(blocks, model_type, port, named):
    report = check(str(blocks[model_type]), target=port)
    assert not report.passed
    assert report.layers and all(not r.passed and r.unverifiable is None for r in report.layers)
    assert all(r.max_abs_diff > 100 * r.tolerance for r in report.layers)
    assert {r.diagnosis.id for r in report.layers} == {named}, report


def test_dense_layers_before_moe_ones_are_said_not_checked(blocks):
    report = check(str(blocks["deepseek_v3"]), target=ports.DeepSeekBlock)
    assert [r.layer for r in report.layers] == [1]
    assert any("layers 0 hold no sparse block" in note for note in report.notes)


def test_every_view_names_the_block_unit_and_its_coverage(blocks, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(HERE)
    junit, html = tmp_path / "r.xml", tmp_path / "r.html"
    code, report, _ = run_json(capsys, blocks["qwen2_moe"], "--target", "moe_block_ports:QwenSharedBlock",
                               "--junit", junit, "--html", html)
    assert code == 0 and report["units"] == ["block"]
    assert [layer["unit"] for layer in report["layers"]] == ["block", "block"]
    assert all(layer["coverage"]["never_chosen"] == [] for layer in report["layers"])
    assert 'testcase name="layer 0 block"' in junit.read_text() and 'failures="0"' in junit.read_text()
    assert "coverage (layer 1/block): 48 tokens, every expert chosen" in junit.read_text()
    page = html.read_text()
    assert "routing coverage" in page and "coverage (layer 1/block): 48 tokens, every expert chosen" in page
    code, out, _ = run_main(capsys, blocks["qwen2_moe"], "--target", "moe_block_ports:QwenSharedMissing")
    assert code == 1 and "coverage (layer 1/block): 48 tokens, every expert chosen" in out
    assert "whole sparse block" in out


def test_the_json_report_validates_against_the_shipped_schema(blocks, capsys, monkeypatch):
    jsonschema = pytest.importorskip("jsonschema")
    from parity.engine.results import SCHEMA_FILE

    monkeypatch.chdir(HERE)
    code, report, _ = run_json(capsys, blocks["gpt_oss"], "--target", "moe_block_ports:GptOssBlock")
    assert code == 0
    jsonschema.validate(report, json.loads(SCHEMA_FILE.read_text()))


def test_experts_selected_mean_one_expert_at_a_time(blocks):
    report = check(str(blocks["qwen2_moe"]), target="parity.ffn:SwiGLU", experts="0,1", layers=0)
    assert {r.expert for r in report.layers if r.unit is None} == {0, 1}


def test_block_without_a_target_is_refused_in_one_line(blocks, capsys):
    code, _, err = run_main(capsys, blocks["qwen2_moe"], "--block")
    assert code == 2 and "--block checks your own MoE block" in err and "Traceback" not in err


def test_a_block_of_the_wrong_width_fails_with_the_shape_named(blocks):
    report = check(str(blocks["olmoe"]), target=ports.SoftmaxTopK)  # OLMoE's experts are intermediate_size wide
    assert not report.passed and all(r.diagnosis.id == "shape_mismatch" for r in report.layers)


def test_a_config_transformers_block_cannot_run_is_one_line_and_compare_goes_on(tmp_path, capsys):
    """DeepSeek V3's default n_group (8) over four experts: transformers' own block fails on it. A block check is exit
    2 in one line; a compare judges every expert and says why the blocks are not compared."""
    folder = build("deepseek_v3", tmp_path / "ds", 5, **dict(MOE, first_k_dense_replace=1))
    code, _, err = run_main(capsys, folder, "--target", "tests.moe_block_ports:DeepSeekBlock", "--block")
    assert code == 2 and "cannot run layer 1's whole block with this config.json" in err and "internal" not in err
    code, report, err = run_json(capsys, "compare", folder, folder)
    assert code == 0 and report["passed"], err
    assert not any(r["unit"] == "block" for r in report["layers"])
    assert any("whole MoE blocks are not compared" in note for note in report["notes"])


@pytest.mark.parametrize(("model_type", "port", "passes"), [
    ("qwen2_moe", ports.QwenSharedBlock, True), ("llama4_text", ports.Llama4Block, True),
    ("gpt_oss", ports.GptOssBlock, True), ("gpt_oss", ports.GptOssNoClamp, False),
    ("deepseek_v3", ports.DeepSeekScalingDropped, False)], ids=lambda v: getattr(v, "__name__", str(v)))
def test_a_block_too_large_to_hold_is_streamed_one_expert_at_a_time(blocks, monkeypatch, model_type, port, passes):
    """Past HELD_BYTES transformers' block runs its own routing around experts computed one at a time; the verdicts
    are those of the block held whole, and each expert is read once for both the float64 and float32 runs (the reads
    of a failing block's replays, engine.check.block_replay, counted apart: tests/test_streamed_replays.py).  A
    routing mistake, and one inside an expert, is named as on the held block."""
    from parity.engine.check import block_check

    reads, replay_reads = [], []
    held = check(str(blocks[model_type]), target=port)
    monkeypatch.setattr(block_check, "HELD_BYTES", 0)
    original, mistake = block_check.BlockCheck.stored_expert, block_check.streamed_mistake

    def counted(self, layer, expert):
        if self._last[0] != (layer, expert):
            reads.append((layer, expert))
        return original(self, layer, expert)

    def replayed(*args, **kwargs):
        before = len(reads)
        try:
            return mistake(*args, **kwargs)
        finally:
            replay_reads.extend(reads[before:])
            del reads[before:]

    monkeypatch.setattr(block_check.BlockCheck, "stored_expert", counted)
    monkeypatch.setattr(block_check, "streamed_mistake", replayed)
    streamed = check(str(blocks[model_type]), target=port)
    assert held.passed is passes and streamed.passed is passes, streamed
    assert bool(replay_reads) is not passes
    for a, b in zip(held.layers, streamed.layers, strict=True):
        assert b.coverage["never_chosen"] == [] and (a.passed, a.layer) == (b.passed, b.layer)
        if passes:
            assert b.max_abs_diff <= b.tolerance
        elif port is ports.GptOssNoClamp:  # the clamp is inside each expert: replayed on each expert streamed
            assert b.diagnosis.id == a.diagnosis.id == "swiglu_clamp_missing"
        else:
            assert b.max_abs_diff > 100 * b.tolerance and b.diagnosis.id == a.diagnosis.id == "routed_scaling_dropped"
    truth_reads = [r for r in reads if r[0] == streamed.layers[-1].layer]
    assert len(truth_reads) <= 4 + 4 + 4 * 3 + 8  # the reach sample, the one streamed pass, the target's fill


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_expert_of_a_grouped_router_is_chosen_and_a_dropped_one_is_caught(many_experts, seed):
    report = check(str(many_experts), target=ports.DeepSeekBlock, seed=seed)
    assert report.passed, report
    assert report.layers[0].coverage["never_chosen"] == []
    dropped = check(str(many_experts), target=ports.DeepSeekDropsExpert7, seed=seed)
    assert not dropped.passed and dropped.layers[0].unverifiable is None


@pytest.mark.parametrize(("model_type", "port"), [
    ("qwen2_moe", ports.QwenSharedBlock), ("deepseek_v3", ports.DeepSeekBlock), ("gpt_oss", ports.GptOssBlock),
    ("llama4_text", ports.Llama4Block)], ids=lambda v: getattr(v, "__name__", str(v)))
def test_a_streamed_block_builds_each_expert_from_its_stored_values_with_the_held_truth_and_noise(
        blocks, monkeypatch, model_type, port):
    """A streamed block's float64 and float32 experts are copies made straight from the stored values (no float64
    copy on the way to float32): its noise floor and its distance from the truth are the held block's, token for
    token the same function."""
    held = check(str(blocks[model_type]), target=port)
    streamed = streamed_check(monkeypatch, blocks[model_type], port)
    assert held.passed and streamed.passed, streamed
    for a, b in zip(held.layers, streamed.layers, strict=True):
        assert b.noise_floor > 0 and 0.5 <= b.noise_floor / a.noise_floor <= 2.0, (a.noise_floor, b.noise_floor)
        assert b.max_abs_diff <= b.tolerance / 10 or b.max_abs_diff <= 2 * a.max_abs_diff


class QwenDropoutAlways(ports.QwenSharedBlock):
    """A correct block whose output goes through dropout even in eval mode (``training=True`` hard-coded); records
    the shape of every input it is given."""

    shapes: list = []

    def forward(self, x):
        QwenDropoutAlways.shapes.append(tuple(x.shape))
        return torch.nn.functional.dropout(super().forward(x), 0.1, training=True)


class QwenRecorded(ports.QwenSharedBlock):
    shapes: list = []

    def forward(self, x):
        QwenRecorded.shapes.append(tuple(x.shape))
        return super().forward(x)


def test_a_streamed_block_is_run_once_on_every_token_and_twice_on_a_few_for_determinism(blocks, monkeypatch):
    """A streamed block reads its experts at every run: its determinism is checked on REPEAT_TOKENS tokens run twice
    (not a second run on every token); a block whose dropout is always on is still named, a correct one passes."""
    from parity.engine.check.block_check import REPEAT_TOKENS

    folder = blocks["qwen2_moe"]
    QwenRecorded.shapes.clear()
    report = streamed_check(monkeypatch, folder, QwenRecorded)
    assert report.passed and all(r.deterministic for r in report.layers), report
    full = report.layers[0].coverage["tokens"]
    d = QwenRecorded.shapes[0][-1]
    per_layer = [(3, full // 3, d), (1, REPEAT_TOKENS, d), (1, REPEAT_TOKENS, d)]
    assert QwenRecorded.shapes == per_layer * len(report.layers)
    dropout = streamed_check(monkeypatch, folder, QwenDropoutAlways)
    assert not dropout.passed
    assert all(not r.deterministic and r.diagnosis.id == "dropout_active" for r in dropout.layers), dropout
    held = check(str(folder), target=QwenDropoutAlways)
    assert all(r.diagnosis.id == "dropout_active" for r in held.layers)


def test_a_defective_expert_read_ahead_in_a_streamed_block_is_one_line(blocks, monkeypatch, tmp_path, capsys):
    """A streamed block's experts are read one ahead by a worker thread: a NaN in one of them is still the
    checkpoint's defect said in one line (exit 2), raised where the expert is used, never a traceback."""
    import shutil

    from safetensors.torch import load_file, save_file

    from parity.engine.check import block_check

    folder = tmp_path / "qwen"
    shutil.copytree(blocks["qwen2_moe"], folder)
    tensors = load_file(folder / "model.safetensors")
    name = next(n for n in tensors if ".experts.2." in n and n.endswith("down_proj.weight"))
    tensors[name][0, 0] = float("nan")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    monkeypatch.setattr(block_check, "HELD_BYTES", 0)
    monkeypatch.chdir(HERE)
    code, _, err = run_main(capsys, folder, "--target", "moe_block_ports:QwenSharedBlock", "--block")
    assert code == 2 and "NaN/Inf" in err and name in err and "Traceback" not in err, err


def meta_experts_of(folder: Path):
    """(config, transformers' fused experts module of the checkpoint's model, on the meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return config, next(m for m in model.modules() if isinstance(getattr(m, "down_proj", None), torch.nn.Parameter)
                        and m.down_proj.dim() == 3)


def stored_expert(meta, d: int, width: int, seed: int) -> dict[str, torch.Tensor]:
    """One expert's tensors as a bfloat16 checkpoint stores them ([out, in]; biases where the module has them)."""
    generator = torch.Generator().manual_seed(seed)
    shapes = {"gate": (width, d), "up": (width, d), "down": (d, width)}
    if hasattr(meta, "gate_up_proj_bias"):
        shapes |= {"gate_bias": (width,), "up_bias": (width,), "down_bias": (d,)}
    return {role: (torch.randn(shape, generator=generator) * 0.3).bfloat16() for role, shape in shapes.items()}


@pytest.mark.parametrize("model_type", ["mixtral", "deepseek_v3", "gpt_oss", "llama4_text", "qwen3_moe"])
def test_an_expert_computed_a_slice_of_its_units_at_a_time_is_the_whole_expert_in_float64(blocks, model_type):
    """SlicedExpert (transformers' experts module on a few intermediate units at a time, the slices summed; the last
    slice narrower) computes in float64 what the module holding the whole expert does, to float64 rounding: the
    same products, their sum over units taken in parts; GPT-OSS's down bias is added once."""
    from parity.engine.experts import expert_reference, sliced_expert, slices_agree

    config, meta = meta_experts_of(blocks[model_type])
    d = config.hidden_size
    width = meta.down_proj.shape[1] if meta.down_proj.shape[2] == d else meta.down_proj.shape[2]
    routed = stored_expert(meta, d, width, seed=len(model_type))
    bytes_for_5_units = 5 * 8 * d * 3
    sliced = sliced_expert(meta, config, routed, "w", torch.float64, slice_bytes=bytes_for_5_units)
    assert sliced is not None and sliced.width == 5 and width % 5 != 0
    whole = expert_reference(meta, config, {role: t.double() for role, t in routed.items()}, "w")
    x = torch.randn(7, d, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    args = (x, torch.zeros(7, 1, dtype=torch.long), torch.full((7, 1), 0.75, dtype=torch.float64)) \
        if whole.routed else (x,)
    got = sliced(*args)
    with torch.no_grad():
        want = whole.experts(*args)
    assert got.dtype == torch.float64 and got.shape == want.shape
    assert float((got - want).abs().max()) <= 1e-13 * float(want.abs().max()), (got - want).abs().max()
    assert slices_agree(meta, config, routed, "w", slice_bytes=bytes_for_5_units)
    assert sliced_expert(meta, config, routed, "w", torch.float64, slice_bytes=8 * d * 3 * width) is None  # fits


class NormedUnitsExperts(torch.nn.Module):
    """A fused experts module whose units are not independent until down_proj (its activations scaled by their
    norm over all units): computed a slice at a time it would be wrong, so it must be run whole."""

    def __init__(self, config):
        super().__init__()
        self.num_experts, d, f = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.gate_up_proj = torch.nn.Parameter(torch.empty(self.num_experts, 2 * f, d))
        self.down_proj = torch.nn.Parameter(torch.empty(self.num_experts, d, f))

    def forward(self, hidden, index, weights):
        gate, up = torch.nn.functional.linear(hidden, self.gate_up_proj[0]).chunk(2, dim=-1)
        act = torch.nn.functional.silu(gate) * up
        return torch.nn.functional.linear(act / act.norm(dim=-1, keepdim=True), self.down_proj[0]) * weights[:, :1]


def test_a_module_whose_units_interact_is_never_sliced(blocks):
    from transformers import MixtralConfig

    from parity.engine.experts import slices_agree

    config = MixtralConfig(hidden_size=16, intermediate_size=12, num_local_experts=4)
    with torch.device("meta"):
        meta = NormedUnitsExperts(config)
    routed = {role: t.float() for role, t in stored_expert(meta, 16, 12, seed=3).items()}
    assert not slices_agree(meta, config, routed, "w", slice_bytes=5 * 8 * 16 * 3)


@pytest.mark.parametrize(("model_type", "port", "passes"), [
    ("deepseek_v3", ports.DeepSeekBlock, True), ("gpt_oss", ports.GptOssBlock, True),
    ("llama4_text", ports.Llama4Block, True), ("gpt_oss", ports.GptOssNoClamp, False),
    ("deepseek_v3", ports.DeepSeekScalingDropped, False)], ids=lambda v: getattr(v, "__name__", str(v)))
def test_a_streamed_block_computed_a_slice_at_a_time_has_the_held_verdict_truth_and_noise(
        blocks, monkeypatch, model_type, port, passes):
    """Every expert of a streamed block computed 5 intermediate units at a time (SLICE_BYTES made small): the verdict
    is the held block's, the distance from the truth and the noise floor the held block's (float32 sums taken in
    other parts: the same size, not the same bits)."""
    from parity.engine import experts

    held = check(str(blocks[model_type]), target=port)
    slices = []
    original = experts.SlicedExpert.forward
    monkeypatch.setattr(experts.SlicedExpert, "forward",
                        lambda self, *args: slices.append(self.width) or original(self, *args))
    monkeypatch.setattr(experts, "SLICE_BYTES", 5 * 8 * 3 * 32)  # hidden_size 32: 5 units a slice
    streamed = streamed_check(monkeypatch, blocks[model_type], port)
    whole = [width for width in slices if width != 5]  # slices_agree's one run of the whole expert, per layer
    assert slices.count(5) > len(whole) == len(streamed.layers) and min(whole) > 5
    assert held.passed is passes and streamed.passed is passes, streamed
    for a, b in zip(held.layers, streamed.layers, strict=True):
        assert (a.passed, a.layer) == (b.passed, b.layer) and b.coverage["never_chosen"] == []
        assert b.noise_floor > 0 and 0.5 <= b.noise_floor / a.noise_floor <= 2.0, (a.noise_floor, b.noise_floor)
        if passes:
            assert b.max_abs_diff <= b.tolerance / 10 or b.max_abs_diff <= 2 * a.max_abs_diff
        else:
            assert b.max_abs_diff > 100 * b.tolerance and 0.5 <= b.max_abs_diff / a.max_abs_diff <= 2.0


def test_will_need_hints_the_kernel_with_each_named_tensors_bytes_and_passes_over_the_rest(tmp_path, monkeypatch):
    """safetensors_files.will_need asks posix_fadvise(WILLNEED) for exactly the named tensors' byte ranges (the
    header's offsets made absolute); a name the header does not hold, and a file that is not there, are passed over
    (a hint: the read itself says what is wrong)."""
    import os

    from safetensors.torch import save_file

    from parity.sources import safetensors_files as files

    path = tmp_path / "model.safetensors"
    save_file({"a": torch.ones(3, 5), "b": torch.zeros(7, dtype=torch.bfloat16)}, path)
    with path.open("rb") as handle:
        spans = files.parse_header(handle.read(files.header_length(handle.read(8), path.name)), path.name)
    calls = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, length, advice: calls.append((offset, length, advice)),
                        raising=False)
    files.will_need(path, ["b", "not-a-tensor"])
    assert calls == [(spans["b"].start, 14, os.POSIX_FADV_WILLNEED)]
    calls.clear()
    files.will_need(tmp_path / "absent.safetensors", ["a"])
    files.local_reader(lambda name: tmp_path / name).will_need("model.safetensors", ["a", "b"])
    assert calls == [(spans["a"].start, 60, os.POSIX_FADV_WILLNEED), (spans["b"].start, 14, os.POSIX_FADV_WILLNEED)]


@pytest.mark.parametrize("sliced", [False, True], ids=["whole", "sliced"])
def test_a_streamed_block_hints_the_expert_after_the_next_and_keeps_the_held_verdict(blocks, monkeypatch, sliced):
    """While one expert is computed, the next is read by the read-ahead thread (from its first use where the expert
    is computed sliced: no whole copy of it is held) and the kernel is told the one after that will be read
    (safetensors_files.will_need): the hints name that expert's own stored tensors, every expert from the third on,
    and change no value: the verdict, the distance and the noise floor are the held block's."""
    from parity.engine import experts
    from parity.sources import safetensors_files as files

    hinted = []
    monkeypatch.setattr(files, "will_need", lambda path, names: hinted.append(sorted(names)))
    if sliced:
        monkeypatch.setattr(experts, "SLICE_BYTES", 5 * 8 * 3 * 32)
    folder = blocks["qwen2_moe"]
    held = check(str(folder), target=ports.QwenSharedBlock)
    streamed = streamed_check(monkeypatch, folder, ports.QwenSharedBlock)
    assert held.passed and streamed.passed, streamed
    for a, b in zip(held.layers, streamed.layers, strict=True):
        assert b.noise_floor > 0 and 0.5 <= b.noise_floor / a.noise_floor <= 2.0, (a.noise_floor, b.noise_floor)
        assert b.max_abs_diff <= b.tolerance / 10 or b.max_abs_diff <= 2 * a.max_abs_diff
    wanted = [sorted(f"model.layers.{layer.layer}.mlp.experts.{e}.{p}.weight" for p in ("gate_proj", "up_proj",
                                                                                        "down_proj"))
              for layer in streamed.layers for e in (2, 3)]
    assert hinted == wanted


def test_a_failing_read_ahead_is_raised_where_the_expert_is_used_and_its_thread_joined():
    """ReadAhead: an expert whose read fails raises that error when the expert is asked for, and leaving the block
    joins the worker thread (no read left running behind the error)."""
    import threading

    from parity.engine.check.block_check import ReadAhead
    from parity.errors import CheckpointError

    def read(expert):
        if expert == 2:
            raise CheckpointError("expert 2 is defective")
        return {"w": torch.full((2,), float(expert))}

    hinted = []
    with pytest.raises(CheckpointError, match="expert 2"), ReadAhead(read, [0, 1, 2, 3], hinted.append) as ahead:
        assert float(ahead(0, last=True)["w"][0]) == 0.0 and hinted == [2]
        assert float(ahead(1)["w"][0]) == 1.0 and hinted == [2, 3]
        ahead(2)
    assert not [t for t in threading.enumerate() if t.name.startswith("parity-read-ahead")]


@pytest.mark.parametrize("slice_units", [5, None], ids=["sliced", "whole"])
def test_a_streamed_blocks_replays_compute_each_expert_as_its_streamed_pass_did(blocks, monkeypatch, slice_units):
    """The routing replays of a failing streamed block build each expert they read as the streamed pass computed it:
    a cache-sized slice at a time where that pass measured the module computing an expert sliced as whole (no whole
    float64 copy per expert read: the memory goal holds through the replays), whole otherwise; the mistake is named
    as on the held block either way."""
    built = recorded_builds(monkeypatch, slice_units=slice_units)
    folder = blocks["deepseek_v3"]
    held = check(str(folder), target=ports.DeepSeekBiasInWeights)
    streamed = streamed_check(monkeypatch, folder, ports.DeepSeekBiasInWeights)
    assert not held.passed and not streamed.passed
    for a, b in zip(held.layers, streamed.layers, strict=True):
        assert b.diagnosis.id == a.diagnosis.id == "selection_bias_in_weights", b.diagnosis
    assert built and set(built) == {"SlicedExpert" if slice_units else "DeepseekV3Experts"}, set(built)
