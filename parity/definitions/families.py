"""What a family's config says about its FFN, read the way transformers reads it: d_ff, the
activation's name, and the published d_ff rules (to say when a config departs from them).

parity's own copy of LLaMA's rule: the code under test (``parity.ffn``) has one too, and
the checker must not share code with what it checks.  Pure Python, no torch.
"""

from __future__ import annotations

from typing import Any

# transformers' names of the tanh form of GELU (its ACT2FN); "gelu" is the exact, erf form.
TANH_GELUS = frozenset({"gelu_new", "gelu_pytorch_tanh", "gelu_python_tanh", "gelu_fast", "gelu_accurate"})

# Where configs name their activation, most specific first (Gemma 2/3 use hidden_activation).
ACTIVATION_ATTRS = ("hidden_activation", "hidden_act", "activation_function", "afn")


def config_dff(config: Any) -> int | None:
    """d_ff as the config states it; None where it is implied (GPT configs leave n_inner empty: 4d).  A config
    class with ``n_inner`` (GPT-2, GPT-J, CodeGen, GPTBigCode) is built from it alone: an ``intermediate_size``
    beside it is an extra key transformers keeps but never reads."""
    if hasattr(config, "n_inner"):
        return getattr(config, "n_inner", None)
    return getattr(config, "intermediate_size", None) if declares(config, "intermediate_size") else None


def declares(config: Any, name: str) -> bool:
    """Whether ``config``'s class has a field ``name`` (annotated by the family's own config class, or in its
    attribute_map), or cannot say (a class that declares no field of its own).  A key saved in config.json that the
    class does not declare (an ``intermediate_size`` in a Bloom or GPT-1 config) is kept on the object but no
    module reads it."""
    own = [vars(k).get("__annotations__", {}) for k in type(config).__mro__
           if k.__name__ not in ("PreTrainedConfig", "PretrainedConfig", "object")]
    fields = set().union(*own)
    return not fields or name in fields or name in (getattr(config, "attribute_map", None) or {})


def configured_activation(config: Any) -> str | None:
    for attr in ACTIVATION_ATTRS:
        value = getattr(config, attr, None)
        if isinstance(value, str):
            return value
    return None


def llama_intermediate_size(embed_dim: int, multiple_of: int = 256, ffn_dim_multiplier: float | None = None) -> int:
    """m * ceil(floor(8d/3) [* multiplier] / m): 4096 -> 11008; llama2.c's 288 with m=32 -> 768."""
    hidden = (8 * embed_dim) // 3
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return -(-hidden // multiple_of) * multiple_of


def dff_rule(model_type: str | None, d: int, d_ff: int | None) -> dict[str, Any]:
    """Whether d_ff follows the family's published rule (it must still be read from the config)."""
    rules = {
        "gpt2": ("4d (GPT)", 4 * d), "openai-gpt": ("4d (GPT)", 4 * d),
        "llama": (f"llama_intermediate_size({d})", llama_intermediate_size(d)),
        "mistral": ("3.5d (Mistral)", int(3.5 * d)), "gemma": ("8d (Gemma 1)", 8 * d),
    }
    ratio = round(d_ff / d, 4) if d_ff else None
    if model_type not in rules or d_ff is None:
        return {"rule": None, "expected": None, "follows": None, "ratio": ratio}
    rule, expected = rules[model_type]
    follows = d_ff == expected
    if not follows and model_type == "llama":  # other multiple_of values (llama2.c uses 32)
        for multiple in (32, 64, 128, 512, 1024):
            if llama_intermediate_size(d, multiple) == d_ff:
                rule, expected, follows = f"llama_intermediate_size({d}, multiple_of={multiple})", d_ff, True
                break
    return {"rule": rule, "expected": expected, "follows": follows, "ratio": ratio}


def with_dff(config: Any, width: int) -> Any | None:
    """A copy of ``config`` whose MLPs are ``width`` units wide (None: the config states d_ff nowhere parity knows).

    GPT configs imply 4d by leaving ``n_inner`` empty; setting it is how transformers builds another width.
    """
    import copy

    for attr in ("intermediate_size", "n_inner"):
        if hasattr(config, attr) and (attr == "n_inner" or getattr(config, attr) is not None):
            narrow = copy.deepcopy(config)
            setattr(narrow, attr, width)
            return narrow
    return None
