"""A GGUF file's routed experts, spelled in gguf's own tensor names for its architecture.

llama.cpp's converter stores each layer's experts stacked, one tensor per projection over the E experts: gguf's
``MODEL_TENSOR.FFN_GATE_EXP`` / ``FFN_UP_EXP`` / ``FFN_DOWN_EXP`` (``blk.N.ffn_gate_exps.weight``, [E, ff, d] once
dequantized, nn.Linear's [out, in] per expert), or gate and up fused in ``FFN_GATE_UP_EXP`` as their halves
([E, 2·ff, d]: gate rows first).  Which of these an architecture has is gguf's ``MODEL_TENSORS[arch]``; which the file
holds, the file says.  Experts with biases (GPT-OSS) keep them beside, ``ffn_gate_exps.bias`` [E, ff].

GPT-OSS: transformers' GptOssExperts interleaves gate and up along gate_up_proj's output (rows 0::2 and 1::2) and
computes ``x @ W`` ([E, d, 2·ff]); llama.cpp's converter transposes each expert to [out, in] and splits the rows
0::2 / 1::2 into ``ffn_gate_exps`` and ``ffn_up_exps`` (its option to concatenate them, gate first, into
``ffn_gate_up_exps`` needs an architecture whose MODEL_TENSORS list FFN_GATE_UP_EXP, which gguf 0.19's 'gpt-oss' does
not).  So no GGUF stores gate and up interleaved or transposed: each expert is read as stored, and
parity.engine.experts puts it back into transformers' own layout for the reference.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from parity.definitions.mapping import Experts, Mapping, TensorRoute

LAYER_KEY = "blk.{layer}"  # every block tensor of gguf.constants.TENSOR_NAMES is 'blk.{bid}.NAME'


def _expert_tensors() -> dict[Any, str]:
    """gguf's kinds of stacked expert tensors, by the projection each holds."""
    from gguf.constants import MODEL_TENSOR

    return {MODEL_TENSOR.FFN_GATE_EXP: "gate", MODEL_TENSOR.FFN_UP_EXP: "up", MODEL_TENSOR.FFN_DOWN_EXP: "down",
            MODEL_TENSOR.FFN_GATE_UP_EXP: "gate_up"}


EXPERT_TENSORS = _expert_tensors()


def gguf_experts(unit: Mapping, ckpt: Any, arch_id: Any, arch: str, refuse: Any) -> Mapping:
    """The experts unit of a layout derived in Hugging Face's names, in the file's stacked tensors: the same experts
    (count, biases) and the same target parameters, each expert read as stored ([out, in], gate and up apart).
    ``refuse(why, what)`` makes the exit-2 error where gguf names no stacked experts for the architecture."""
    from gguf.constants import MODEL_TENSORS, TENSOR_NAMES

    block = LAYER_KEY.format(layer=unit.first_layer) + "."
    names = {role: TENSOR_NAMES[kind].removeprefix("blk.{bid}.") for kind, role in EXPERT_TENSORS.items()
             if kind in MODEL_TENSORS[arch_id]}
    held = {role for role, name in names.items() if ckpt.has(f"{block}{name}.weight")}
    fused = "gate_up" in held and not {"gate", "up"} & held
    wanted = ("gate_up", "down") if fused else ("gate", "up", "down")
    if not set(wanted) <= set(names):
        raise refuse(f"gguf {_version()} names no stacked {'/'.join(wanted)} expert tensors for "
                      f"architecture '{arch}' (its MODEL_TENSORS), so where the file keeps transformers' "
                      f"{unit.reference_module} is not said", "with an [experts] table ")
    experts = unit.experts
    if fused:
        gate, up = (TensorRoute(role, f"{names['gate_up']}.weight", chunk=(i, 2)) for i, role in
                    enumerate(("gate", "up")))
    else:
        gate, up = (TensorRoute(role, f"{names[role]}.weight") for role in ("gate", "up"))
    down = TensorRoute("down", f"{names['down']}.weight")
    biases: tuple[TensorRoute, ...] = ()
    if experts.biases:
        biases = tuple(dataclasses.replace(route, target=route.target + "_bias",
                                           source=route.source.removesuffix(".weight") + ".bias")
                       for route in (gate, up, down))
    routes = (gate, up, down, *biases)
    stacked = tuple(dict.fromkeys(route.source for route in routes))
    layout = Experts(experts.count, gate, up, down, stacked=stacked, transposed=False, biases=biases)
    tensors = [dataclasses.replace(route, target=old.target)
               for old, route in zip(unit.tensors, layout.routes, strict=True)]
    return dataclasses.replace(unit, experts=layout, tensors=tensors, reference_tensors=[])


def _version() -> str:
    from parity.sources.gguf_header import gguf_version

    return gguf_version()
