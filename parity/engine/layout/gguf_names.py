"""A GGUF file's tensor names, asked of gguf's own name map (``gguf.TensorNameMap``: the table llama.cpp's converter
names GGUF tensors with) for the file's ``general.architecture``: which key of the file holds a tensor transformers
names.  Kept apart from ``layout.gguf`` (which derives whole layouts) so that a MoE block's router, selection bias and
shared-expert gate can be found without the derivation."""

from __future__ import annotations

from typing import Any


def name_table(ckpt: Any, count: int) -> tuple[Any, Any]:
    """The file's architecture (gguf's MODEL_ARCH) and gguf's name map for it over ``count`` layers."""
    import gguf

    arch = ckpt.header.metadata["general.architecture"]
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    return arch_id, gguf.get_tensor_name_map(arch_id, count)


# The end of a transformers name -> the end of the file's: gguf's map lists each tensor without its suffix, and lists
# a selection bias buffer 'mlp.gate.e_score_correction_bias' as 'mlp.gate.e_score_correction' (FFN_EXP_PROBS_B), which
# llama.cpp's converter writes as 'exp_probs_b.bias'.
SUFFIXES = ((".weight", ".weight"), (".bias", ".bias"), ("_bias", ".bias"))


def gguf_keys(ckpt: Any, names: list[str], layer: int) -> dict[str, str]:
    """transformers' names of tensors in layer ``layer`` (a MoE block's router, selection bias, shared experts and
    their gate) -> the file's keys, for each name gguf's map spells and the file holds."""
    _, table = name_table(ckpt, layer + 1)
    found = {}
    for name in names:
        for ours, theirs in SUFFIXES:
            spelled = table.get_name(name.removesuffix(ours)) if name.endswith(ours) else None
            if spelled is not None and f"{spelled}{theirs}" in ckpt.weight_map:
                found[name] = f"{spelled}{theirs}"
                break
    return found
