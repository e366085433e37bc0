"""A GGUF file's FFN layout derived, for a model type no mapping file fits: transformers' own model says which
Hugging Face checkpoint tensors form a layer's FFN and where they go (``derive.derive_mapping``), and gguf's own name
map for the file's ``general.architecture`` (``gguf.TensorNameMap``: the table llama.cpp's converter names GGUF tensors
with) says what each is called in the file.  No table per family: any architecture both know is served.

The derivation runs on the Hugging Face names gguf's map lists; the layout it returns is then spelled in the file's
names, unit by unit (dense layers, a shared expert: each under the first two layers it serves; a tensor the file lacks
is named when its layer is read, as for any checkpoint).  GGUF holds every 2-D tensor in nn.Linear's [out, in] layout
once dequantized (llama.cpp's converter transposes transformers' Conv1D weights, GPT-2's): routes into a Conv1D
reference transpose it back, routes into an nn.Linear target take it as stored.

A layer's routed experts are no tensor gguf's map names in Hugging Face's spelling (llama.cpp's converter merges the
per-expert tensors itself): the proxy checkpoint holds transformers' own fused experts parameters instead, so the
derivation finds them, and ``layout.gguf_experts`` spells the experts unit in gguf's stacked ``*_exps`` tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from parity.definitions.mapping import Mapping, TensorRoute
from parity.engine.layout.derive import derive_mapping, describe_layers, projections, refused
from parity.engine.layout.experts import BIASES, FUSED
from parity.engine.layout.gguf_experts import EXPERT_TENSORS, LAYER_KEY, gguf_experts
from parity.engine.layout.gguf_names import name_table
from parity.sources.checkpoint import Checkpoint
from parity.sources.skeleton import ModelSkeleton


def derive_gguf_mapping(ckpt: Any, load_config: Callable[[Checkpoint], Any]) -> Mapping:
    """The mapping transformers' model and gguf's name map imply for this GGUF checkpoint (a ``GGUFCheckpoint``);
    MappingError (exit 2) where either cannot say."""
    config = load_config(ckpt)
    arch = ckpt.header.metadata["general.architecture"]
    count = int(config.num_hidden_layers)
    arch_id, table = name_table(ckpt, count)
    in_file = {f"{hf}{suffix}": f"{name}{suffix}" for hf, (kind, name) in table.mapping.items()
               if kind not in EXPERT_TENSORS for suffix in (".weight", ".bias")}  # the file says if it holds each
    skeleton = ModelSkeleton(config)
    fused = [name for name, _ in skeleton.skeleton.named_parameters()
             if name.rsplit(".", 1)[-1] in FUSED + BIASES]  # transformers' own experts: derive finds them as they are
    proxy = Checkpoint(f"{ckpt.location} (its tensors as gguf's '{arch}' map names them in Hugging Face's spelling)",
                       None, ckpt.raw_config, dict.fromkeys([*in_file, *fused], ckpt.header.path.name),
                       lambda _: ckpt.header.path)
    hf = derive_mapping(proxy, lambda _: config)
    import transformers

    suffix = f", GGUF names from gguf {_gguf_version()}'s '{arch}' map"
    model_type = hf.model_types[0]
    units = [gguf_experts(unit, ckpt, arch_id, arch, lambda why, what: refused(model_type, why, what))
             if unit.experts is not None else _dense(unit, skeleton, in_file, count) for unit in (hf, *hf.parts)]
    units = [dataclasses.replace(unit, name=unit.name + suffix, path=Path(unit.name + suffix), layer_key=LAYER_KEY,
                                 key_prefixes=[""]) for unit in units]
    main, *parts = units
    notes = main.notes
    for before, after in zip(hf.parts, parts, strict=True):
        notes = [note.replace(before.name, after.name) for note in notes]
    return dataclasses.replace(
        main, parts=parts, notes=notes,
        description=f"GGUF '{arch}': layout derived from transformers {transformers.__version__} and gguf's name map"
                    + "".join(f"; {part.unit}: {describe_layers(part)}" for part in parts))


def _dense(unit: Mapping, skeleton: ModelSkeleton, in_file: dict[str, str], count: int) -> Mapping:
    """A dense unit (every layer's FFN, the dense layers before MoE ones, a shared expert) in the file's names."""
    module = skeleton.meta_module(unit.reference_path(unit.first_layer))
    stored = {own: own for own, _ in module.named_parameters()} | {r.target: r.source for r in unit.reference_tensors}
    layers = [i for i in (unit.layers or range(count))][:2]
    names = {source: gguf_name(unit, in_file, source, layers) for source in stored.values()}
    transposed = {stored[f"{p.name}.weight"] for p in projections(module) if p.layout == "in_out"}
    flip = {"none": "transpose", "transpose": "none"}
    tensors = [dataclasses.replace(r, source=names[r.source],
                                   transform=flip[r.transform] if r.source in transposed else r.transform)
               for r in unit.tensors]
    reference = [TensorRoute(own, names[source], "transpose" if source in transposed else "none")
                 for own, source in stored.items()]
    return dataclasses.replace(unit, tensors=tensors, reference_tensors=reference)


def gguf_name(hf: Mapping, in_file: dict[str, str], source: str, layers: list[int]) -> str:
    """The file's name, relative to 'blk.{layer}', of one FFN tensor named ``source`` under the derived layout: the
    same for the first two layers the unit serves (gguf's map spells every layer alike)."""
    spelled = []
    for layer in layers:
        name = in_file[f"{hf.key_prefixes[0]}{hf.layer_prefix(layer)}.{source}"]
        block = LAYER_KEY.format(layer=layer) + "."
        if not name.startswith(block):
            raise refused(hf.model_types[0], f"gguf names its FFN tensor '{source}' of layer {layer} '{name}', "
                          f"outside the layer's '{block}' block", "for its names ")
        spelled.append(name[len(block):])
    if len(set(spelled)) != 1:
        raise refused(hf.model_types[0], f"gguf names its FFN tensor '{source}' differently in layers "
                      f"{' and '.join(map(str, layers))} ({', '.join(spelled)})", "for its names ")
    return spelled[0]


def _gguf_version() -> str:
    from parity.sources.gguf_header import gguf_version

    return gguf_version()
