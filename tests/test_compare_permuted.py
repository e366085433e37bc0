"""``parity compare A B`` where one matrix of B holds A's rows (outputs) or columns (inputs) in another order, the
tensors sharing those units not reordered alike: named ``rows_permuted`` / ``columns_permuted`` on that layer only,
in whatever storage B keeps it (a re-save, a cast, a GGUF quantization; the FP4 groups' exchanged rows are in
tests/test_quantized_fp4.py), with the rows matched as evidence.  Before, such a B failed as ``value_corrupted`` or
``quantization_exceeds_step``, which names no cause."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file

from parity.engine.compare.permutation import moved_order

from .derived_checkpoints import build, quantized_layer_one_named
from .gguf_files import HF_TO_GGUF, gguf_of_folder

UP, DOWN = "model.layers.1.mlp.up_proj.weight", "model.layers.1.mlp.down_proj.weight"
SIZES = dict(hidden_size=128, intermediate_size=256, num_key_value_heads=2)


@pytest.fixture(scope="module")
def model_a(tmp_path_factory) -> Path:
    return build("llama", tmp_path_factory.mktemp("permuted") / "a", 3, **SIZES)


def edited(a: Path, dest: Path, edit, dtype: torch.dtype | None = None) -> Path:
    shutil.copytree(a, dest)
    tensors = load_file(a / "model.safetensors")
    edit(tensors)
    if dtype is not None:
        tensors = {name: value.to(dtype) for name, value in tensors.items()}
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def exchange_rows(tensors: dict) -> None:
    tensors[UP][[3, 7]] = tensors[UP][[7, 3]].clone()


def shuffle_columns(tensors: dict) -> None:
    order = torch.randperm(tensors[DOWN].shape[1], generator=torch.Generator().manual_seed(1))
    tensors[DOWN] = tensors[DOWN][:, order].contiguous()


@pytest.mark.parametrize(("edit", "dtype", "named", "tensor", "said"), [
    (exchange_rows, None, "rows_permuted", "up_proj", "B's row 3 is A's row 7"),
    (exchange_rows, torch.bfloat16, "rows_permuted", "up_proj", "B's row 7 is A's row 3"),
    (shuffle_columns, torch.bfloat16, "columns_permuted", "down_proj", "of its 256 columns are A's in another order"),
])
def test_a_matrix_in_another_order_is_named_on_its_layer(model_a, tmp_path, capsys, edit, dtype, named, tensor,
                                                          said):
    b = edited(model_a, tmp_path / "b", edit, dtype)
    found = quantized_layer_one_named(capsys, model_a, b, named, tensor)
    assert said in found["message"], found


def test_a_gguf_q8_0_matrix_with_two_rows_exchanged_is_named(model_a, tmp_path, capsys):
    """The rows exchanged before quantizing: each block of B is on its own grid, so only the order tells."""
    def edit(layer: int, tensors: dict) -> dict:
        if layer == 1:
            up = np.array(tensors["ffn_up.weight"])
            up[[3, 7]] = up[[7, 3]]
            tensors = {**tensors, "ffn_up.weight": up}
        return tensors

    names = {f"mlp.{hf}": gg for hf, gg in HF_TO_GGUF.items()}
    b = gguf_of_folder(model_a, tmp_path / "b.gguf", "llama", names, Q.Q8_0, edit)
    found = quantized_layer_one_named(capsys, model_a, b, "rows_permuted", "up_proj")
    assert "B's row 3 is A's row 7" in found["message"], found


def test_no_order_is_read_where_rows_are_unrelated_or_in_place():
    """B's rows another matrix's (gate and up exchanged, a layer shifted), A's own rows rounded, or one row of A
    written twice: no permutation is read (the other replays and findings name those)."""
    generator = torch.Generator().manual_seed(0)
    a, other = torch.randn(256, 128, generator=generator), torch.randn(256, 128, generator=generator)
    assert moved_order(a, other) is None
    assert moved_order(a, a.bfloat16().float()) is None
    twice = a.clone()
    twice[9] = a[4]
    assert moved_order(a, twice) is None  # rows 4 and 9 of B both hold A's row 4: no order of A's rows
    exchanged = a.clone()
    exchanged[[4, 9]] = exchanged[[9, 4]]
    order, cosines, reference = moved_order(a, exchanged)
    assert order[4] == 9 and order[9] == 4 and (order[[0, 1, 2]] == torch.tensor([0, 1, 2])).all()
    assert float(cosines[4]) == pytest.approx(1.0) and reference == pytest.approx(1.0)
