"""A GGUF file's FFN layout derived, for a model type no mapping file fits: transformers' own model says which
Hugging Face checkpoint tensors form a layer's FFN and where they go (``derive.derive_mapping``), and gguf's own name
map for the file's ``general.architecture`` (``gguf.TensorNameMap``: the table llama.cpp's converter names GGUF tensors
with) says what each is called in the file.  No table per family: any architecture both know is served.

The derivation runs on the Hugging Face names gguf's map lists for layers 0 and 1; the layout it returns is then
spelled in the file's names (a tensor the file lacks is named when its layer is read, as for any checkpoint).
GGUF holds every 2-D tensor in nn.Linear's [out, in] layout once dequantized (llama.cpp's converter transposes
transformers' Conv1D weights, GPT-2's): routes into a Conv1D reference transpose it back, routes into an nn.Linear
target take it as stored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from parity.definitions.mapping import Mapping, TensorRoute
from parity.engine.layout.derive import derive_mapping, projections, refused
from parity.sources.checkpoint import Checkpoint
from parity.sources.skeleton import ModelSkeleton

LAYER_KEY = "blk.{layer}"  # every block tensor of gguf.constants.TENSOR_NAMES is 'blk.{bid}.NAME'


def derive_gguf_mapping(ckpt: Any, load_config: Callable[[Checkpoint], Any]) -> Mapping:
    """The mapping transformers' model and gguf's name map imply for this GGUF checkpoint (a ``GGUFCheckpoint``);
    MappingError (exit 2) where either cannot say."""
    import gguf

    config = load_config(ckpt)
    arch = ckpt.header.metadata["general.architecture"]
    count = int(config.num_hidden_layers)
    table = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), min(count, 2))
    in_file = {f"{hf}{suffix}": f"{name}{suffix}" for hf, (_, name) in table.mapping.items()
               for suffix in (".weight", ".bias")}  # whether the file holds each is told when a layer is read
    proxy = Checkpoint(f"{ckpt.location} (its tensors as gguf's '{arch}' map names them in Hugging Face's spelling)",
                       None, ckpt.raw_config, dict.fromkeys(in_file, ckpt.header.path.name), lambda _: ckpt.header.path)
    hf = derive_mapping(proxy, lambda _: config)
    module = ModelSkeleton(config).meta_module(hf.reference_path(0))
    stored = {own: own for own, _ in module.named_parameters()} | {r.target: r.source for r in hf.reference_tensors}
    names = {source: gguf_name(hf, in_file, source, count) for source in stored.values()}
    transposed = {stored[f"{p.name}.weight"] for p in projections(module) if p.layout == "in_out"}
    flip = {"none": "transpose", "transpose": "none"}
    tensors = [dataclasses.replace(r, source=names[r.source],
                                   transform=flip[r.transform] if r.source in transposed else r.transform)
               for r in hf.tensors]
    reference = [TensorRoute(own, names[source], "transpose" if source in transposed else "none")
                 for own, source in stored.items()]
    import transformers

    name = f"{hf.name}, GGUF names from gguf {_gguf_version()}'s '{arch}' map"
    return dataclasses.replace(
        hf, name=name, path=Path(name), layer_key=LAYER_KEY, key_prefixes=[""], tensors=tensors,
        reference_tensors=reference,
        description=f"GGUF '{arch}': layout derived from transformers {transformers.__version__} and gguf's name map")


def gguf_name(hf: Mapping, in_file: dict[str, str], source: str, count: int) -> str:
    """The file's name, relative to 'blk.{layer}', of one FFN tensor named ``source`` under the derived layout: the
    same for layers 0 and 1 (gguf's map spells every layer alike)."""
    spelled = []
    for layer in (0, 1) if count > 1 else (0,):
        name = in_file[f"{hf.key_prefixes[0]}{hf.layer_prefix(layer)}.{source}"]
        block = LAYER_KEY.format(layer=layer) + "."
        if not name.startswith(block):
            raise refused(hf.model_types[0], f"gguf names its FFN tensor '{source}' of layer {layer} '{name}', "
                          f"outside the layer's '{block}' block", "for its names ")
        spelled.append(name[len(block):])
    if len(set(spelled)) != 1:
        raise refused(hf.model_types[0], f"gguf names its FFN tensor '{source}' differently in layers 0 and 1 "
                      f"({', '.join(spelled)})", "for its names ")
    return spelled[0]


def _gguf_version() -> str:
    from parity.sources.gguf_header import gguf_version

    return gguf_version()
