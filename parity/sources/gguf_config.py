"""A GGUF file's metadata as the equivalent transformers config.json (a dict), derived from what transformers and
gguf themselves know rather than from a table of families.

* gguf (``gguf.MODEL_ARCH_NAMES``) says which ``general.architecture`` names llama.cpp writes; any other is refused.
* transformers' own GGUF loader tables (``transformers.integrations.ggml.GGUF_CONFIG_MAPPING``: ``{arch}.KEY`` ->
  config attribute per architecture, ``GGUF_CONFIG_DEFAULTS_MAPPING``) translate the metadata, as its
  ``load_gguf_checkpoint`` does.  Its architecture names are spelled as transformers spells them (``qwen2_moe`` for
  gguf's ``qwen2moe``, ``gpt_oss`` for ``gpt-oss``): matched here with '_' and '-' ignored.  Its loader keeps only
  the text decoder of a multimodal family (``gemma3`` -> ``gemma3_text``): where transformers has a ``{type}_text``
  config, that is the model type.  That loader is not called itself: it decodes the whole vocabulary (15 s for a
  262k-token file) to read a few numbers.
* GGUF names no activation: the config keeps transformers' default for the model type, as its GGUF loader does.

Architectures llama.cpp writes that transformers' GGUF tables do not read stay here: ``BEYOND_TRANSFORMERS``, and the
MoE architectures with dense leading layers and shared experts (``_MOE_BEYOND``: deepseek2, glm4moe).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from parity.definitions.files import shown
from parity.errors import CheckpointError
from parity.sources.config_check import MAX_EXPERTS, MAX_LENGTH, MAX_WIDTH, float_problem, int_problem
from parity.sources.config_check import short as _short
from parity.sources.gguf_header import ArrayInfo, GGUFHeader, gguf_version

# The keys llama.cpp's converter writes for every LLaMA-like architecture (gguf.constants.Keys.LLM / .Attention)
_HF_KEYS = {
    "embedding_length": "hidden_size", "feed_forward_length": "intermediate_size",
    "block_count": "num_hidden_layers", "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads", "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "context_length": "max_position_embeddings", "attention.key_length": "head_dim",
    "rope.freq_base": "rope_theta", "attention.sliding_window": "sliding_window",
    "expert_count": "num_local_experts", "expert_used_count": "num_experts_per_tok",
}


@dataclass(frozen=True)
class Translation:
    """How one GGUF architecture becomes a transformers config: its model type and ``{arch}.KEY`` -> attribute."""

    model_type: str
    keys: dict[str, Any]  # full metadata key ('qwen3.block_count', 'tokenizer.ggml.padding_token_id') -> attribute
    source: str  # where the translation comes from, for the note
    defaults: dict[str, Any]


# What transformers 5.24's GGUF loader does not read, and llama.cpp writes (its convert_hf_to_gguf.py):
BEYOND_TRANSFORMERS = {
    "gemma": "gemma",  # GemmaForCausalLM is converted as architecture 'gemma'; transformers reads gemma2 onwards only
    "llama+experts": "mixtral",  # MixtralForCausalLM is converted as 'llama' with expert_count > 0
}
# Two MoE architectures llama.cpp's converter writes with dense layers before the MoE ones and shared experts, which
# transformers 5.24's GGUF tables do not read: 'deepseek2' (its DeepseekV2Model converter, DeepSeek V2 and V3 alike)
# and 'glm4moe' (GLM-4.5).  The keys beyond _HF_KEYS it writes for them, and the config attribute each was written
# from (gguf.Keys.LLM / .Attention / .Rope names; the converter's set_gguf_parameters reads them off config.json).
_MOE_BEYOND = {"deepseek2", "glm4moe"}
_MOE_KEYS = {
    "leading_dense_block_count": "first_k_dense_replace", "expert_count": "n_routed_experts",
    "expert_shared_count": "n_shared_experts", "expert_feed_forward_length": "moe_intermediate_size",
    "expert_weights_scale": "routed_scaling_factor", "expert_weights_norm": "norm_topk_prob",
    "expert_group_count": "n_group", "expert_group_used_count": "topk_group",
    "attention.q_lora_rank": "q_lora_rank", "attention.kv_lora_rank": "kv_lora_rank",
    "attention.value_length_mla": "v_head_dim",
}
_MLA_KEYS = {"rope.dimension_count": "qk_rope_head_dim"}  # deepseek2: key_length is the compressed MLA key's
# What llama.cpp's converter writes from a Hugging Face config's expert widths (its Qwen2-MoE / Qwen3-MoE /
# DeepSeek converters: gguf.Keys.LLM.EXPERT_FEED_FORWARD_LENGTH from moe_intermediate_size,
# EXPERT_SHARED_FEED_FORWARD_LENGTH from shared_expert_intermediate_size), which transformers' GGUF tables leave
# out for some architectures (qwen3_moe): read back where the config class has that attribute and transformers'
# table says nothing of the key.
_EXPERT_KEYS = {"expert_feed_forward_length": "moe_intermediate_size",
                "expert_shared_feed_forward_length": "shared_expert_intermediate_size"}
_INT_KEYS = ("block_count", "embedding_length", "feed_forward_length", "head_count", "head_count_kv",
             "context_length", "key_length", "value_length", "dimension_count", "vocab_size")


def translation(header: GGUFHeader, arch: str) -> Translation:
    """The model type and key table for ``arch``: transformers' GGUF tables where they read it, else
    BEYOND_TRANSFORMERS; an architecture gguf does not know, or that neither reads, is exit 2 naming it."""
    import gguf
    import transformers
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    versions = f"gguf {gguf_version()} and transformers {transformers.__version__} installed here"
    if arch not in gguf.MODEL_ARCH_NAMES.values():
        raise CheckpointError(f"{shown(header.path)}: GGUF architecture {_short(arch)} is not supported: unknown to "
                              f"gguf ({versions}), so neither its tensor names nor its config can be read. Check the "
                              "Hugging Face folder it was converted from instead (parity FOLDER), or upgrade gguf")
    if arch in _MOE_BEYOND:
        return _moe_translation(header, arch)
    experts = header.metadata.get(f"{arch}.expert_count")
    beyond = BEYOND_TRANSFORMERS.get(f"{arch}+experts" if isinstance(experts, int) and experts > 0 else arch)
    if beyond is not None:
        return Translation(beyond, {f"{arch}.{key}": attr for key, attr in _HF_KEYS.items()},
                           "llama.cpp's converter, which transformers' GGUF loader does not read", {})
    spelled = {_plain(name): name for name in GGUF_CONFIG_MAPPING if name not in ("general", "tokenizer")}
    name = spelled.get(_plain(arch))
    if name is None:
        raise CheckpointError(
            f"{shown(header.path)}: GGUF architecture {_short(arch)} is not supported: gguf knows it, but "
            f"transformers' GGUF loader cannot turn it into a config ({versions}; it reads "
            f"{', '.join(spelled.values())}). Check the Hugging Face folder it was converted from instead "
            "(parity FOLDER)")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    model_type = f"{name}_text" if f"{name}_text" in CONFIG_MAPPING_NAMES else name
    keys = {**{f"{arch}.{key}": attr for key, attr in GGUF_CONFIG_MAPPING[name].items()},
            **{f"tokenizer.{key}": attr for key, attr in GGUF_CONFIG_MAPPING["tokenizer"].items()}}
    keys |= {f"{arch}.{key}": attr for key, attr in _expert_keys(model_type).items()
             if key not in GGUF_CONFIG_MAPPING[name]}
    return Translation(model_type, keys, f"transformers {transformers.__version__}'s GGUF tables",
                       dict(GGUF_CONFIG_DEFAULTS_MAPPING.get(name, {})))


def _moe_translation(header: GGUFHeader, arch: str) -> Translation:
    """deepseek2 and glm4moe (_MOE_BEYOND): the model type transformers names them (GLM-4.5 is glm4_moe; deepseek2
    is DeepSeek V3 where the file holds V3's selection bias ('exp_probs_b', transformers' e_score_correction_bias)
    or says its experts are gated by a sigmoid (expert_gating_func 2, V3's), else V2), and _HF_KEYS with the MoE
    keys llama.cpp's converter writes for them (_MOE_KEYS)."""
    import gguf

    keys = {key: attr for key, attr in _HF_KEYS.items() if key != "expert_count"} | _MOE_KEYS
    if arch == "deepseek2":
        sigmoid = header.metadata.get(f"{arch}.expert_gating_func") == gguf.ExpertGatingFuncType.SIGMOID.value
        biased = any(name.endswith((".exp_probs_b", ".exp_probs_b.bias")) for name in header.tensors)
        model_type = "deepseek_v3" if sigmoid or biased else "deepseek_v2"
        keys = {key: attr for key, attr in keys.items() if key != "attention.key_length"} | _MLA_KEYS
    else:
        model_type = "glm4_moe"
    return Translation(model_type, {f"{arch}.{key}": attr for key, attr in keys.items()},
                       "llama.cpp's converter, which transformers' GGUF loader does not read", {})


def _expert_keys(model_type: str) -> dict[str, str]:
    """_EXPERT_KEYS whose attribute the model type's config class has (a dense family's has none of them)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    attributes = set(vars(CONFIG_MAPPING[model_type]()))
    return {key: attr for key, attr in _EXPERT_KEYS.items() if attr in attributes}


def _plain(name: str) -> str:
    return name.lower().replace("_", "").replace("-", "")


def config_from_metadata(header: GGUFHeader) -> tuple[dict, list[str]]:
    """The equivalent transformers config.json (as a dict) and notes on how it was derived."""
    meta = header.metadata
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise CheckpointError(f"{shown(header.path)}: GGUF metadata has no 'general.architecture' string; is it a "
                              "model file?")
    how = translation(header, arch)
    for required in ("block_count", "embedding_length", "feed_forward_length"):
        if f"{arch}.{required}" in how.keys and f"{arch}.{required}" not in meta:
            raise CheckpointError(f"{shown(header.path)}: GGUF metadata lacks '{arch}.{required}', "
                                  "needed to build the reference")
    raw: dict[str, Any] = dict(how.defaults)
    for key, attr in how.keys.items():
        value = meta.get(key)
        if value is not None and isinstance(attr, str):
            raw[attr] = _metadata_value(header, key, value)
    for attr in ("num_local_experts", "num_experts", "num_experts_per_tok"):
        if raw.get(attr) == 0:  # a dense model's expert_count 0 (llama.cpp writes it): no experts to configure
            del raw[attr]
    raw["vocab_size"] = _vocab_size(header, arch)
    for attr in [a for a in raw if a.endswith("token_id")]:
        if raw[attr] >= raw["vocab_size"]:  # an id the vocabulary does not hold: transformers' default instead
            del raw[attr]
    raw["model_type"] = how.model_type
    return raw, [f"GGUF architecture '{arch}' checked as transformers model_type '{how.model_type}' (metadata "
                 f"translated by {how.source}; GGUF names no activation, so transformers' default for the type is "
                 "run, as its GGUF loader does)"]


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
    elif key.endswith(("expert_count", "expert_used_count", "sliding_window", "token_id")):
        why = int_problem(value, 0, MAX_EXPERTS if "expert" in key else MAX_LENGTH)
    elif key.endswith(_INT_KEYS):
        why = int_problem(value, 1, MAX_LENGTH if key.endswith("context_length") else MAX_WIDTH)
    elif isinstance(value, bool):  # a flag only transformers reads (expert_weights_norm: norm_topk_prob)
        why = None
    else:  # a value only transformers reads (not the FFN's): a finite number
        why = float_problem(value, -float("inf")) if isinstance(value, (int, float)) else "not a number"
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
