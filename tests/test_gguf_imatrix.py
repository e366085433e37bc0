"""A GGUF quantized with an importance matrix (llama.cpp's ``llama-quantize --imatrix``) is judged by its function.

llama.cpp's importance-weighted quantizers choose each block's scale by the error weighted with the matrix and refit
it by least squares, keeping the codes: values of little importance end several steps from A's and a block's step
exceeds what A's values call for.  Exports of a trained tiny LLaMA by llama.cpp's own tools did exactly that, and
every one of Q4_0 to Q6_K failed ``quantization_exceeds_step`` or ``grid_too_coarse`` on every layer while its
function sat at 0.56 to 1.9 x round-to-nearest (docs/compare.md).  llama-quantize names the matrix in the file
(``quantize.imatrix.*``); where it does, in a type whose llama.cpp quantizer uses the matrix
(``gguf_grid.IMPORTANCE_WEIGHTED``: not Q8_0), the per-value and grid rules are relaxed to what a weighted quantizer
does (``gguf_grid.IMPORTANCE_STEPS``, ``IMPORTANCE_GRID_FACTOR``), B's least-squares scale on A is held near 1
(``IMPORTANCE_SCALE``, ``IMPORTANCE_BLOCK_SCALE``), and the function within ``gguf_grid.IMPORTANCE_FACTOR`` x
round-to-nearest; where it does not, the same values remain a finding.  The metadata is only a claim: a round-to-
nearest export carrying it, or a weighted one edited after quantizing, still fails on the layer edited.

The weighted quantizer here follows that description (a scale search, the weighted least-squares refit), written
for these tests; the importance of each input column is log-normal, as squared activations are.
"""

from __future__ import annotations

import numpy as np
import pytest

from parity.engine.compare.conversion import CONVERTED_SCALE

from .conftest import build_model, save
from .gguf_files import Q, write_k_gguf
from .support import run_json

SIZES = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2)
IMATRIX = {"quantize.imatrix.file": "imatrix.gguf", "quantize.imatrix.dataset": "calibration.txt",
           "quantize.imatrix.entries_count": 14, "quantize.imatrix.chunks_count": 20}
LAYERS = 2


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("imatrix")


@pytest.fixture(scope="module")
def model():
    return build_model("llama", seed=11, **SIZES)


@pytest.fixture(scope="module")
def a(model, root):
    return save(model, root / "a")


def weighted_q4_0(values: np.ndarray, importance: np.ndarray) -> np.ndarray:
    """Q4_0 bytes of ``values`` [rows, cols]: per 32-value block, the scale among max / (-8 + k / 10), k in -9..9,
    whose codes (nearest, clamped to -8..7) leave the least importance-weighted error, then refit by weighted least
    squares with those codes kept."""
    rows, cols = values.shape
    x = values.reshape(-1, 32).astype(np.float64)
    w = np.broadcast_to(importance.reshape(1, cols), values.shape).reshape(-1, 32)
    peak = np.take_along_axis(x, np.abs(x).argmax(-1)[:, None], -1)
    best, codes = np.full(len(x), np.inf), np.zeros_like(x)
    scales = np.zeros(len(x))
    for k in range(-9, 10):
        scale = (peak / (-8 + k / 10))[:, 0]
        q = np.clip(np.rint(x / np.where(scale == 0, 1, scale)[:, None]), -8, 7)
        refit = (w * x * q).sum(-1) / np.maximum((w * q * q).sum(-1), 1e-30)
        err = (w * (x - refit[:, None] * q) ** 2).sum(-1)
        take = err < best
        best, codes[take], scales[take] = np.where(take, err, best), q[take], refit[take]
    d = scales.astype(np.float16).reshape(-1, 1).view(np.uint8)
    nibbles = (codes + 8).astype(np.uint8)
    qs = nibbles[:, :16] | (nibbles[:, 16:] << 4)
    return np.concatenate([d, qs], axis=1).reshape(rows, -1)


def importance_of(cols: int, seed: int) -> np.ndarray:
    return np.exp(2.0 * np.random.default_rng(seed).standard_normal(cols))


def export(model, path, *, metadata=None, edits=None):
    """Every FFN tensor of ``model`` quantized by ``weighted_q4_0`` (one importance vector per input width)."""
    weighted = {f"blk.{layer}.ffn_{name}.weight": (lambda values, _data: weighted_q4_0(
        values, importance_of(values.shape[1], values.shape[1]))) for layer in range(LAYERS)
        for name in ("gate", "up", "down")}
    return write_k_gguf(model, path, Q.Q4_0, {**weighted, **(edits or {})}, metadata=metadata)


def test_an_importance_weighted_q4_0_export_passes_by_its_function(model, a, root, capsys):
    b = export(model, root / "weighted.gguf", metadata=IMATRIX)
    code, data, err = run_json(capsys, "compare", a, b)
    assert code == 0, err + str([entry["diagnosis"] for entry in data["layers"]])
    assert any("importance matrix" in note and "calibration.txt" in note for note in data["notes"]), data["notes"]
    steps = [row["steps"]["max_steps"] for entry in data["layers"] for row in entry["conversion"]["tensors"]]
    assert max(steps) > 1.5, steps  # the values that moved, reported as evidence
    for entry in data["layers"]:
        assert entry["conversion"]["ratio_to_conversion"] < 2.0, entry["conversion"]
        assert "3 x" in entry["conversion"]["tolerance_rule"] and "importance matrix" in entry["conversion"][
            "tolerance_rule"], entry["conversion"]["tolerance_rule"]
        for row in entry["conversion"]["tensors"]:  # within the weighted bounds, which are finite
            assert row["grid"] is None and row["steps"]["values_beyond_step"] == 0, row
            assert row["scale"] is not None and not row["scale"]["beyond"], row["scale"]
            assert abs(row["scale"]["tensor"] - 1) < 0.02 and 0.6 < row["scale"]["block"] < 1.4, row["scale"]


def test_the_same_values_without_a_named_importance_matrix_are_a_finding(model, a, root, capsys):
    """Without ``quantize.imatrix.*`` nothing says a weighted quantizer chose these values: the per-value and grid
    rules apply as before."""
    b = export(model, root / "unnamed.gguf")
    code, data, err = run_json(capsys, "compare", a, b)
    assert code == 1, err
    ids = {(entry["diagnosis"] or {}).get("id") for entry in data["layers"]}
    assert ids & {"quantization_exceeds_step", "grid_too_coarse"}, ids


@pytest.mark.parametrize("broken", ["exchanged", "coarse"])
def test_a_broken_layer_of_an_importance_weighted_export_still_fails_on_that_layer(model, a, root, capsys, broken):
    """Gate and up exchanged in layer 1, or its down_proj on a grid 4 x coarser (two bits passed off): layer 1
    fails, layer 0 passes."""
    if broken == "exchanged":
        state = model.state_dict()
        swap = {"blk.1.ffn_gate.weight": "up_proj", "blk.1.ffn_up.weight": "gate_proj"}
        edits = {name: (lambda _values, _data, other=other: weighted_q4_0(
            state[f"model.layers.1.mlp.{other}.weight"].float().numpy(), importance_of(256, 256)))
            for name, other in swap.items()}
    else:
        edits = {"blk.1.ffn_down.weight": lambda values, _data: weighted_q4_0(
            np.round(values / (4 * np.abs(values).max() / 8)) * (4 * np.abs(values).max() / 8),
            importance_of(values.shape[1], values.shape[1]))}
    b = export(model, root / f"{broken}.gguf", metadata=IMATRIX, edits=edits)
    code, data, err = run_json(capsys, "compare", a, b)
    assert code == 1, err
    assert [entry["passed"] for entry in data["layers"]] == [True, False]
    found = data["layers"][1]["diagnosis"]
    if broken == "exchanged":
        assert found["id"] == "gate_up_exchanged", found


def block_scales(rows, blocks, factor, *, weighted=True):
    """A Q4_0 edit: the weighted (or the plain round-to-nearest) quantization of the tensor, then the float16 d of
    each (row, block) listed multiplied by ``factor``: an export edited after quantizing."""
    def edit(values, data):
        data = (weighted_q4_0(values, importance_of(values.shape[1], values.shape[1])) if weighted else data).copy()
        view = data.reshape(values.shape[0], values.shape[1] // 32, 18)
        for r in rows:
            for block in blocks:
                d = view[r, block, :2].copy().view(np.float16).astype(np.float32)
                view[r, block, :2] = (d * factor).astype(np.float16).view(np.uint8)
        return data
    return edit


def coarse_twice(*, weighted=True):
    """A Q4_0 edit: each block's values rounded onto twice the step its largest value calls for, then quantized (the
    weighted quantizer keeps d, the codes all even: one bit passed off)."""
    def edit(values, data):
        x = values.reshape(-1, 32)
        d = np.abs(x).max(-1, keepdims=True) / 8
        y = (np.round(x / (2 * d)) * 2 * d).reshape(values.shape).astype(np.float32)
        if weighted:
            return weighted_q4_0(y, importance_of(values.shape[1], values.shape[1]))
        from gguf.quants import quantize
        return quantize(y, Q.Q4_0)
    return edit


def coarser_block(row, block):
    """A Q4_0 edit: the weighted quantization, then one block re-quantized onto a grid twice as coarse (d x2, its
    codes halved): the block's codes reach 4 of Q4_0's 8, which no quantizer choosing d from the block writes."""
    def edit(values, _data):
        data = weighted_q4_0(values, importance_of(values.shape[1], values.shape[1])).copy()
        blk = data.reshape(values.shape[0], values.shape[1] // 32, 18)[row, block]
        d = blk[:2].copy().view(np.float16).astype(np.float32)
        low, high = (blk[2:] & 15).astype(int) - 8, (blk[2:] >> 4).astype(int) - 8
        low, high = (np.clip(np.floor(q / 2 + 0.5), -8, 7).astype(np.uint8) + 8 for q in (low, high))
        blk[2:] = low | (high << 4)
        blk[:2] = (d * 2).astype(np.float16).view(np.uint8)
        return data
    return edit


DOWN = "blk.1.ffn_down.weight"
EVERY_ROW, EVERY_BLOCK = range(256), range(16)  # down_proj [256, 512] as stored: 16 blocks of 32 per row
EDITED = {  # name: (edit, weighted, the finding expected on layer 1)
    "weighted, one block's d x2": (block_scales([5], [3], 2.0), True, "quantization_exceeds_step"),
    "weighted, one block's d x3": (block_scales([5], [3], 3.0), True, "quantization_exceeds_step"),
    "weighted, one block's d negated": (block_scales([5], [3], -1.0), True, "quantization_exceeds_step"),
    "weighted, four blocks of a row x2": (block_scales([5], [0, 3, 7, 11], 2.0), True, "quantization_exceeds_step"),
    "weighted, one row x1.5": (block_scales([5], EVERY_BLOCK, 1.5), True, "quantization_exceeds_step"),
    "weighted, grid twice as coarse": (coarse_twice(), True, "grid_too_coarse"),
    "weighted, one block re-quantized twice as coarse": (coarser_block(5, 3), True, "grid_too_coarse"),
    "round-to-nearest, every d x1.4": (block_scales(EVERY_ROW, EVERY_BLOCK, 1.4, weighted=False), False,
                                       "tensor_scaled"),
    "round-to-nearest, every d x1.25": (block_scales(EVERY_ROW, EVERY_BLOCK, 1.25, weighted=False), False,
                                        "tensor_scaled"),
    "round-to-nearest, one row x1.5": (block_scales([5], EVERY_BLOCK, 1.5, weighted=False), False,
                                       "quantization_exceeds_step"),
    "round-to-nearest, one block's d negated": (block_scales([5], [3], -1.0, weighted=False), False,
                                                "quantization_exceeds_step"),
}


@pytest.mark.parametrize("case", sorted(EDITED))
def test_an_export_naming_an_importance_matrix_edited_after_quantizing_fails_on_that_layer(model, a, root, capsys,
                                                                                            case):
    """The metadata is a claim, not a licence: a weighted quantizer refits each block's scale to A's values and
    keeps its codes dense, so a block, a row or the tensor multiplied, or a grid with one bit passed off, is a
    finding on layer 1 whatever the keys say; layer 0 (faithful) passes."""
    edit, weighted, expected = EDITED[case]
    path = root / f"edited-{sorted(EDITED).index(case)}.gguf"
    b = (export(model, path, metadata=IMATRIX, edits={DOWN: edit}) if weighted
         else write_k_gguf(model, path, Q.Q4_0, {DOWN: edit}, metadata=IMATRIX))
    code, data, err = run_json(capsys, "compare", a, b)
    assert code == 1, err
    assert [entry["passed"] for entry in data["layers"]] == [True, False], [e["diagnosis"] for e in data["layers"]]
    found = data["layers"][1]["diagnosis"]
    assert found["id"] == expected, found
    assert "down_proj" in found["message"], found


def test_q8_0_is_not_relaxed_by_an_importance_matrix(model, a, root, capsys):
    """llama.cpp's quantize_q8_0 ignores the importance matrix: a Q8_0 file naming one is judged as any Q8_0 is,
    every d of layer 1's down_proj x1.02 (values up to 3 steps off) tensor_scaled; a faithful one passes."""
    from gguf.quants import quantize

    def scaled(values, _data):
        data = quantize(values, Q.Q8_0).copy()
        view = data.reshape(values.shape[0], -1, 34)
        d = view[:, :, :2].copy().view(np.float16).astype(np.float32)
        view[:, :, :2] = (d * 1.02).astype(np.float16).view(np.uint8)
        return data

    faithful = write_k_gguf(model, root / "q8-faithful.gguf", Q.Q8_0, metadata=IMATRIX)
    code, data, err = run_json(capsys, "compare", a, faithful)
    assert code == 0, err
    assert all("importance matrix" not in entry["conversion"]["tolerance_rule"] for entry in data["layers"])
    for row in (row for entry in data["layers"] for row in entry["conversion"]["tensors"]):
        # judged as any Q8_0 is: its factor on A's conversion, no importance-weighted bounds
        assert row["scale"]["bounds"] == [None, None] and not row["scale"]["beyond"], row["scale"]
        assert row["scale"]["converted_bounds"] == list(CONVERTED_SCALE), row["scale"]
    b = write_k_gguf(model, root / "q8-scaled.gguf", Q.Q8_0, {DOWN: scaled}, metadata=IMATRIX)
    code, data, err = run_json(capsys, "compare", a, b)
    assert code == 1, err
    assert [entry["passed"] for entry in data["layers"]] == [True, False]
    found = data["layers"][1]["diagnosis"]  # every d x1.02: B is A's conversion x1.02 (values up to 3 steps off)
    assert found["id"] == "tensor_scaled" and "x 1.02 over A's conversion" in found["message"], found


def test_a_round_to_nearest_block_on_twice_its_step_is_too_coarse_without_the_matrix_too(model, a, root, capsys):
    """gguf's round-to-nearest Q4_0 of values already on twice their step keeps d (the largest value's) and writes
    only even codes: the step the block uses is 2 d, a grid too coarse, with or without the keys."""
    b = write_k_gguf(model, root / "coarse-plain.gguf", Q.Q4_0, {DOWN: coarse_twice(weighted=False)})
    code, data, err = run_json(capsys, "compare", a, b)
    assert code == 1, err
    assert [entry["passed"] for entry in data["layers"]] == [True, False]
    found = data["layers"][1]["diagnosis"]
    assert found["id"] == "grid_too_coarse" and "down_proj" in found["message"], found



def test_a_low_bit_block_left_near_zero_is_within_its_bounds_and_a_negated_one_is_not():
    """llama.cpp's weighted Q2_K leaves a sub-block of little importance at scale zero, and its IQ1 to IQ3 blocks
    range from near zero to nearly 3 x A's: on llama-quantize --imatrix exports of the Gemma 3 270M and Qwen2.5 0.5B
    stand-ins, block factors of -0.05 to 2.88, beyond the bounds the 4- to 8-bit types keep (they failed every such
    export).  Those types' blocks are held to ``IMPORTANCE_LOW_BITS_BLOCK_SCALE``: a block at zero is within, a
    block negated is not; a Q4_K block at zero still is a finding."""
    import torch

    from parity.engine.compare import gguf_grid

    x = torch.from_numpy(np.random.default_rng(3).standard_normal((8, 256)))
    at_zero, negated, doubled = 0.97 * x, 0.97 * x, 0.97 * x
    at_zero[5, 48:64] = 0.0
    negated[5, 48:64] *= -1
    doubled[5, 32:64] *= 2.9
    assert not gguf_grid.importance_scales(x, at_zero, 16, dtype="Q2_K")["beyond"]
    assert not gguf_grid.importance_scales(x, doubled, 32, levels=True, dtype="IQ3_XXS")["beyond"]
    for dtype, levels in (("Q2_K", False), ("IQ2_XXS", True)):
        found = gguf_grid.importance_scales(x, negated, 16, levels=levels, dtype=dtype)
        assert found["beyond"] and found["block"] < -0.5, found
    at_zero[5, 32:48] = 0.0  # the whole of a Q4_K sub-block of 32
    assert gguf_grid.importance_scales(x, at_zero, 32, dtype="Q4_K")["beyond"]
