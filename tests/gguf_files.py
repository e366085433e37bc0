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
    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):  # gguf cannot write K-quants: round-to-nearest on the values' own grid
        return k_quantize(values, qtype)
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


# -- K-quants quantized here: gguf reads Q4_K / Q5_K / Q6_K but cannot write them ---------------------------------

def _half(values: np.ndarray) -> np.ndarray:
    """float16 bytes of a [blocks] array, as [blocks, 2]."""
    return values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _rounded(values: np.ndarray, unit: np.ndarray, low: int, high: int) -> np.ndarray:
    """round(values / unit) clamped to [low, high]; 0 where the unit is 0."""
    safe = np.where(unit != 0, unit, 1.0)
    return np.where(unit != 0, np.clip(np.rint(values / safe), low, high), 0.0)


def k_quantize(values: np.ndarray, qtype: Q, coarsen: float = 1.0) -> np.ndarray:
    """``values`` [rows, cols] (cols a multiple of 256) as Q4_K, Q5_K or Q6_K bytes, quantized the way the format's
    quantizer does, by round-to-nearest: each sub-block's scale its range over the levels (``coarsen`` times that:
    a grid coarser than the values need), rounded to a multiple of the super-block's float16 d, the codes rounded to
    it.  gguf's own dequantizer reads what this writes (the tests compare against it)."""
    rows, cols = values.shape
    if qtype in (Q.Q2_K, Q.Q3_K):
        return k_quantize_low(values, qtype, coarsen)
    if qtype == Q.Q6_K:
        return _q6_k(values.reshape(-1, 16, 16).astype(np.float64), coarsen).reshape(rows, -1)
    levels = 15 if qtype == Q.Q4_K else 31
    x = values.reshape(-1, 8, 32).astype(np.float64)
    low = np.minimum(x.min(-1), 0.0)
    scale, mins = (x.max(-1) - low) / levels * coarsen, -low
    d = (scale.max(-1) / 63).astype(np.float16).astype(np.float64)[:, None]
    dmin = (mins.max(-1) / 63).astype(np.float16).astype(np.float64)[:, None]
    ls, lm = _rounded(scale, d, 0, 63), _rounded(mins, dmin, 0, 63)
    codes = _rounded(x + (dmin * lm)[..., None], (d * ls)[..., None], 0, levels).astype(np.uint8)
    ls, lm = ls.astype(np.uint8), lm.astype(np.uint8)
    packed = np.zeros((len(x), 12), dtype=np.uint8)
    for j in range(4):
        packed[:, j] = ls[:, j] | ((ls[:, j + 4] >> 4) << 6)
        packed[:, j + 4] = lm[:, j] | ((lm[:, j + 4] >> 4) << 6)
        packed[:, j + 8] = (ls[:, j + 4] & 15) | ((lm[:, j + 4] & 15) << 4)
    low_bits = codes & 15
    qs = np.concatenate([low_bits[:, 2 * c] | (low_bits[:, 2 * c + 1] << 4) for c in range(4)], axis=1)
    parts = [_half(d), _half(dmin), packed]
    if qtype == Q.Q5_K:  # the fifth bit of sub-block j's value l is bit j of qh[l]
        qh = sum((codes[:, j] >> 4).astype(np.uint16) << j for j in range(8)).astype(np.uint8)
        parts.append(qh)
    return np.concatenate([*parts, qs], axis=1).reshape(rows, -1)


def _q6_k(x: np.ndarray, coarsen: float) -> np.ndarray:
    """Q6_K bytes of [super-blocks, 16, 16] values: the largest magnitude of a sub-block maps to code -32."""
    pick = np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)[..., 0]
    scale = -pick / 32 * coarsen
    d = (np.abs(scale).max(-1) / 127).astype(np.float16).astype(np.float64)[:, None]
    ls = _rounded(scale, d, -128, 127)
    codes = (_rounded(x, (d * ls)[..., None], -32, 31) + 32).astype(np.uint8).reshape(-1, 256)
    ql, qh = np.zeros((len(x), 128), dtype=np.uint8), np.zeros((len(x), 64), dtype=np.uint8)
    for n in range(2):
        q = [codes[:, 128 * n + 32 * k:128 * n + 32 * k + 32] for k in range(4)]
        ql[:, 64 * n:64 * n + 32] = (q[0] & 15) | ((q[2] & 15) << 4)
        ql[:, 64 * n + 32:64 * n + 64] = (q[1] & 15) | ((q[3] & 15) << 4)
        qh[:, 32 * n:32 * n + 32] = (q[0] >> 4) | ((q[1] >> 4) << 2) | ((q[2] >> 4) << 4) | ((q[3] >> 4) << 6)
    return np.concatenate([ql, qh, ls.astype(np.int8).view(np.uint8), _half(d)], axis=1)


def write_k_gguf(model, path: Path, qtype: Q, edits: dict | None = None, extra: dict | None = None,
                 metadata: dict | None = None) -> Path:
    """The FFN tensors of a tiny LLaMA as a GGUF of ``qtype`` (``k_quantize``); ``edits``: GGUF name -> a function
    of (values, bytes) returning the bytes to write instead (a broken export); ``extra``: name -> values of tensors
    written before the model's own; ``metadata``: more keys (str or int values), written as given."""
    config, state = model.config, model.state_dict()
    meta = {"block_count": config.num_hidden_layers, "embedding_length": config.hidden_size,
            "feed_forward_length": config.intermediate_size, "attention.head_count": config.num_attention_heads,
            "attention.head_count_kv": config.num_key_value_heads, "context_length": 64,
            "attention.layer_norm_rms_epsilon": 1e-6}
    writer = GGUFWriter(str(path), "llama")
    for key, value in meta.items():
        (writer.add_float32 if isinstance(value, float) else writer.add_uint32)(f"llama.{key}", value)
    writer.add_token_list([f"tok{i}" for i in range(64)])
    for key, value in (metadata or {}).items():
        (writer.add_string if isinstance(value, str) else writer.add_uint32)(key, value)
    for name, values in (extra or {}).items():
        writer.add_tensor(name, quantize(values, qtype), raw_dtype=qtype)
    for layer in range(config.num_hidden_layers):
        for hf, gg in HF_TO_GGUF.items():
            values = state[f"model.layers.{layer}.mlp.{hf}"].float().numpy()
            data = quantize(values, qtype) if qtype in (Q.Q8_0, Q.Q4_0) else k_quantize(values, qtype)
            name = f"blk.{layer}.{gg}"
            if edits and name in edits:
                data = edits[name](values, data.copy())
            writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# -- Q2_K and Q3_K quantized here the same way (16 values per sub-block) ------------------------------------------

def _two_bit_planes(codes: np.ndarray) -> np.ndarray:
    """[blocks, 256] codes 0..3 as 64 bytes: byte 32 h + l holds value 128 h + 32 i + l in bits 2i, 2i + 1."""
    planes = codes.reshape(-1, 2, 4, 32).astype(np.uint8)
    return sum(planes[:, :, i] << (2 * i) for i in range(4)).astype(np.uint8).reshape(-1, 64)


def k_quantize_low(values: np.ndarray, qtype: Q, coarsen: float = 1.0) -> np.ndarray:
    """``values`` [rows, cols] (cols a multiple of 256) as Q2_K or Q3_K bytes by round-to-nearest, as ``k_quantize``.
    Q2_K: each sub-block of 16 its range from min(0, minimum) over 3 (``coarsen`` times that), 4-bit scale and minimum
    under float16 d and dmin.  Q3_K: the largest magnitude maps to code -4, 6-bit signed scales under float16 d."""
    rows = values.shape[0]
    x = values.reshape(-1, 16, 16).astype(np.float64)
    if qtype == Q.Q2_K:
        low = np.minimum(x.min(-1), 0.0)
        scale, mins = (x.max(-1) - low) / 3 * coarsen, -low
        d = (scale.max(-1) / 15).astype(np.float16).astype(np.float64)[:, None]
        dmin = (mins.max(-1) / 15).astype(np.float16).astype(np.float64)[:, None]
        ls, lm = _rounded(scale, d, 0, 15), _rounded(mins, dmin, 0, 15)
        codes = _rounded(x + (dmin * lm)[..., None], (d * ls)[..., None], 0, 3).reshape(-1, 256)
        pairs = (ls.astype(np.uint8) | (lm.astype(np.uint8) << 4))
        return np.concatenate([pairs, _two_bit_planes(codes), _half(d), _half(dmin)], axis=1).reshape(rows, -1)
    pick = np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)[..., 0]
    scale = -pick / 4 * coarsen
    d = (np.abs(scale).max(-1) / 31).astype(np.float16).astype(np.float64)[:, None]
    ls = _rounded(scale, d, -32, 31)
    codes = (_rounded(x, (d * ls)[..., None], -4, 3) + 4).astype(np.uint8).reshape(-1, 256)
    high = (codes >> 2).reshape(-1, 8, 32)  # value 32 i + l: bit i of hmask byte l
    hmask = sum(high[:, i] << i for i in range(8)).astype(np.uint8)
    six = (ls + 32).astype(np.uint8)  # scale j: low nibble in byte j mod 8 (high nibble for j >= 8), top 2 bits in
    packed = np.zeros((len(x), 12), dtype=np.uint8)  # byte 8 + j mod 4 at bit 2 (j div 4)
    for j in range(16):
        packed[:, j % 8] |= (six[:, j] & 15) << (4 * (j // 8))
        packed[:, 8 + j % 4] |= (six[:, j] >> 4) << (2 * (j // 4))
    return np.concatenate([hmask, _two_bit_planes(codes & 3), packed, _half(d)], axis=1).reshape(rows, -1)


# -- any architecture: a tiny HF checkpoint's FFN tensors under llama.cpp's names for its family -------------------

def tiny_hf(model_type: str, folder: Path, seed: int, **values) -> Path:
    """A tiny checkpoint of ``model_type`` built with transformers' own classes (from_config + save_pretrained),
    distinct random values everywhere (biases included)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    common = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, vocab_size=64, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2)
    config = AutoConfig.for_model(model_type, **{**common, **values})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.05)
    model.save_pretrained(folder)
    return folder


def gguf_of_folder(folder: Path, path: Path, arch: str, names: dict[str, str], qtype: Q = Q.F32,
                   edit=None) -> Path:
    """The FFN tensors of a saved HF checkpoint as a GGUF file of ``arch``, named as llama.cpp's converter names
    them: ``names`` maps each tensor's name under the layer (HF, e.g. 'mlp.c_fc.weight') to its GGUF name under
    'blk.N.' (e.g. 'ffn_up.weight'); ``layer_prefix`` found from config.json.  2-D weights as ``qtype`` (biases F32),
    Conv1D-free families only (their weights are [out, in] already).  ``edit(layer, tensors)`` may change a layer's
    {GGUF name: values} before it is written (a broken export)."""
    import json

    from safetensors.numpy import load_file

    config = json.loads((folder / "config.json").read_text())
    state = load_file(str(folder / "model.safetensors"))
    count = config["num_hidden_layers"]
    meta = {"block_count": count, "embedding_length": config["hidden_size"], "context_length": 64,
            "feed_forward_length": config.get("intermediate_size") or 4 * config["hidden_size"],
            "attention.head_count": config["num_attention_heads"]}
    if config.get("num_key_value_heads"):
        meta["attention.head_count_kv"] = config["num_key_value_heads"]
    tensors = {}
    for layer in range(count):
        stem = next(k for k in state if k.endswith(f".{layer}.{next(iter(names))}")).removesuffix(next(iter(names)))
        found = {gg: state[stem + hf] for hf, gg in names.items()}
        if edit is not None:
            found = edit(layer, found)
        for gg, values in found.items():
            tensors[f"blk.{layer}.{gg}"] = (values.astype(np.float32), qtype if values.ndim == 2 else Q.F32)
    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(path), arch)
    for key, value in meta.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_token_list([f"tok{i}" for i in range(config["vocab_size"])])
    writer.add_pad_token_id(0)  # the ids llama.cpp's converter writes from the tokenizer; transformers reads them
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, (values, kind) in tensors.items():
        data = encode(values, kind, rng)
        writer.add_tensor(name, data, raw_dtype=kind if data.dtype == np.uint8 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# -- mixture of experts: a tiny HF checkpoint's FFN tensors stacked over experts, as llama.cpp's converter does ------

# widths that Q8_0's 32-value blocks divide (an expert's down_proj rows are moe_intermediate_size long)
VALUES = dict(intermediate_size=64, num_key_value_heads=2, head_dim=16, num_experts=4, num_local_experts=4,
              n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
              n_shared_experts=1)
EXPERTS = {"gate_proj.weight": "ffn_gate_exps.weight", "up_proj.weight": "ffn_up_exps.weight",
           "down_proj.weight": "ffn_down_exps.weight"}


def per_expert(shared: str | None = None, dense_before: int = 0, experts_at: str = "mlp.experts",
               names: dict[str, str] = EXPERTS):
    """layer_tensors for moe_gguf_of_folder: each projection's per-expert tensors (``experts_at.{e}.NAME``) stacked
    over the experts (the converter's merge), a shared expert's as ffn_*_shexp, the dense layers' as ffn_gate/ffn_up/
    ffn_down."""
    def layer_tensors(state: dict, layer: int) -> dict[str, np.ndarray]:
        stem = f"model.layers.{layer}.mlp."
        if layer < dense_before:
            return {f"ffn_{p}.weight": state[f"{stem}{p}_proj.weight"] for p in ("gate", "up", "down")}
        at = f"model.layers.{layer}.{experts_at}."
        down = next(hf for hf, gg in names.items() if gg.startswith("ffn_down"))
        count = len({k for k in state if k.startswith(at) and k.endswith(f".{down}")})
        out = {gg: np.stack([state[f"{at}{e}.{hf}"] for e in range(count)]) for hf, gg in names.items()}
        if shared:
            out |= {f"ffn_{p}_shexp.weight": state[f"{stem}{shared}.{p}_proj.weight"] for p in ("gate", "up", "down")}
        return out
    return layer_tensors


def block_tensors(state: dict, arch: str, layer: int, blocks: int) -> dict[str, np.ndarray]:
    """A layer's MoE block tensors outside its experts (the router, its bias, a shared expert's gate) under the names
    gguf's own name map gives them for ``arch``, as llama.cpp's converter writes them (a [1, d] gate as [d])."""
    import gguf

    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), blocks)
    out = {}
    for key, value in state.items():
        if not key.startswith(f"model.layers.{layer}.") or ".experts." in key or ".self_attn." in key:
            continue
        name = names.get_name(key, try_suffixes=(".weight", ".bias", "_bias"))
        if name is not None and ("gate_inp" in name or "exp_probs" in name):
            name = name.removesuffix("_bias") + ".bias" if name.endswith("_bias") else name  # exp_probs_b.bias
            out[name.removeprefix(f"blk.{layer}.")] = value[0] if value.ndim == 2 and value.shape[0] == 1 else value
    return out


def moe_gguf_of_folder(folder: Path, path: Path, arch: str, layer_tensors, qtype: Q = Q.F32, edit=None,
                       kinds: dict[str, Q] | None = None, router: bool = True) -> Path:
    """A GGUF file of ``arch`` holding the FFN tensors of a saved tiny MoE checkpoint: ``layer_tensors(state, layer)``
    gives one layer's {GGUF name under 'blk.N.': values} (the test spells out, per family, how llama.cpp's converter
    stacks and names them); 2-D and 3-D weights as ``qtype``, biases F32.  The metadata says the expert widths and
    counts the converter writes (expert_feed_forward_length, expert_shared_feed_forward_length, expert_count).
    ``edit(layer, tensors)`` may change a layer's tensors before they are written (a broken export); ``kinds``: the
    type of a tensor (its name under 'blk.N.') written otherwise than ``qtype`` (a router kept in F32); ``router``:
    each MoE layer's router (``block_tensors``) written beside its experts, F32 unless ``kinds`` says otherwise
    (False: a file written without it)."""
    import json

    from safetensors.numpy import load_file

    config = json.loads((folder / "config.json").read_text())
    state = load_file(str(folder / "model.safetensors"))
    meta = {"block_count": config["num_hidden_layers"], "embedding_length": config["hidden_size"],
            "context_length": 64, "feed_forward_length": config["intermediate_size"],
            "attention.head_count": config["num_attention_heads"],
            "attention.head_count_kv": config["num_key_value_heads"],
            "expert_count": config.get("num_experts") or config["num_local_experts"],
            "expert_used_count": config["num_experts_per_tok"]}
    for key, attr in (("attention.key_length", "head_dim"), ("expert_feed_forward_length", "moe_intermediate_size"),
                      ("expert_shared_feed_forward_length", "shared_expert_intermediate_size")):
        if config.get(attr):
            meta[key] = config[attr]
    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(path), arch)
    for key, value in meta.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_token_list([f"tok{i}" for i in range(config["vocab_size"])])
    writer.add_pad_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for layer in range(config["num_hidden_layers"]):
        found = layer_tensors(state, layer)
        if router and any("_exps" in name for name in found):
            found = {**{k: v for k, v in block_tensors(state, arch, layer, config["num_hidden_layers"]).items()
                        if k not in found}, **found}
        if edit is not None:
            found = edit(layer, dict(found))
        for name, values in found.items():
            kind = (kinds[name] if kinds and name in kinds else
                    qtype if values.ndim > 1 and name.endswith(".weight") and "gate_inp" not in name else Q.F32)
            data = encode(np.ascontiguousarray(values, dtype=np.float32), kind, rng)
            writer.add_tensor(f"blk.{layer}.{name}", data, raw_dtype=kind if data.dtype == np.uint8 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def converted_moe_gguf(folder: Path, path: Path, arch: str, qtype: Q = Q.F32, edit=None) -> Path:
    """A 'deepseek2' or 'glm4moe' GGUF of a saved tiny DeepSeek V3 / GLM-4.5 checkpoint, its metadata written with
    GGUFWriter's own calls as llama.cpp's converter makes them for these architectures (dense leading layers, expert
    and shared-expert counts, the experts' width, routing scale and norm, sigmoid gating, MLA ranks where the config
    has them), its tensors as the converter names them: the dense layers' ffn_gate/ffn_up/ffn_down, then per MoE
    layer the router (ffn_gate_inp), the selection bias (exp_probs_b.bias), the experts stacked (ffn_*_exps) and the
    shared expert (ffn_*_shexp); a DeepSeek V2 (no selection bias) with softmax gating.  ``edit(layer, tensors)``
    may change a layer's tensors (a broken export)."""
    import json

    from gguf import ExpertGatingFuncType
    from safetensors.numpy import load_file

    config = json.loads((folder / "config.json").read_text())
    state = load_file(str(folder / "model.safetensors"))
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(64)
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_leading_dense_block_count(config["first_k_dense_replace"])
    writer.add_expert_count(config["n_routed_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_shared_count(config["n_shared_experts"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_weights_scale(float(config["routed_scaling_factor"]))
    writer.add_expert_weights_norm(bool(config["norm_topk_prob"]))
    biased = any(name.endswith("gate.e_score_correction_bias") for name in state)  # V3, GLM-4.5: sigmoid gating
    writer.add_expert_gating_func(ExpertGatingFuncType.SIGMOID if biased else ExpertGatingFuncType.SOFTMAX)
    if config.get("n_group"):
        writer.add_expert_group_count(config["n_group"])
        writer.add_expert_group_used_count(config["topk_group"])
    if config.get("kv_lora_rank"):  # DeepSeek's MLA
        writer.add_kv_lora_rank(config["kv_lora_rank"])
        writer.add_rope_dimension_count(config["qk_rope_head_dim"])
        writer.add_key_length(config["kv_lora_rank"] + config["qk_rope_head_dim"])
        writer.add_value_length(config["kv_lora_rank"])
        writer.add_value_length_mla(config["v_head_dim"])
    else:
        writer.add_key_length(config["head_dim"])
    writer.add_token_list([f"tok{i}" for i in range(config["vocab_size"])])
    rng = np.random.default_rng(0)
    for layer in range(config["num_hidden_layers"]):
        stem = f"model.layers.{layer}.mlp."
        if layer < config["first_k_dense_replace"]:
            found = {f"ffn_{p}.weight": state[f"{stem}{p}_proj.weight"] for p in ("gate", "up", "down")}
        else:
            found = {"ffn_gate_inp.weight": state[f"{stem}gate.weight"]}
            if biased:
                found["exp_probs_b.bias"] = state[f"{stem}gate.e_score_correction_bias"]
            found |= {f"ffn_{p}_exps.weight": np.stack([state[f"{stem}experts.{e}.{p}_proj.weight"]
                                                        for e in range(config["n_routed_experts"])])
                      for p in ("gate", "up", "down")}
            found |= {f"ffn_{p}_shexp.weight": state[f"{stem}shared_experts.{p}_proj.weight"]
                      for p in ("gate", "up", "down")}
        if edit is not None:
            found = edit(layer, dict(found))
        for name, values in found.items():
            kind = qtype if values.ndim > 1 and name != "ffn_gate_inp.weight" else Q.F32  # the router kept F32
            data = encode(np.ascontiguousarray(values, dtype=np.float32), kind, rng)
            writer.add_tensor(f"blk.{layer}.{name}", data, raw_dtype=kind if data.dtype == np.uint8 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
