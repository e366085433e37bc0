"""The values a checkpoint's config supplies, checked for type and range before transformers or
parity uses them: a config.json (or GGUF metadata, or a Meta params.json) may hold anything.

A count the config claims is held against what the checkpoint holds: a model cannot have more
layers than the checkpoint has tensors, so ``num_hidden_layers = 1000000`` over three layers of
weights is refused here, before transformers builds a million layers.  Every message names the
file, the key and the value.
"""

from __future__ import annotations

import math
from typing import Any

from parity.definitions.families import ACTIVATION_ATTRS
from parity.definitions.files import short, shown
from parity.definitions.patterns import regex_value
from parity.errors import CheckpointError

MAX_WIDTH = 2**24  # hidden size, d_ff, heads, head_dim: no model comes near 16M
MAX_LENGTH = 2**31  # vocabulary, context length
MAX_EXPERTS = 2**16
LAYER_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")

# key -> (minimum, maximum, may be null)
INT_KEYS: dict[str, tuple[int, int, bool]] = {
    **{key: (1, MAX_WIDTH, False) for key in ("hidden_size", "n_embd", "d_model", "num_attention_heads", "n_head")},
    # intermediate_size may be null: GPT-Neo's config leaves it None, which its transformers module reads as 4d
    **{key: (1, MAX_WIDTH, True) for key in ("n_inner", "intermediate_size", "num_key_value_heads", "head_dim",
                                             "moe_intermediate_size")},
    **{key: (1, MAX_LENGTH, True) for key in ("vocab_size", "max_position_embeddings", "n_positions", "n_ctx")},
    "sliding_window": (0, MAX_LENGTH, True),
    **{key: (0, MAX_EXPERTS, True) for key in ("num_local_experts", "num_experts", "num_experts_per_tok",
                                               "n_routed_experts")},
}
# key -> smallest value allowed (all must be finite numbers)
FLOAT_KEYS = {"rms_norm_eps": 0.0, "layer_norm_epsilon": 0.0, "layer_norm_eps": 0.0, "norm_eps": 0.0,
              "rope_theta": 1e-300, "initializer_range": 0.0}


def int_problem(value: Any, minimum: int, maximum: int) -> str | None:
    """Why ``value`` is not an integer in [minimum, maximum] (None: it is)."""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"expected an integer, got {type(value).__name__}"
    if not minimum <= value <= maximum:
        return f"expected an integer from {minimum} to {maximum}"
    return None


def float_problem(value: Any, minimum: float) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"expected a number, got {type(value).__name__}"
    if not math.isfinite(value) or value < minimum:
        return "expected a finite number" + (" >= 0" if minimum == 0 else " > 0")
    return None


def check_config_values(raw: dict, where: str, tensors: int) -> None:
    """Every known size, count and constant of ``raw`` (a config.json as a dict) has a usable type and range;
    a layer count is at most ``tensors`` (the checkpoint's tensor count: each layer has its own)."""
    def fail(key: str, why: str) -> CheckpointError:
        return CheckpointError(f"{where}: '{key}' = {short(raw[key])}: {why}; fix the config or use the one that "
                               "came with these weights")

    if "model_type" in raw and not isinstance(raw["model_type"], str):
        raise fail("model_type", "expected a string naming a transformers model type")
    for key in LAYER_KEYS:
        if key in raw:
            why = int_problem(raw[key], 1, max(tensors, 1))
            if why is not None:
                count = raw[key]
                if why.startswith("expected an integer from") and isinstance(count, int) and count > tensors:
                    why = (f"more layers than the checkpoint's {tensors} tensors could hold "
                           "(each layer has tensors of its own): this config does not describe these weights")
                elif why.startswith("expected an integer from"):
                    why = "a model needs at least one layer"
                raise fail(key, why)
    for key, (minimum, maximum, nullable) in INT_KEYS.items():
        if key in raw and not (nullable and raw[key] is None):
            values = raw[key] if isinstance(raw[key], list) and 0 < len(raw[key]) <= 4096 else [raw[key]]
            why = next((w for w in (int_problem(v, minimum, maximum) for v in values) if w is not None), None)
            if why is not None:
                raise fail(key, why)
    for key, minimum in FLOAT_KEYS.items():
        if key in raw and raw[key] is not None and (why := float_problem(raw[key], minimum)) is not None:
            raise fail(key, why)
    for key in ("torch_dtype", "dtype"):
        if raw.get(key) is not None and not _is_dtype_name(raw[key]):
            raise fail(key, "expected the name of a torch dtype, e.g. \"bfloat16\" or \"float32\"")
    for key in ("text_config",):  # composite configs keep the language model's sizes in a sub-config
        if isinstance(raw.get(key), dict) and not where.endswith(f"({key})"):  # one level: no recursion
            check_config_values(raw[key], f"{where} ({key})", tensors)


def _is_dtype_name(value: Any) -> bool:
    import torch

    return isinstance(value, str) and (value == "auto" or isinstance(getattr(torch, value, None), torch.dtype))


def check_activation(raw: dict, where: str) -> None:
    """An activation the config names must be one transformers knows (``ACT2FN``); what else could run?"""
    from transformers.activations import ACT2FN

    for key in ACTIVATION_ATTRS:
        value = raw.get(key)
        if value is None:
            continue
        if not isinstance(value, str) or value not in ACT2FN:
            known = ", ".join(sorted(k for k in ACT2FN if isinstance(k, str))[:12])
            raise CheckpointError(f"{where}: '{key}' = {short(value)} is not an activation transformers knows "
                                  f"(transformers.activations.ACT2FN: {known}, ...); fix the config")


def stated_modules(config: dict, key: str, where: str) -> tuple[str, ...]:
    """The module names a quantization_config's list ``key`` states (``modules_to_not_convert``), () where it is
    absent or null; anything but a list of strings is a CheckpointError naming the field."""
    found = config.get(key)
    if found is None:
        return ()
    if not isinstance(found, list) or not all(isinstance(n, str) for n in found):
        raise CheckpointError(f"{where}: config.json's quantization_config.{key} is {found!r}; expected a list of "
                              "module names")
    for pattern in found:  # transformers' should_convert_module matches each as a regular expression too
        try:
            regex_value(pattern)
        except ValueError as exc:
            raise CheckpointError(f"{where}: config.json's quantization_config.{key} {exc}") from None
    return tuple(found)


def config_where(location: str, config_dir: Any) -> str:
    """How messages name a checkpoint's config: its config.json, or the checkpoint whose metadata built it."""
    if config_dir is not None:
        return shown(f"{config_dir}/config.json")
    return f"{shown(location)} (its config, built from the file's metadata)"
