"""GGUF files (llama.cpp) as a checkpoint format: a Checkpoint whose ``read`` dequantizes only the tensors
asked for (``gguf.quants.dequantize``; rows come out in HF's ``[out, in]`` layout), and the transformers config
the metadata stands for.

GGUF names no activation and no transformers class: both follow from ``general.architecture``, which
ARCHITECTURES translates into a transformers config.  The header itself is read by ``gguf_header``.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parity.definitions.files import shown
from parity.errors import CheckpointError
from parity.sources.checkpoint import Checkpoint
from parity.sources.config_check import MAX_EXPERTS, MAX_LENGTH, MAX_WIDTH, float_problem, int_problem
from parity.sources.config_check import short as _short
from parity.sources.gguf_header import (
    ArrayInfo,
    GGUFHeader,
    TensorInfo,
    gguf_version,
    qtype_name,
    read_header,
    tensor_info,
)

# HF-style config keys, shared by the LLaMA-like families
_HF_KEYS = {
    "embedding_length": "hidden_size", "feed_forward_length": "intermediate_size",
    "block_count": "num_hidden_layers", "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads", "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "context_length": "max_position_embeddings", "attention.key_length": "head_dim",
    "attention.sliding_window": "sliding_window", "expert_count": "num_local_experts",
    "expert_used_count": "num_experts_per_tok",
}

_GPT2_KEYS = {
    "embedding_length": "n_embd", "feed_forward_length": "n_inner", "block_count": "n_layer",
    "attention.head_count": "n_head", "context_length": "n_positions",
    "attention.layer_norm_epsilon": "layer_norm_epsilon",
}


@dataclass(frozen=True)
class Architecture:
    model_type: str  # transformers model_type of the equivalent HF checkpoint
    activation_key: str  # the config attribute that names the activation
    activation: str  # what llama.cpp runs for this architecture (GGUF stores no activation name)
    keys: dict[str, str]  # GGUF "{arch}.KEY" -> transformers config attribute
    moe_model_type: str | None = None  # model_type when the file has experts (expert_count > 0)

ARCHITECTURES = {
    "llama": Architecture("llama", "hidden_act", "silu", _HF_KEYS, moe_model_type="mixtral"),  # also Mistral
    "qwen2": Architecture("qwen2", "hidden_act", "silu", _HF_KEYS),
    "gemma": Architecture("gemma", "hidden_act", "gelu_pytorch_tanh", _HF_KEYS),
    "gemma2": Architecture("gemma2", "hidden_activation", "gelu_pytorch_tanh", _HF_KEYS),
    "gemma3": Architecture("gemma3_text", "hidden_activation", "gelu_pytorch_tanh", _HF_KEYS),
    "gpt2": Architecture("gpt2", "activation_function", "gelu_new", _GPT2_KEYS),
}


def dequantize(path: Path, info: TensorInfo):
    """One tensor as float32 torch, read from its offset and dequantized by gguf."""
    import numpy as np
    import torch
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize
    from gguf.quants import quant_shape_to_byte_shape

    try:
        qtype = GGMLQuantizationType(info.qtype)
    except ValueError:
        raise CheckpointError(f"{path}: tensor '{info.name}' has GGML type {info.qtype}, unknown to gguf "
                              "(upgrade the gguf package)") from None
    tensor_info(path, info.name, info.dims, info.qtype, info.offset, 0, 2**64)  # dims and block size, as at open
    with open(path, "rb") as handle:
        if info.offset + info.nbytes() > os.fstat(handle.fileno()).st_size:  # checked before allocating
            raise CheckpointError(f"{shown(path)}: tensor '{info.name}' runs past the end of the file; re-download it")
        data = bytearray(info.nbytes())
        handle.seek(info.offset)
        if handle.readinto(data) != len(data):
            raise CheckpointError(f"{shown(path)}: tensor '{info.name}' runs past the end of the file; re-download it")
    raw = np.frombuffer(data, dtype=np.uint8).reshape(quant_shape_to_byte_shape(info.shape, qtype))
    try:
        values = gguf_dequantize(raw, qtype)
    except NotImplementedError:
        raise CheckpointError(f"{path}: tensor '{info.name}' is stored as {qtype.name}, which gguf "
                              f"{gguf_version()} cannot dequantize; use a file quantized to another type") from None
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(info.shape)


class GGUFCheckpoint(Checkpoint):
    """Same interface as Checkpoint (has/read/closest/weight_map/raw_config); ``read`` dequantizes."""

    def __init__(self, header: GGUFHeader, raw_config: dict, notes: list[str]):
        path = header.path
        super().__init__(str(path), None, raw_config, {name: path.name for name in header.tensors}, lambda _: path)
        self.header = header
        self.notes = notes

    def describe(self, names: list[str]) -> dict[str, tuple[list[int], str]]:
        self.require(names)
        return {n: (list(self.header.tensors[n].shape), qtype_name(self.header.tensors[n].qtype)) for n in names}

    def read(self, names: list[str]):
        self.require(names)
        return {name: dequantize(self.header.path, self.header.tensors[name]) for name in names}


def config_from_metadata(header: GGUFHeader) -> tuple[dict, list[str]]:
    """The equivalent transformers config.json (as a dict) and notes on how it was derived."""
    meta = header.metadata
    arch_name = meta.get("general.architecture")
    if not isinstance(arch_name, str):
        raise CheckpointError(f"{shown(header.path)}: GGUF metadata has no 'general.architecture' string; is it a "
                              "model file?")
    arch = ARCHITECTURES.get(arch_name)
    if arch is None:
        raise CheckpointError(
            f"{shown(header.path)}: GGUF architecture {_short(arch_name)} is not supported; supported: "
            f"{', '.join(ARCHITECTURES)}. Convert the original Hugging Face checkpoint instead (parity FOLDER)."
        )
    for required in ("block_count", "embedding_length", "feed_forward_length"):
        if f"{arch_name}.{required}" not in meta:
            raise CheckpointError(f"{shown(header.path)}: GGUF metadata lacks '{arch_name}.{required}', "
                                  "needed to build the reference")
    raw: dict[str, Any] = {}
    for key, attr in arch.keys.items():
        value = meta.get(f"{arch_name}.{key}")
        if value is not None:
            raw[attr] = _metadata_value(header, f"{arch_name}.{key}", value)
    model_type = arch.model_type
    if raw.get("num_local_experts", 0) > 0:
        if arch.moe_model_type is None:
            raise CheckpointError(f"{shown(header.path)}: GGUF architecture '{arch_name}' with experts is not "
                                  "supported")
        model_type = arch.moe_model_type
    else:
        raw.pop("num_local_experts", None)
        raw.pop("num_experts_per_tok", None)
    rope_base = meta.get(f"{arch_name}.rope.freq_base")
    if rope_base is not None and arch.keys is _HF_KEYS:
        raw["rope_theta"] = _metadata_value(header, f"{arch_name}.rope.freq_base", rope_base)
    raw["vocab_size"] = _vocab_size(header, arch_name)
    raw[arch.activation_key] = arch.activation
    raw["model_type"] = model_type
    types = Counter(qtype_name(info.qtype) for name, info in header.tensors.items() if ".ffn_" in name)
    notes = [
        f"GGUF architecture '{arch_name}' checked as transformers model_type '{model_type}' with "
        f"{arch.activation_key}='{arch.activation}' (GGUF stores no activation name; llama.cpp runs this one for it)",
        "GGUF FFN tensor types: " + ", ".join(f"{t} ({n})" for t, n in types.most_common())
        + "; target and reference both get the same dequantized float32 weights",
    ]
    return raw, notes


def _metadata_value(header: GGUFHeader, key: str, value: Any) -> int | float:
    """One metadata number, checked: per-layer arrays must agree; sizes are positive integers (the layer
    count at most the number of tensors the file holds), epsilons and rope bases finite and positive."""
    def fail(why: str) -> CheckpointError:
        return CheckpointError(f"{shown(header.path)}: GGUF metadata '{key}' = {_short(value)}: {why}; the file is "
                               "corrupt or was not written by a llama.cpp converter")

    if isinstance(value, ArrayInfo):
        raise fail(f"an array of {value.count} values where one number (or one per layer) was expected")
    if isinstance(value, list):  # per-layer sizes: fine when they agree
        if not value or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            raise fail("expected a number, or a non-empty array of numbers (one per layer)")
        if len(set(value)) != 1:
            raise fail("differs between layers; per-layer FFN sizes are not supported")
        value = value[0]
    if key.endswith(("epsilon", "freq_base")):
        why = float_problem(value, 0.0 if key.endswith("epsilon") else 1e-300)
    elif key.endswith("block_count"):
        why = int_problem(value, 1, MAX_WIDTH) or (
            f"more layers than the file's {len(header.tensors)} tensors could hold (each layer has tensors of its own)"
            if value > len(header.tensors) else None)
    elif key.endswith(("expert_count", "expert_used_count", "sliding_window")):
        why = int_problem(value, 0, MAX_EXPERTS if "expert" in key else MAX_LENGTH)
    else:
        why = int_problem(value, 1, MAX_LENGTH if key.endswith("context_length") else MAX_WIDTH)
    if why is not None:
        raise fail(why)
    return value


def _vocab_size(header: GGUFHeader, arch_name: str) -> int:
    value = header.metadata.get(f"{arch_name}.vocab_size")
    if value is not None:
        why = int_problem(value, 1, MAX_LENGTH)
        if why is not None:
            raise CheckpointError(f"{shown(header.path)}: GGUF metadata '{arch_name}.vocab_size' = {_short(value)}: "
                                  f"{why}; the file is corrupt")
        return value
    embedding = header.tensors.get("token_embd.weight")
    if embedding is not None and len(embedding.dims) == 2:
        return int(embedding.dims[1])
    tokens = header.metadata.get("tokenizer.ggml.tokens")
    if isinstance(tokens, ArrayInfo):
        return tokens.count
    return len(tokens) if isinstance(tokens, list) else 32000  # the MLP does not depend on it


def open_gguf(path: Path) -> GGUFCheckpoint:
    """A .gguf file as a checkpoint: config from its metadata, tensors dequantized on read."""
    path = path.expanduser()
    header = read_header(path)
    split = header.metadata.get("split.count")
    if isinstance(split, int) and split > 1:
        raise CheckpointError(f"{shown(path)}: is one of {split} split GGUF files; merge them first "
                              "(llama-gguf-split --merge FIRST.gguf merged.gguf)")
    raw_config, notes = config_from_metadata(header)
    return GGUFCheckpoint(header, raw_config, notes)


def claims(path: Path) -> bool:
    """A .gguf file, or a folder holding exactly one .gguf and no HF checkpoint."""
    if path.is_file():
        return path.suffix == ".gguf"
    return (path.is_dir() and not (path / "config.json").is_file() and not any(path.glob("*.safetensors"))
            and len(list(path.glob("*.gguf"))) == 1)


def open_path(path: Path, allow_pickle: bool = False) -> GGUFCheckpoint:
    return open_gguf(path if path.is_file() else next(path.glob("*.gguf")))
