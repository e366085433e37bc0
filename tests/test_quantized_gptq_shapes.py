"""``parity compare`` on GPTQ files of a real model's shapes as GPTQModel 7.7.0 writes them (issue 29).

stories260K's d_ff is 172, no multiple of 32 / bits: GPTQModel allocates ceil(172 x bits / 32) int32 words along that
dimension (``_register_gptq_buffers``; ``pack_original`` leaves the last word's tail zero) and its
``dequantize_weight`` drops the tail codes past g_idx's inputs and the scales' outputs.  Its own int4 export of a
stand-in with those shapes (down_proj's qweight [22, 64] for 172 inputs, gate's qzeros [1, 22] for 172 outputs) was
refused on every layer as ``group_bits_mismatched`` (4.09 bits each).  GPTQModel is not installed here: the export
below packs the codes itself, as it lays them out.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from . import test_quantized_int as quantizer
from .derived_checkpoints import format_fixtures, quantized_copy, save_quantized
from .support import compare_json as compare

SIZES = dict(hidden_size=64, intermediate_size=172, num_key_value_heads=2)
GROUP = 128

root, model_a = format_fixtures("gptq-shapes", SIZES)


def padded(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[n, cols] codes (n not a multiple of 32 / bits) packed along the first axis in ceil(n x bits / 32) words, the
    last word's tail zero, as GPTQModel's ``pack_original`` writes them."""
    per = 32 // bits
    tail = torch.zeros(-codes.shape[0] % per, codes.shape[1], dtype=codes.dtype)
    return quantizer.pack_rows(torch.cat([codes, tail]), bits)


def uneven_export(a: Path, dest: Path, *, stated_bits: int = 4) -> Path:
    """A's folder as GPTQModel writes int4 in groups of 128 (symmetric, v1: zero points stored minus one), each
    group's codes rounded to nearest from its symmetric range; ``stated_bits``: the bits config.json states."""
    bits = 4

    def stored(name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
        w = value.float()
        g_idx = torch.arange(w.shape[1]) // GROUP
        groups = int(g_idx.max()) + 1
        scales, zeros = torch.zeros(w.shape[0], groups), torch.zeros(w.shape[0], groups)
        for g in range(groups):
            scales[:, g], zeros[:, g] = quantizer.group_params(w[:, g_idx == g], bits, sym=True)
        codes = torch.clamp(torch.round(w / scales[:, g_idx] + zeros[:, g_idx]), 0, (1 << bits) - 1).long()
        module = name.removesuffix(".weight")
        return {f"{module}.qweight": padded(codes.t(), bits),
                f"{module}.qzeros": padded((zeros - 1).long(), bits).t().contiguous(),
                f"{module}.scales": scales.t().contiguous().half(), f"{module}.g_idx": g_idx.to(torch.int32)}

    return save_quantized(dest, quantized_copy(a, dest, stored), {
        "bits": stated_bits, "group_size": GROUP, "desc_act": False, "sym": True, "quant_method": "gptq",
        "checkpoint_format": "gptq", "pack_dtype": "int32"})


def test_a_dimension_no_multiple_of_the_word_is_read_as_gptqmodel_pads_it(model_a, root, capsys):
    """down_proj's 172 inputs in 22 words, gate's and up's 172 outputs' zero points in 22: the export passes on every
    layer, round to nearest on its own grid (x conv 1.00)."""
    b = uneven_export(model_a, root / "int4")
    stored = load_file(b / "model.safetensors")
    assert stored["model.layers.0.mlp.down_proj.qweight"].shape == (22, 64)
    assert stored["model.layers.0.mlp.gate_proj.qzeros"].shape == (1, 22)
    code, report = compare(capsys, model_a, b)
    assert code == 0, report
    for layer in report["layers"]:
        assert layer["passed"], layer
        assert layer["conversion"]["ratio_to_conversion"] < 1.01, layer["conversion"]


def test_padded_words_stated_as_eight_bits_are_still_named(model_a, root, capsys):
    """The padding read is no licence for another width: 22 words hold 172 codes at 4 bits, at 8 they would be 43."""
    code, report = compare(capsys, model_a, uneven_export(model_a, root / "int4-as-8", stated_bits=8))
    assert code == 1, report
    for layer in report["layers"]:
        assert not layer["passed"]
        assert layer["diagnosis"]["id"] == "group_bits_mismatched", layer["diagnosis"]


def fine_grid(g_idx: torch.Tensor, rows: int, bits: int, method: str, fold: str | None = None):
    """A ``group_grid.Grid`` of ``bits`` and ``method`` for ``rows`` rows of groups ``g_idx`` whose round to nearest
    moves no value measurably (steps of 1e-6 over a range of 2^40 codes): the factors these tests set are B's alone."""
    from parity.engine.compare import group_grid

    steps, groups = torch.full((rows, len(g_idx)), 1e-6, dtype=torch.float64), int(g_idx.max()) + 1
    return group_grid.Grid(steps, torch.zeros_like(steps), -(1 << 40), 1 << 40, torch.full((rows, groups), 1e-6),
                           torch.zeros(rows, groups), g_idx, method, bits, fold=fold)


def test_at_two_bits_only_the_whole_matrix_is_held_to_its_factor():
    """gptqmodel 7.7.0's int2 act-order export of the Gemma 3 270M stand-in had faithful groups whose least-squares
    factor on A was -2.2 (four levels: GPTQ's compensation outweighs a group of small values) and a row at 0.7987;
    both failed quantization_exceeds_step.  At 2 bits a row's or group's factor is not judged; the matrix's is, and at
    4 bits the same group still fails."""
    from parity.engine.compare import group_grid

    generator = torch.Generator().manual_seed(0)
    a = torch.randn(8, 64, generator=generator, dtype=torch.float64)
    a[0, :32] *= 0.01  # one group of tiny values ...
    b = a.clone()
    b[0, :32] = -2.2 * a[0, :32]  # ... that B holds at -2.2 x: the matrix's factor stays near 1
    g_idx = torch.arange(64) // 32
    two = group_grid.value_scales(a, b, fine_grid(g_idx, 8, 2, "gptq"))
    four = group_grid.value_scales(a, b, fine_grid(g_idx, 8, 4, "gptq"))
    assert four["beyond"] and four["block"] < 0, four
    assert not two["beyond"] and 0.99 < two["tensor"] < 1.01, two
    whole = group_grid.value_scales(a, 2 * a, fine_grid(g_idx, 8, 2, "gptq"))
    assert whole["beyond"], whole


def test_an_awq_group_clipped_below_gptqs_bound_passes_and_one_scaled_up_fails():
    """AWQ's clip search shrinks a group's range by up to half (gptqmodel's ``_compute_best_clip(max_shrink=0.5)``):
    its AWQ GEMM export of the Qwen2.5 0.5B stand-in held a down_proj group at 0.467 x A, under GPTQ's 0.5, and failed
    quantization_exceeds_step on a faithful layer.  An AWQ group (``method "awq"``, or scales folded and undone) is
    held to 0.35-1.6: that group passes there, fails as GPTQ; a group x2 or x0.2 fails either way."""
    from parity.engine.compare import group_grid

    generator = torch.Generator().manual_seed(1)
    a = torch.randn(8, 1024, generator=generator, dtype=torch.float64)  # eight groups a row: its row stays near 1
    g_idx = torch.arange(1024) // 128
    awq, folded, gptq = (fine_grid(g_idx, 8, 4, "awq"), fine_grid(g_idx, 8, 4, "pack-quantized", "up_proj's rows"),
                         fine_grid(g_idx, 8, 4, "gptq"))

    def with_group(factor: float) -> torch.Tensor:
        b = a.clone()
        b[3, 128:256] = factor * a[3, 128:256]
        return b

    clipped = with_group(0.467)
    for grid in (awq, folded):
        found = group_grid.value_scales(a, clipped, grid)
        assert not found["beyond"] and abs(found["block"] - 0.467) < 1e-6, found
        for factor in (2.0, 0.2):
            assert group_grid.value_scales(a, with_group(factor), grid)["beyond"], factor
    assert group_grid.value_scales(a, clipped, gptq)["beyond"]


def test_a_clipped_group_leaves_the_factor_on_its_conversion_at_one_and_scales_x_1_15_fail():
    """AWQ's clip search (and GPTQ's mse observer) fits a group's scale to a shrunk range and clamps the values beyond
    it: over the whole matrix B is then A's x < 1, but A rounded to nearest on B's own grid (its conversion) clamps
    alike, so B's factor on that stays 1 (``conversion.on_conversion``); every scale x1.15 over the same codes does
    not (A clamps less on the wider grid: x1.1 sits at 1.069, within the bound, where every group is clipped)."""
    from parity.engine.compare import conversion, group_grid

    generator = torch.Generator().manual_seed(2)
    a = torch.randn(16, 256, generator=generator, dtype=torch.float64)
    g_idx = torch.arange(256) // 128
    top = torch.stack([a[:, g_idx == g].abs().amax(1) for g in range(2)], 1)
    scales = top * 0.6 / 7  # every group's range shrunk to 60 % of its largest magnitude, symmetric int4
    grid = group_grid.Grid(scales[:, g_idx], torch.full((16, 256), 8.0, dtype=torch.float64), 0, 15, scales,
                           torch.full((16, 2), 8.0), g_idx, "awq", 4)
    clipped = grid.values(grid.codes(a))
    bounds = conversion.CONVERTED_GROUP_SCALE
    found = conversion.on_conversion(group_grid.value_scales(a, clipped, grid), clipped, clipped, bounds)
    assert found["tensor"] < 0.97 and found["converted"] == pytest.approx(1.0, abs=1e-9), found
    assert not found["beyond"], found
    wider = group_grid.Grid(grid.steps * 1.15, grid.zeros, 0, 15, scales * 1.15, grid.group_zeros, g_idx, "awq", 4)
    up = conversion.on_conversion(group_grid.value_scales(a, clipped * 1.15, wider), wider.values(wider.codes(a)),
                                  clipped * 1.15, bounds)
    assert up["beyond"] and up["converted"] > bounds[1], up


def test_a_half_step_rounds_as_each_writer_rounds_it():
    """Values at half a step, zero point 3 (odd): GPTQ and AWQ round x / scale and then add the zero point, so 2.5
    rounds half to even to 2 and lands on code 5; compressed-tensors adds the zero point first, 5.5 rounds to code 6.
    A's conversion on B's grid rounds as B's writer does (compressed-tensors' own ``quantize`` is the truth for
    pack-quantized; GPTQModel's ``torch.round(x / scale) + zero`` for GPTQ).  GPTQ's were compressed-tensors' before."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize

    from parity.engine.compare import group_grid

    x = torch.tensor([[0.25, -0.15, 0.45, 0.05]])  # (k + 0.5) x 0.1: 2.5, -1.5, 4.5, 0.5 steps
    scale, zero = torch.full((1, 1), 0.1), torch.full((1, 1), 3.0)
    g_idx = torch.zeros(4, dtype=torch.long)

    def codes(method: str) -> torch.Tensor:
        grid = group_grid.Grid(scale.expand(1, 4), zero.expand(1, 4), 0, 15, scale, zero, g_idx, method, 4)
        return grid.codes(x)

    args = QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=4)
    stored = quantize(x, scale, zero.to(torch.int8) - 8, args) + 8  # int4 stored signed, codes 0-15 shifted
    assert torch.equal(codes("pack-quantized").float(), stored.float()), (codes("pack-quantized"), stored)
    gptq = torch.clamp(torch.round(x / scale) + zero, 0, 15)
    assert torch.equal(codes("gptq").float(), gptq) and torch.equal(codes("awq").float(), gptq)
    assert not torch.equal(gptq, stored.float())  # the two writers do split on these values
