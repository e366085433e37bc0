"""GGUF types whose grid parity cannot read and gguf cannot write (IQ1 to IQ4, NVFP4): read by gguf's own dequantizer,
A rounded to the nearest value B's block holds (``gguf_grid.on_levels``) as the conversion, B judged by the function.

gguf cannot write these types, so B's blocks here are random valid ones (their float16 scales set, blocks that decode
to non-finite values drawn again) and A holds exactly what they decode to: a faithful export, which must pass
bit-identical with no conversion deviation (before the rounding to B's own levels it was judged unverifiable, its
estimated lattice moving A by as much as the layer's output).  IQ4_NL is also written by a round-to-nearest quantizer
of its code book, as ggml's rounds each value: A Gaussian, B's deviation equals the rounding's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import IQ4_NL, dequantize
from safetensors.torch import load_file, save_file

from .gguf_files import Q, tiny_hf
from .support import run_json

PROJECTIONS = (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down"))
SCALE_FIRST = {Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S, Q.IQ4_NL, Q.IQ4_XS}  # d: float16, bytes 0-1


def random_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Bytes of a valid ``qtype`` tensor [rows, cols] with random codes (values at most 6 in magnitude)."""
    block, size = GGML_QUANT_SIZES[qtype]
    count = rows * cols // block
    raw = rng.integers(0, 256, size=(count, size), dtype=np.uint8)
    if qtype in SCALE_FIRST:
        raw[:, 0:2] = rng.uniform(1e-3, 4e-3, size=(count, 1)).astype(np.float16).view(np.uint8)
    elif qtype == Q.NVFP4:  # four 8-bit scales first, one per 16 values: kept near 1 (values up to e2m1's 6)
        raw[:, 0:4] = rng.integers(0x30, 0x38, size=(count, 4), dtype=np.uint8)
    for _ in range(100):
        with np.errstate(all="ignore"):
            values = dequantize(raw, qtype).reshape(count, block)
        bad = ~(np.isfinite(values).all(-1) & (np.abs(values).max(-1) <= 6.0))
        if not bad.any():
            return raw.reshape(rows, -1)
        raw[bad] = rng.integers(0, 256, size=(int(bad.sum()), size), dtype=np.uint8)
    raise AssertionError(f"no valid {qtype.name} blocks drawn")


def iq4_nl(values: np.ndarray) -> np.ndarray:
    """``values`` [rows, cols] as IQ4_NL bytes, each value rounded to its nearest level of the code book times the
    block's d (the signed value of largest magnitude over the code book's -127, as ggml's quantizer starts)."""
    levels = np.array(IQ4_NL.kvalues, dtype=np.float64)
    x = values.reshape(-1, 32).astype(np.float64)
    peak = x[np.arange(len(x)), np.abs(x).argmax(-1)]
    d = (peak / levels[0]).astype(np.float16)
    scaled = x / np.where(d == 0, 1.0, d.astype(np.float64))[:, None]
    codes = np.abs(scaled[..., None] - levels).argmin(-1).astype(np.uint8)
    packed = codes[:, :16] | (codes[:, 16:] << 4)
    return np.concatenate([d[:, None].view(np.uint8), packed], axis=1).reshape(values.shape[0], -1)


def write(a: Path, path: Path, encode, *, exchange: bool = False) -> Path:
    """The FFN of checkpoint ``a`` as a LLaMA GGUF file, each matrix encoded by ``encode(name, values)``; layer 1's
    gate and up exchanged with ``exchange``."""
    config = json.loads((a / "config.json").read_text())
    state = load_file(a / "model.safetensors")
    writer = GGUFWriter(str(path), "llama")
    for key, value in {"block_count": 2, "embedding_length": config["hidden_size"], "context_length": 64,
                       "feed_forward_length": config["intermediate_size"], "attention.head_count": 2,
                       "attention.head_count_kv": 2}.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_token_list([f"tok{i}" for i in range(config["vocab_size"])])
    for layer in range(2):
        for hf, gg in PROJECTIONS:
            source = {"gate_proj": "up_proj", "up_proj": "gate_proj"}.get(hf, hf) if exchange and layer == 1 else hf
            name = f"model.layers.{layer}.mlp.{source}.weight"
            raw, qtype = encode(name, state[name].float().numpy())
            writer.add_tensor(f"blk.{layer}.{gg}.weight", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return tiny_hf("llama", tmp_path_factory.mktemp("iq") / "llama", 9, hidden_size=256, intermediate_size=512,
                   num_key_value_heads=2)


@pytest.fixture(scope="module")
def on_grid(llama, tmp_path_factory):
    """qtype -> (A holding exactly B's dequantized FFN values, B's bytes per tensor name)."""
    made = {}
    for index, qtype in enumerate(GRID_TYPES):
        rng = np.random.default_rng(index)
        a = tmp_path_factory.mktemp("iq") / f"a-{qtype.name}"
        shutil.copytree(llama, a)
        tensors = load_file(a / "model.safetensors")
        raw = {}
        for name in [n for n in tensors if ".mlp." in n]:
            rows, cols = tensors[name].shape
            raw[name] = random_blocks(qtype, rows, cols, rng)
            tensors[name] = torch.from_numpy(dequantize(raw[name], qtype).reshape(rows, cols).astype(np.float32))
        save_file(tensors, a / "model.safetensors", metadata={"format": "pt"})
        made[qtype] = (a, raw)
    return made


GRID_TYPES = [Q.IQ1_M, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ3_S, Q.IQ4_XS, Q.NVFP4]


@pytest.mark.parametrize("qtype", GRID_TYPES, ids=lambda q: q.name)
def test_a_faithful_export_on_b_s_own_grid_passes_bit_identical(on_grid, tmp_path, capsys, qtype):
    a, raw = on_grid[qtype]
    b = write(a, tmp_path / "b.gguf", lambda name, _: (raw[name], qtype))
    code, report, err = run_json(capsys, "compare", a, b)
    assert code == 0 and report["passed"], err
    for unit in report["layers"]:
        assert unit["max_abs_diff"] == 0.0 and unit["conversion"]["conversion_deviation"] == 0.0
        assert all(t["conversion"].startswith(f"rounded to the nearest value B's {qtype.name} block holds")
                   for t in unit["conversion"]["tensors"])


@pytest.mark.parametrize("qtype", [Q.IQ3_S, Q.IQ4_XS], ids=lambda q: q.name)
def test_an_export_with_gate_and_up_exchanged_fails_on_its_layer_named(on_grid, tmp_path, capsys, qtype):
    a, raw = on_grid[qtype]
    b = write(a, tmp_path / "b.gguf", lambda name, _: (raw[name], qtype), exchange=True)
    code, report, err = run_json(capsys, "compare", a, b)
    assert code == 1, err
    assert [unit["passed"] for unit in report["layers"]] == [True, False]
    assert report["layers"][1]["diagnosis"]["id"] == "gate_up_exchanged"


def test_iq4_nl_rounded_to_its_nearest_levels_passes_at_the_rounding_s_own_deviation(llama, tmp_path, capsys):
    b = write(llama, tmp_path / "b.gguf", lambda _, values: (iq4_nl(values), Q.IQ4_NL))
    code, report, err = run_json(capsys, "compare", llama, b)
    assert code == 0 and report["passed"], err
    for unit in report["layers"]:  # B is each value's nearest level: the rounding, within its float16 d (1.08 measured)
        assert 0.0 < unit["conversion"]["conversion_deviation"] and unit["conversion"]["ratio_to_conversion"] < 1.25
