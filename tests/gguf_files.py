"""Tiny GGUF files written with the gguf package's own GGUFWriter, from tiny HF models.

gguf can quantize to F16, BF16, Q8_0, Q5_0 (``gguf.quants.quantize``) but not to the K-quants;
for Q4_K and Q6_K the blocks are random bytes with small finite scales, which dequantize to
ordinary weights: parity compares the modules on whatever the file holds.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import quantize

HF_TO_GGUF = {"gate_proj.weight": "ffn_gate.weight", "up_proj.weight": "ffn_up.weight",
              "down_proj.weight": "ffn_down.weight"}


def random_k_blocks(shape: tuple[int, int], qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Bytes of a valid Q4_K / Q6_K tensor of ``shape`` [rows, cols] with random content."""
    block, size = GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    blocks = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    if qtype == Q.Q4_K:  # d, dmin: two float16 at the start
        blocks[:, 0:4] = rng.uniform(1e-3, 4e-3, size=(len(blocks), 2)).astype(np.float16).view(np.uint8)
    elif qtype == Q.Q6_K:  # d: float16 at the end
        blocks[:, -2:] = rng.uniform(1e-4, 4e-4, size=(len(blocks), 1)).astype(np.float16).view(np.uint8)
    else:
        raise ValueError(qtype)
    return blocks.reshape(rows, cols // block * size)


def encode(values: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """The array to hand GGUFWriter.add_tensor(..., raw_dtype=qtype)."""
    if qtype in (Q.Q4_K, Q.Q6_K):
        return random_k_blocks(values.shape, qtype, rng)
    return quantize(values.astype(np.float32), qtype)


def write_gguf(path: Path, arch: str, meta: dict, tensors: dict[str, tuple[np.ndarray, Q]], seed: int = 0,
               n_tokens: int = 64) -> Path:
    """A GGUF file with ``{arch}.KEY`` metadata, a token list and the given tensors (numpy, HF layout)."""
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), arch)
    for key, value in meta.items():
        if isinstance(value, float):
            writer.add_float32(f"{arch}.{key}", value)
        else:
            writer.add_uint32(f"{arch}.{key}", value)
    writer.add_token_list([f"tok{i}" for i in range(n_tokens)])
    for name, (values, qtype) in tensors.items():
        data = encode(values, qtype, rng)
        if data.dtype == np.uint8:
            writer.add_tensor(name, data, raw_dtype=qtype)
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_from_hf(model, path: Path, arch: str, qtypes: dict[str, Q] | Q = Q.F32, seed: int = 0) -> Path:
    """The FFN tensors of a tiny HF LLaMA/Qwen2/Gemma model as a GGUF file of ``arch``."""
    config = model.config
    meta = {"block_count": config.num_hidden_layers, "embedding_length": config.hidden_size,
            "feed_forward_length": config.intermediate_size, "attention.head_count": config.num_attention_heads,
            "attention.head_count_kv": config.num_key_value_heads, "context_length": 64,
            "attention.layer_norm_rms_epsilon": 1e-6}
    if getattr(config, "head_dim", None):
        meta["attention.key_length"] = config.head_dim
    state = model.state_dict()
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for hf, gg in HF_TO_GGUF.items():
            qtype = qtypes if isinstance(qtypes, Q) else qtypes[gg]
            tensors[f"blk.{layer}.{gg}"] = (state[f"model.layers.{layer}.mlp.{hf}"].numpy(), qtype)
    return write_gguf(path, arch, meta, tensors, seed=seed)


def gguf_gpt2(model, path: Path, qtype: Q = Q.F32) -> Path:
    """A tiny GPT-2 as llama.cpp's converter writes it: Conv1D weights transposed to [out, in]."""
    config = model.config
    meta = {"block_count": config.n_layer, "embedding_length": config.n_embd, "feed_forward_length": 4 * config.n_embd,
            "attention.head_count": config.n_head, "context_length": config.n_positions,
            "attention.layer_norm_epsilon": 1e-5}
    state = model.state_dict()
    tensors = {}
    for layer in range(config.n_layer):
        prefix = f"transformer.h.{layer}.mlp."
        tensors[f"blk.{layer}.ffn_up.weight"] = (state[prefix + "c_fc.weight"].t().contiguous().numpy(), qtype)
        tensors[f"blk.{layer}.ffn_up.bias"] = (state[prefix + "c_fc.bias"].numpy(), Q.F32)
        tensors[f"blk.{layer}.ffn_down.weight"] = (state[prefix + "c_proj.weight"].t().contiguous().numpy(), qtype)
        tensors[f"blk.{layer}.ffn_down.bias"] = (state[prefix + "c_proj.bias"].numpy(), Q.F32)
    return write_gguf(path, "gpt2", meta, tensors)
