"""A checkpoint's FFN layout derived from transformers itself, for a model type no mapping file serves.

transformers already knows every family it ships: its model (built on the meta device) holds the decoder layers,
each layer's FFN module, its projections and their shapes; its load-time conversion
(``transformers.conversion_mapping`` / ``core_model_loading.rename_source_key``) says which checkpoint tensor
becomes which parameter.  From those this module builds the in-memory ``Mapping`` a mapping file would give:
where a layer's FFN tensors are, transformers' module as the reference, and the repository module (``parity.ffn``)
that expresses the FFN as the default target, chosen from the module's structure and activation, never from the
family's name.  A mapping file stays the override: this runs only where none serves the model type.

Where the FFN is (the decoder layers, a layer's FFN: a child, or the layer's own modules in order; a forward that
also takes the residual, run with a zero one) is read off the modules in ``layout.structure``; where a mixture of
experts keeps each expert, in ``layout.experts``.  A model whose layers are not all alike (dense layers before MoE
ones, a shared expert beside the routed ones, FFNs of different widths) gets one layout per kind of unit: the first
is the mapping, the others its ``parts``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from torch import nn

from parity.definitions.aliases import load_aliases
from parity.definitions.mapping import Experts, Mapping, TensorRoute
from parity.engine.layout.block_experts import BlockExperts, find_block_experts
from parity.engine.layout.experts import ExpertsModule, expert_layout, find_experts
from parity.engine.layout.flat_experts import FlatExperts, find_flat_experts, holds_flat_experts
from parity.engine.layout.measured import gated_formula_gap, settings
from parity.engine.layout.renaming import Renamed, renamed_keys
from parity.engine.layout.structure import (
    FFN,
    activation_label,
    activation_of,
    decoder_stacks,
    ffn_of,
    find_ffn,
    has_experts,
    own_parameters,
    projections,
    refused,
    usable_alone,
)
from parity.engine.reference import activation_module
from parity.errors import MappingError
from parity.sources.checkpoint import Checkpoint
from parity.sources.skeleton import INLINE, ZERO_RESIDUAL, ModelSkeleton

# parity.ffn's modules: the activations each takes (structure.activation_of names them)
GATED = {"silu": "parity.ffn:SwiGLU", "gelu_tanh": "parity.ffn:GeGLU"}
CLASSIC = ("relu", "gelu", "gelu_tanh")  # parity.ffn.FeedForward(activation=...)
ADVICE = ("`parity CKPT --target pkg.module:YourFFN` checks your own module against it, and "
          "`parity compare A B` needs no target")


def derive_mapping(ckpt: Checkpoint, load_config: Callable[[Checkpoint], Any]) -> Mapping:
    """The mapping transformers' own model implies for this checkpoint (MappingError, exit 2, where it cannot);
    ``load_config``: the checkpoint's transformers config, once transformers is known to have its model type."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    model_type = ckpt.raw_config.get("model_type")
    if model_type not in CONFIG_MAPPING_NAMES:
        from parity.definitions.registry import builtin_mappings

        served = sorted({t for m in builtin_mappings().values() for t in m.model_types})
        raise MappingError(
            f"no mapping serves model_type {model_type!r} (config.json), and transformers {transformers.__version__} "
            "installed here does not know it, so its layout cannot be derived (parity derives layouts only for "
            f"types transformers ships); known model types: {', '.join(served)}. Write a mapping file for it and pass "
            "it with --mapping FILE.toml (docs/own-module.md), or install a transformers that ships it")
    config = load_config(ckpt)
    model = ModelSkeleton(config).skeleton
    stacks = decoder_stacks(model, config)
    d = getattr(config.get_text_config() if hasattr(config, "get_text_config") else config, "hidden_size", None)
    if not isinstance(d, int) or isinstance(d, bool):  # a multimodal wrapper's width is its text model's
        raise refused(model_type, f"transformers' {type(config).__name__} states no hidden_size (nor does its text "
                      "config), so the FFN's input width is not known")
    units, skipped = [], []
    for path, layers in stacks:
        found, note = stack_units(Decoder(path, layers, model, ckpt, d, model_type))
        units += named_after_stack(found, path, [p for p, _ in stacks], model_type)
        skipped += [note] if note else []
    main, *parts = units
    main.notes += skipped
    if not parts:
        return main
    for unit in units:  # every row of a report names its unit where a layer has several, or layers differ
        unit.unit = unit.unit or (None if unit.experts else unit_name(unit.reference_module))
    main.parts = parts
    main.description += "; " + "; ".join(part.description for part in parts)
    others = "; ".join(f"{part.unit} ({describe_layers(part)}): {part.name}" for part in parts)
    main.notes += [f"each layer's units are not all alike: {main.unit or 'routed experts'} ({describe_layers(main)}) "
                   f"as the mapping above says, and {others}"]
    return main


def stack_units(decoder: Decoder) -> tuple[list[Mapping], str | None]:
    """The units of one list of decoder layers (routed experts, a shared expert, each kind of dense FFN), and the
    note on its layers holding no FFN, if any."""
    layers, d = decoder.layers, decoder.d
    moe = [i for i, layer in enumerate(layers) if has_experts(layer, d)]
    dense = [i for i in range(len(layers)) if i not in moe]
    units = experts_mappings(decoder, moe) if moe else []
    skipped = dense_units(decoder, dense, units)
    return units, skipped


def named_after_stack(units: list[Mapping], path: str, paths: list[str], model_type: str | None) -> list[Mapping]:
    """Where the decoder layers are in several lists (``structure.decoder_stacks``), each unit named after its
    list (the part of its path the lists differ in: HRM's 'H_module.mlp', 'L_module.mlp'); one list: as they are."""
    if len(paths) == 1:
        return units
    if any(unit.experts is not None for unit in units):
        raise refused(model_type, f"its decoder layers are in {len(paths)} lists ({', '.join(paths)}) holding "
                      "routed experts, and experts are derived in one list of layers only")
    split = [p.split(".") for p in paths]
    own = ".".join(part for i, part in enumerate(path.split("."))
                   if len({s[i] if i < len(s) else None for s in split}) > 1)
    for unit in units:
        unit.unit = f"{own}.{unit.unit or unit_name(unit.reference_module)}"
        unit.description = f"{unit.description} in {path}"
    return units


def dense_units(decoder: Decoder, dense: list[int], units: list[Mapping]) -> str | None:
    """Appends to ``units`` the dense FFNs of these layers, one unit per kind (Gemma 3n's widths differ layer by
    layer).  Layers holding no FFN at all (a hybrid's Mamba or attention-only blocks: NemotronH's) are skipped where
    other layers hold one, and said so (returned: the note); where none does, the derivation is refused."""
    skipped = None
    groups = ffn_groups([decoder.layers[i] for i in dense], dense, decoder.d)
    for group in groups:
        if (units or len(groups) > 1) and find_ffn(decoder.layers[group[0]], decoder.d) is None:
            kinds = sorted({type(child).__name__ for i in group for child in decoder.layers[i].children()
                            if next(child.parameters(), None) is not None and not _is_norm(child)})
            skipped = (f"layers {spans(group)} hold no FFN ({', '.join(kinds) or 'no module with weights'}): not "
                       "checked, and not counted as a failure")
            continue
        units.append(dense_mapping(decoder, group, uniform_ffn([decoder.layers[i] for i in group], group, decoder.d,
                                                               decoder.model_type)))
    return skipped


def unit_name(path: str) -> str:
    """A unit's name in the report: the last part of its module's path ('shared_expert'), with the list it is an
    item of where that part is a number (LongCat-Flash's 'mlps.0', 'mlps.1')."""
    parts = path.split(".")
    return ".".join(parts[-2:]) if parts[-1].isdigit() and len(parts) > 1 else parts[-1]


def _is_norm(module: nn.Module) -> bool:
    return all(p.dim() == 1 for p in module.parameters())


def describe_layers(mapping: Mapping) -> str:
    return "every layer" if mapping.layers is None else f"layers {spans(list(mapping.layers))}"


@dataclass(frozen=True)
class Decoder:
    """transformers' model of the checkpoint and its decoder layers: what each unit's layout is read from."""

    path: str
    layers: nn.ModuleList
    model: nn.Module
    ckpt: Checkpoint
    d: int
    model_type: str | None

    @cached_property
    def renamed(self) -> Renamed:
        """The checkpoint's keys as transformers' load-time conversion names them: asked once for every unit."""
        return renamed_keys(self.model, list(self.ckpt.weight_map))

    @cached_property
    def chunked(self) -> dict[str, tuple[str, tuple[int, int]]]:
        """The parameters transformers cuts out of one checkpoint tensor (``Renamed.chunks``)."""
        return self.renamed.chunks()

    def module_path(self, within: str) -> str:
        return ".".join(p for p in (f"{self.path}.{{layer}}", within) if p)

    def layers_note(self, indices: list[int]) -> tuple[int, ...] | None:
        """The ``layers`` of a unit's mapping: None where it is every layer."""
        return None if len(indices) == len(self.layers) else tuple(indices)


def dense_mapping(decoder: Decoder, indices: list[int], ffn: FFN, unit: str | None = None) -> Mapping:
    """The layout of a dense FFN found at the same place in each of these layers."""
    import transformers

    module_path = decoder.module_path(ffn.path)
    pair = tuple(indices[:2])
    chunked: dict[str, tuple[int, int]] = {}
    names = checkpoint_names(decoder, [module_path.format(layer=i) for i in pair], ffn.module, chunked)
    layer_key, sources = checkpoint_layout(names, module_path, decoder.model_type, pair)
    prefix = module_path.format(layer=pair[0]) + "."
    chunks = {own[len(prefix):]: chunk for own, chunk in chunked.items() if own.startswith(prefix)}
    shown_class = type(ffn.module).__name__ if not ffn.inline else f"{type(decoder.layers[0]).__name__}'s " \
        + "+".join(ffn.inline)
    reference = module_path + (INLINE + "+".join(ffn.inline) if ffn.inline else "")
    if ffn.residual:  # its forward adds the residual: run with a zero one (structure.usable_alone)
        shown_class, reference = shown_class + ZERO_RESIDUAL, reference + ZERO_RESIDUAL
    name = f"derived from transformers {transformers.__version__} {shown_class} at {module_path}"
    target_class, args, tensors = default_target(ffn, decoder.d, sources, chunks)
    where = "" if decoder.layers_note(indices) is None else f" (layers {spans(indices)})"
    return Mapping(
        name=name, path=Path(name), model_types=[decoder.model_type], layer_key=layer_key, reference_module=reference,
        target_class=target_class, target_args=args, tensors=tensors, num_layers=len(decoder.layers),
        hidden_size=decoder.d, derived=True, layers=decoder.layers_note(indices), unit=unit, width=ffn.width,
        description=f"{decoder.model_type}: layout derived from transformers' {shown_class}{where} (no mapping file)",
        reference_tensors=[TensorRoute(own, source, chunk=chunks.get(own)) for own, source in sources.items()
                           if own != source or own in chunks],
        notes=[f"{ffn.prenorm} normalises the FFN's input inside transformers' module: it is the FFN's pre-norm, "
               "outside the FFN as every layer's norms are, and not judged"] if ffn.prenorm else [],
    )


def spans(indices: list[int]) -> str:
    """'0-2, 5' for [0, 1, 2, 5]."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def ffn_groups(layers: list[nn.Module], indices: list[int], d: int) -> list[list[int]]:
    """The layers (by number) grouped by their FFN's path, class and shapes, in order of first appearance: one
    group where every layer is alike; a layer holding no FFN parity reads comes first (uniform_ffn refuses it)."""
    groups: dict[str, list[int]] = {}
    for index, layer in zip(indices, layers, strict=True):
        ffn = find_ffn(layer, d)
        key = None if ffn is None else (ffn.path, type(ffn.module), [(p.d_in, p.d_out) for p in (*ffn.ins, ffn.out)],
                                        settings(ffn.module))
        key = repr(key)
        groups.setdefault(key, []).append(index)
    return sorted(groups.values(), key=lambda group: (group is not groups.get("None"), group[0]))


def uniform_ffn(layers: list[nn.Module], indices: list[int], d: int, model_type: str | None,
                find: Callable[[nn.Module, int], FFN | None] | None = None) -> FFN:
    """The first layer's FFN, when each of these layers (numbered ``indices``) has a dense FFN of the same path,
    class and shapes; ``find``: how a layer's FFN is found (default: ``find_ffn``)."""
    ffns = [(find or find_ffn)(layer, d) for layer in layers]
    missing = [i for i, f in zip(indices, ffns, strict=True) if f is None]
    if missing:
        raise refused(model_type, f"layer {missing[0]} of transformers' {type(layers[0]).__name__} holds no module "
                      "whose projections read d -> d_ff -> d with an activation between them (an FFN, as parity reads "
                      "one)")
    first = usable_alone(ffns[0], model_type)
    shape = [(p.d_in, p.d_out) for p in (*first.ins, first.out)]
    for i, f in zip(indices, ffns, strict=True):
        if (f.path, type(f.module), f.inline, [(p.d_in, p.d_out) for p in (*f.ins, f.out)]) != \
                (first.path, type(first.module), first.inline, shape):
            raise refused(model_type, f"layer {i}'s FFN ({type(f.module).__name__}, d_ff {f.width}) differs from "
                          f"layer {indices[0]}'s ({type(first.module).__name__}, d_ff {first.width}), and per-layer "
                          "layouts are not derived yet")
    return first


def checkpoint_names(decoder: Decoder, paths: list[str], module: nn.Module,
                     chunks: dict[str, tuple[int, int]] | None = None) -> dict[str, str]:
    """Model parameter name -> the checkpoint tensor that fills it, for the parameters of ``module`` (the FFN, or
    the module holding experts) under ``paths``: transformers' own load-time renaming applied to every checkpoint
    key (``decoder.renamed``).  ``chunks`` (a dense FFN's): also a parameter transformers cuts out of one tensor
    (``Renamed.chunks``), its (index, count) recorded there."""
    model, ckpt, model_type = decoder.model, decoder.ckpt, decoder.model_type
    wanted = {f"{path}.{name}" for path in paths for name in module.state_dict()}  # saved buffers too
    found: dict[str, str] = {}
    for key, (own, converter) in decoder.renamed.keys.items():
        if own in wanted and converter is None:
            found.setdefault(own, key)
    if chunks is not None:
        for own, (key, chunk) in decoder.chunked.items():
            if own in wanted and own not in found:
                found[own], chunks[own] = key, chunk
    lacking = sorted(wanted - set(found))
    if lacking:
        raise refused(model_type, f"transformers' {type(model).__name__} needs checkpoint tensor '{lacking[0]}' (or a "
                      "name transformers' load-time conversion turns into it), which this checkpoint does not hold "
                      f"({len(ckpt.weight_map)} tensors, e.g. {', '.join(sorted(ckpt.weight_map)[:3])})",
                      "for its names ")
    return found


def checkpoint_layout(names: dict[str, str], module_path: str, model_type: str | None, pair: tuple[int, ...]
                      ) -> tuple[str, dict[str, str]]:
    """(layer_key, FFN parameter name -> checkpoint name relative to it) from two layers' tensors (``pair``; one
    layer: the part of its tensors' common stem that is its number)."""
    keys, stems = {}, {}
    for layer in pair:
        prefix = module_path.format(layer=layer) + "."
        keys[layer] = {own[len(prefix):]: key for own, key in names.items() if own.startswith(prefix)}
        parts = [key.split(".") for key in keys[layer].values()]
        common = 0
        while all(len(p) > common + 1 and p[common] == parts[0][common] for p in parts):
            common += 1
        stems[layer] = parts[0][:common]
    one, other = pair[0], pair[-1] if len(pair) > 1 else pair[0] + 1
    first = stems[one]
    places = module_path.split(".")  # one layer: its number where the module's path has it, if the stem is alike
    at = {i for i, part in enumerate(places) if part == "{layer}"} if len(places) == len(first) else range(len(first))
    second = stems.get(other, [str(other) if part == str(one) and i in at else part for i, part in enumerate(first)])
    template = [("{layer}" if (a, b) == (str(one), str(other)) else a) for a, b in zip(first, second, strict=False)]
    if len(first) != len(second) or template.count("{layer}") != 1 or [
            p for p, a, b in zip(template, first, second, strict=False) if p != "{layer}" and a != b]:
        raise refused(model_type, f"the checkpoint's FFN tensors of layers {one} and {other} ({'.'.join(first)}, "
                      f"{'.'.join(second)}) differ in more or less than the layer number", "for its names ")
    stem = ".".join(first) + "."
    return ".".join(template), {own: key[len(stem):] for own, key in keys[one].items()}


ROLE_TARGETS = {"gate": "_gate", "up": "_up", "down": "_down", "fc_in": "_layer1", "fc_out": "_layer2"}


def projection_roles(ffn: FFN) -> tuple[dict[str, str], str | None]:
    """Each projection's role (gate, up, down; gate_up fused; fc_in, fc_out): a classic FFN's by structure, a gated
    one's gate and up by transformers' own names (aliases.toml); with what stands in the way, if anything."""
    if len(ffn.ins) == 1 and not ffn.fused:
        return {ffn.ins[0].name: "fc_in", ffn.out.name: "fc_out"}, None
    aliases = load_aliases()
    roles = {ffn.out.name: "down"}
    wanted = {"gate_up"} if ffn.fused else {"gate", "up"}
    for proj in ffn.ins:
        said = {role for role, kind in aliases.roles_of(f"{proj.name}.weight") if role in wanted}
        if len(said) != 1:
            return roles, (f"its projection '{proj.name}' reads as {' or '.join(sorted(said)) or 'no gated role'} "
                           f"in {aliases.path.name}, so which input projection is the gate is not said")
        roles[proj.name] = said.pop()
    if sorted(roles.values()) != sorted({"down", *wanted}):
        return roles, "its input projections' names read as one role"
    return roles, None


def target_routes(ffn: FFN, roles: dict[str, str], sources: dict[str, str], chunks: dict[str, tuple[int, int]]
                  ) -> list[TensorRoute]:
    """parity.ffn's parameters filled from the checkpoint's tensors: an nn.Linear weight as stored, a Conv1D one
    transposed, a fused [gate; up] in halves; a parameter transformers cuts out of one checkpoint tensor, its chunk
    of it (``chunks``).  A bias the checkpoint lacks is no route (parity zeroes it, saying so)."""
    routes = []
    for proj in (*ffn.ins, ffn.out):
        role = roles.get(proj.name)
        if role is None:
            continue
        parts = [("gate", (0, 2)), ("up", (1, 2))] if role == "gate_up" else [(role, None)]
        transform = "transpose" if proj.layout == "in_out" else "none"
        for part, chunk in parts:
            weight, bias = f"{proj.name}.weight", f"{proj.name}.bias"
            routes.append(TensorRoute(f"{ROLE_TARGETS[part]}.weight", sources[weight], transform,
                                      chunks.get(weight, chunk)))
            if proj.bias:
                routes.append(TensorRoute(f"{ROLE_TARGETS[part]}.bias", sources[bias], "none", chunks.get(bias, chunk)))
    return routes


def repository_gap(ffn: FFN, d: int, unsaid: str | None) -> str | None:
    """What parity.ffn's modules lack to express this FFN (None: one does); its activation said first, as what
    the FFN computes (xIELU's own parameters are its activation's)."""
    act, label = activation_of(ffn.module), activation_label(ffn.module)
    gated = len(ffn.ins) == 2 or ffn.fused
    if gated and act not in GATED:
        return (f"it is a gated FFN running {label}, and parity.ffn's gated modules run SiLU (SwiGLU) or tanh GELU "
                "(GeGLU)")
    if not gated and act not in CLASSIC:
        return f"it runs {label}, and parity.ffn.FeedForward runs ReLU, exact GELU or tanh GELU"
    others = own_parameters(ffn)
    if others:
        return f"it holds parameters besides its projections ({', '.join(others[:3])})"
    if unsaid:
        return unsaid
    if not gated and ffn.width != 4 * d:
        return f"its d_ff is {ffn.width}, and parity.ffn.FeedForward's d_ff is always 4·d ({4 * d})"
    if gated and not ffn.inline and not ffn.residual:
        return gated_formula_gap(ffn.module, ffn.ins, ffn.out, act, d)
    return None


def default_target(ffn: FFN, d: int, sources: dict[str, str], chunks: dict[str, tuple[int, int]] | None = None
                   ) -> tuple[str, dict[str, Any], list[TensorRoute]]:
    """[target].class, [target].args and [tensors] for the repository module that expresses this FFN; where none
    does, a target that refuses in one line when built (exit 2), and the same routes for ``--target``.
    ``chunks``: the FFN's parameters cut out of one checkpoint tensor, each its (index, count)."""
    chunks = chunks or {}
    roles, unsaid = projection_roles(ffn)
    routes = target_routes(ffn, roles, sources, chunks)
    if own_parameters(ffn):  # no parity.ffn module holds them: a --target port holds transformers' names
        routes = [TensorRoute(name, sources[name], chunk=chunks.get(name)) for name, _ in ffn.module.named_parameters()]
    gap = repository_gap(ffn, d, unsaid)
    bias = any(p.bias for p in (*ffn.ins, ffn.out))
    gated = len(ffn.ins) == 2 or ffn.fused
    args: dict[str, Any] = {"emb_size": d, "hidden_dim": ffn.width, "bias": bias, "dropout": 0.0} if gated else \
        {"emb_size": d, "activation": activation_of(ffn.module) or "relu", "dropout": 0.0}
    if gap is not None:
        what = type(ffn.module).__name__ if not ffn.inline else f"{ffn.module.layer_class}'s {'+'.join(ffn.inline)}"
        return refusing_target(what, gap), args, routes
    return (GATED[activation_of(ffn.module)] if gated else "parity.ffn:FeedForward"), args, routes


def refusing_target(what: str, gap: str) -> str:
    """[target].class of a derived layout that no repository module expresses: importing it refuses in one line."""
    key = "repository_lacks_" + re.sub(r"\W", "_", what)
    REFUSALS[key] = f"no module of the repository (parity.ffn) expresses transformers' {what}: {gap}; {ADVICE}"
    return f"parity.engine.layout.derive:{key}"


def experts_mappings(decoder: Decoder, moe: list[int]) -> list[Mapping]:
    """The layouts of the layers with experts: the routed experts (each a unit, read where the checkpoint keeps it:
    parity.engine.layout.experts), then each dense FFN beside them (a shared expert) as a unit of its own."""
    import transformers

    first, module_path, layer_key, experts, target = routed_experts(decoder, moe)
    shown_class = type(first.module).__name__
    names = ROLE_TARGETS if experts.gate is not None else {"up": "_layer1", "down": "_layer2"}  # ungated: classic
    tensors = [dataclasses.replace(route, target=f"{names[role.removesuffix('_bias')]}."
                                                 f"{'bias' if role.endswith('_bias') else 'weight'}")
               for role, route in ((r.target, r) for r in experts.routes)]
    name = f"derived from transformers {transformers.__version__} {shown_class} at {module_path}"
    where = "" if decoder.layers_note(moe) is None else f" (layers {spans(moe)})"
    routed = Mapping(
        name=name, path=Path(name), model_types=[decoder.model_type], layer_key=layer_key,
        reference_module=module_path, target_class=target, tensors=tensors, num_layers=len(decoder.layers),
        target_args={"emb_size": decoder.d, "hidden_dim": first.width, "bias": bool(experts.biases), "dropout": 0.0}
        if experts.gate is not None else {"emb_size": decoder.d, "activation": activation_of(first.module) or "relu",
                                          "dropout": 0.0},
        hidden_size=decoder.d, experts=experts, derived=True, layers=decoder.layers_note(moe), width=first.width,
        description=f"{decoder.model_type}: {first.count} experts per layer{where}, layout derived from "
                    f"transformers' {shown_class}")
    if isinstance(first, BlockExperts) and first.others:  # said, not silently left out
        routed.notes = [f"{shown_class}'s own {', '.join(first.others)} belong to the whole block, not to an expert: "
                        "each expert is checked with them zero, and they are not judged"]
    layers = [decoder.layers[i] for i in moe]
    units = [routed]
    shared_units = shared_paths(decoder.layers[moe[0]], first, decoder.d)
    for shared in shared_units:  # each dense FFN beside them, a unit
        ffn = uniform_ffn(layers, moe, decoder.d, decoder.model_type,
                          find=lambda layer, d, shared=shared: ffn_at(layer, shared, d))
        units.append(dense_mapping(decoder, moe, ffn, unit=unit_name(shared)))
    unread = stacks_beside(decoder.layers[moe[0]], [first.path, *shared_units])
    if unread:  # said, not silently left out
        routed.notes = [*routed.notes, f"{', '.join(unread)} (stacked beside the routed experts, no projections) "
                        "form no unit parity reads: not checked on their own; `parity compare` judges them within "
                        "each MoE layer's whole block"]
    return units


def stacks_beside(layer: nn.Module, covered: list[str]) -> list[str]:
    """The layer's parameters stacked over experts (3-D) that no unit reads: InklingSharedExperts' gate_proj,
    up_proj, down_proj [S, ff, d], shared experts held as stacks, not projections."""
    return [f"{path}.{name}".lstrip(".") for path, module in layer.named_modules()
            if not isinstance(module, nn.modules.conv._ConvNd)  # a convolution's 3-D kernel is no stack
            for name, param in module.named_parameters(recurse=False) if param.dim() == 3
            and not any(f"{path}.{name}".lstrip(".").startswith(f"{done}.") for done in covered if done)]


def routed_experts(decoder: Decoder, moe: list[int]) -> tuple[Any, str, str, Experts, str]:
    """(transformers' experts module, its path with '{layer}', the layer_key, [experts], the default target) of the
    layers with experts: one fused module (layout.experts), else matrices flattened over experts (flat_experts)."""
    found = [find_experts(decoder.layers[i], decoder.d) for i in moe]
    first = found[0]
    if first is None and all(f is None for f in found):
        return flat_routed(decoder, moe)
    if first is None or any(f is None or (f.path, type(f.module), f.count, f.width) !=
                            (first.path, type(first.module), first.count, first.width) for f in found):
        raise refused(decoder.model_type, f"transformers' {type(decoder.layers[moe[0]]).__name__} holds experts that "
                      "are not one fused module (gate_up_proj and down_proj stacked over experts) of the same shape "
                      "in every layer with experts", "with an [experts] table ")
    module_path = decoder.module_path(first.path)
    layer_key, experts = expert_layout(decoder.renamed, module_path, first, tuple(moe[:2]),
                                       lambda why, what="": refused(decoder.model_type, why, what))
    if not first.gated:  # down(act(up(x))): a classic FFN per expert
        gap = classic_gap(first.module, first.width, decoder.d)
        target = refusing_target(type(first.module).__name__, gap) if gap else "parity.ffn:FeedForward"
    else:
        target = GATED.get(activation_of(first.module)) or refusing_target(type(first.module).__name__,
                                                                           experts_gap(first))
    return first, module_path, layer_key, experts, target


def classic_gap(module: nn.Module, width: int, d: int) -> str | None:
    """What parity.ffn.FeedForward lacks to express experts without a gate (None: it expresses them)."""
    if activation_of(module) not in CLASSIC:
        return (f"its experts are ungated FFNs running {activation_label(module)}, and parity.ffn.FeedForward runs "
                "ReLU, exact GELU or tanh GELU")
    if width != 4 * d:
        return f"its experts' d_ff is {width}, and parity.ffn.FeedForward's d_ff is always 4·d ({4 * d})"
    return None


def flat_routed(decoder: Decoder, moe: list[int]) -> tuple[FlatExperts, str, str, Experts, str]:
    """``routed_experts`` for experts kept as matrices flattened over experts (DBRX's [E·ff, d] w1, v1, w2): each
    matrix's role and orientation measured on transformers' module, its tensors found through its renaming."""
    first = find_flat_experts(decoder.layers[moe[0]], decoder.d, activation_module)
    layer_class = type(decoder.layers[moe[0]]).__name__
    if first is None:
        first = find_block_experts(decoder.layers[moe[0]], decoder.d, decoder.model.config, activation_module)
        if isinstance(first, BlockExperts):
            return block_routed(decoder, moe, first)
    if not isinstance(first, FlatExperts):
        why = f" ({first})" if isinstance(first, str) else ""
        raise refused(decoder.model_type, f"transformers' {layer_class} holds experts that are neither one fused "
                      "module (gate_up_proj and down_proj stacked over experts) nor three matrices flattened over "
                      f"experts that read as a gated FFN{why}", "with an [experts] table ")
    holder = ".".join(p for p in (first.path, first.holder) if p)
    others = [i for i in moe if type(_at(decoder.layers[i], holder)) is not type(first.module.get_submodule(
        first.holder)) or not holds_flat_experts(decoder.layers[i], decoder.d)]
    if others:
        raise refused(decoder.model_type, f"layer {others[0]} of transformers' {layer_class} does not hold its "
                      f"experts as layer {moe[0]} does ({holder})", "with an [experts] table ")
    holder_path = decoder.module_path(holder)
    names = checkpoint_names(decoder, [holder_path.format(layer=i) for i in moe[:2]],
                             first.module.get_submodule(first.holder))
    layer_key, sources = checkpoint_layout(names, holder_path, decoder.model_type, tuple(moe[:2]))
    routes = {role: TensorRoute(role, sources[name], "transpose" if flipped else "none")
              for name, role, flipped in first.roles}
    experts = Experts(first.count, routes["gate"], routes["up"], routes["down"],
                      stacked=tuple(sources[name] for name, _, _ in first.roles), flat=True)
    act = activation_of(first.module.get_submodule(first.holder))
    target = GATED.get(act) or refusing_target(type(first.module).__name__, (
        f"its experts are gated FFNs running {activation_label(first.module.get_submodule(first.holder))}, and "
        "parity.ffn's gated modules run SiLU (SwiGLU) or tanh GELU (GeGLU)"))
    return first, decoder.module_path(first.path), layer_key, experts, target


def block_routed(decoder: Decoder, moe: list[int], first: BlockExperts) -> tuple[BlockExperts, str, str, Experts, str]:
    """``routed_experts`` for a block that routes x to its experts itself (JetMoE's): an expert's gate, up and down
    where the measured reading of its two stacks says; the reference is the block with one expert."""
    layer_class = type(decoder.layers[moe[0]]).__name__
    others = [i for i in moe if type(_at(decoder.layers[i], first.path)) is not type(first.module)]
    if others:
        raise refused(decoder.model_type, f"layer {others[0]} of transformers' {layer_class} does not hold its "
                      f"experts as layer {moe[0]} does ({first.path})", "with an [experts] table ")
    block_path = decoder.module_path(first.path)
    names = checkpoint_names(decoder, [block_path.format(layer=i) for i in moe[:2]], first.module)
    layer_key, sources = checkpoint_layout(names, block_path, decoder.model_type, tuple(moe[:2]))
    reading = first.reading
    flip = reading.fused_transposed  # the reader turns both stacks' slices when the fused one is stored [in, out]
    order = (0, 1) if reading.gate_first else (1, 0)
    gate, up = (TensorRoute(role, sources[reading.fused], chunk=(index, 2), interleaved=reading.interleaved)
                for role, index in zip(("gate", "up"), order, strict=True))
    down = TensorRoute("down", sources[reading.down], "transpose" if reading.down_transposed != flip else "none")
    experts = Experts(first.count, gate, up, down, stacked=(sources[reading.fused], sources[reading.down]),
                      transposed=flip)
    act = activation_of(first.module)
    target = GATED.get(act) or refusing_target(type(first.module).__name__, (
        f"its experts are gated FFNs running {activation_label(first.module)}, and parity.ffn's gated modules run "
        "SiLU (SwiGLU) or tanh GELU (GeGLU)"))
    return first, block_path, layer_key, experts, target


def _at(layer: nn.Module, path: str) -> nn.Module | None:
    try:
        return layer.get_submodule(path)
    except AttributeError:
        return None


def experts_gap(experts: ExpertsModule) -> str:
    """What parity.ffn's gated modules lack to express these experts."""
    if activation_module(experts.module) is None:
        return ("its experts compute their gated activation in their own code (no activation module: "
                f"{', '.join(n for n in ('alpha', 'limit') if hasattr(experts.module, n)) or 'its own formula'}), "
                "and parity.ffn's gated modules run SiLU (SwiGLU) or tanh GELU (GeGLU) on the gate alone")
    return (f"its experts are gated FFNs running {activation_label(experts.module)}, and parity.ffn's gated modules "
            "run SiLU (SwiGLU) or tanh GELU (GeGLU)")


def shared_paths(layer: nn.Module, experts: ExpertsModule | FlatExperts, d: int) -> list[str]:
    """The paths (relative to the layer) of the dense FFNs beside the layer's experts (a shared expert; Gemma 4's
    dense mlp beside its router and experts), each a unit; the outermost where one holds another."""
    found = [path for path, module in layer.named_modules()
             if path and not path.startswith(experts.path) and ffn_of(projections(module), d)
             and activation_module(module) is not None]
    return [path for path in found if not any(path.startswith(other + ".") for other in found)]


def ffn_at(layer: nn.Module, path: str, d: int) -> FFN | None:
    """The FFN at ``path`` under the layer, as ``find_ffn`` describes one."""
    try:
        module = layer.get_submodule(path)
    except AttributeError:
        return None
    shape = ffn_of(projections(module), d)
    return None if shape is None else FFN(path, module, *shape)


def expressible(mapping: Mapping, config: Any) -> Mapping:
    """A built-in mapping whose default target is parity.ffn.FeedForward (d_ff always 4d) over an FFN transformers
    builds at another width (GPT-2 with n_inner set): its default target refuses in one line, as a derived one
    does, instead of failing every layer with a mismatch that is the repository's, not the checkpoint's."""
    if mapping.target_class != "parity.ffn:FeedForward" or mapping.experts is not None:
        return mapping
    d = getattr(config, "hidden_size", None)
    module = ModelSkeleton(config).meta_module(mapping.reference_path(0))
    shape = ffn_of(projections(module), d) if isinstance(d, int) else None
    if shape is None or shape[2] == 4 * d:
        return mapping
    key = "repository_lacks_" + re.sub(r"\W", "_", f"{mapping.name}_{shape[2]}")
    REFUSALS[key] = (f"no module of the repository (parity.ffn) expresses transformers' {type(module).__name__} of "
                     f"this checkpoint: its d_ff is {shape[2]}, and parity.ffn.FeedForward's d_ff is always 4·d "
                     f"({4 * d}); {ADVICE}")
    return dataclasses.replace(mapping, target_class=f"parity.engine.layout.derive:{key}")


REFUSALS: dict[str, str] = {}  # [target].class of a derived layout no repository module expresses -> why


def __getattr__(name: str) -> Any:
    """The default target of a derived layout no repository module expresses: importing it (only a check without
    --target does) refuses in one line, exit 2, before anything is built."""
    if name in REFUSALS:
        raise MappingError(REFUSALS[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
