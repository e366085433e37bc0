"""A checkpoint's FFN layout derived from transformers itself, for a model type no mapping file serves.

transformers already knows every family it ships: its model (built on the meta device) holds the decoder layers,
each layer's FFN module, its projections and their shapes; its load-time conversion
(``transformers.conversion_mapping`` / ``core_model_loading.rename_source_key``) says which checkpoint tensor
becomes which parameter.  From those this module builds the in-memory ``Mapping`` a mapping file would give:
where a layer's FFN tensors are, transformers' module as the reference, and the repository module (``parity.ffn``)
that expresses the FFN as the default target, chosen from the module's structure and activation, never from the
family's name.  A mapping file stays the override: this runs only where none serves the model type.

The structure, read off the modules: the decoder layers are the ModuleList ``num_hidden_layers`` long; a layer's
FFN is the child whose projections (nn.Linear, transformers' Conv1D) map d -> d_ff (one, or two: gate and up, or
one fused [gate; up]) and then d_ff -> d, holding an activation; where the projections sit on the layer itself
(OPT's fc1/fc2) the layer's own modules form it (``sources.skeleton.InlineFFN``).  Mixture-of-experts layers are
refused here (each expert is a later slice).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from parity.definitions.aliases import load_aliases
from parity.definitions.mapping import Mapping, TensorRoute
from parity.engine.layout.experts import ExpertsModule, expert_layout, find_experts
from parity.engine.reference import activation_module
from parity.errors import MappingError
from parity.sources.checkpoint import Checkpoint
from parity.sources.skeleton import INLINE, ModelSkeleton

# parity.ffn's modules: the activations each takes, by transformers' ACT2CLS names of the same function
GATED = {"silu": "parity.ffn:SwiGLU", "gelu_tanh": "parity.ffn:GeGLU"}
CLASSIC = ("relu", "gelu", "gelu_tanh")  # parity.ffn.FeedForward(activation=...)
_SAME_FUNCTION = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_python": "gelu", "relu": "relu",
                  "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_python_tanh": "gelu_tanh"}
ADVICE = ("`parity CKPT --target pkg.module:YourFFN` checks your own module against it, and "
          "`parity compare A B` needs no target")


def refused(model_type: str | None, why: str, mapping_with: str = "") -> MappingError:
    """Why a layout cannot be derived, in one line: it comes up only where no mapping file serves the type."""
    import transformers

    return MappingError(f"no mapping serves model_type {model_type!r} (config.json), and its layout cannot be derived "
                        f"from transformers {transformers.__version__}: {why}; write a mapping file {mapping_with}and "
                        "pass it with --mapping FILE.toml (docs/own-module.md)")


@dataclass(frozen=True)
class Projection:
    """One projection of an FFN: its name (relative to the FFN module), widths, storage layout and bias."""

    name: str
    d_in: int
    d_out: int
    layout: str  # "out_in" (nn.Linear) | "in_out" (transformers' Conv1D)
    bias: bool


@dataclass(frozen=True)
class FFN:
    """A layer's FFN as transformers builds it: ``path`` relative to the layer ("" + ``inline``: on the layer)."""

    path: str
    module: nn.Module
    ins: tuple[Projection, ...]
    out: Projection
    width: int
    inline: tuple[str, ...] = ()

    @property
    def fused(self) -> bool:
        return len(self.ins) == 1 and self.ins[0].d_out == 2 * self.width


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
    layers_path, layers = decoder_layers(model, config)
    d = int(config.hidden_size)
    decoder = Decoder(layers_path, layers, model, ckpt, d, model_type)
    moe = [i for i, layer in enumerate(layers) if has_experts(layer, d)]
    dense = [i for i in range(len(layers)) if i not in moe]
    units = experts_mappings(decoder, moe) if moe else []
    for group in ffn_groups([layers[i] for i in dense], dense, d):  # Gemma 3n's widths differ layer by layer
        units.append(dense_mapping(decoder, group, uniform_ffn([layers[i] for i in group], group, d, model_type)))
    main, *parts = units
    if not parts:
        return main
    for unit in units:  # every row of a report names its unit where a layer has several, or layers differ
        unit.unit = unit.unit or (None if unit.experts else unit.reference_module.rsplit(".", 1)[-1])
    main.parts = parts
    main.description += "; " + "; ".join(part.description for part in parts)
    others = "; ".join(f"{part.unit} ({describe_layers(part)}): {part.name}" for part in parts)
    main.notes = [f"each layer's units are not all alike: {main.unit or 'routed experts'} ({describe_layers(main)}) as "
                  f"the mapping above says, and {others}"]
    return main


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
    names = checkpoint_names(decoder.model, decoder.ckpt, [module_path.format(layer=i) for i in pair], ffn,
                             decoder.model_type)
    layer_key, sources = checkpoint_layout(names, module_path, decoder.model_type, pair)
    shown_class = type(ffn.module).__name__ if not ffn.inline else f"{type(decoder.layers[0]).__name__}'s " \
        + "+".join(ffn.inline)
    reference = module_path + (INLINE + "+".join(ffn.inline) if ffn.inline else "")
    name = f"derived from transformers {transformers.__version__} {shown_class} at {module_path}"
    target_class, args, tensors = default_target(ffn, decoder.d, sources)
    where = "" if decoder.layers_note(indices) is None else f" (layers {spans(indices)})"
    return Mapping(
        name=name, path=Path(name), model_types=[decoder.model_type], layer_key=layer_key, reference_module=reference,
        target_class=target_class, target_args=args, tensors=tensors, num_layers=len(decoder.layers),
        hidden_size=decoder.d, derived=True, layers=decoder.layers_note(indices), unit=unit,
        description=f"{decoder.model_type}: layout derived from transformers' {shown_class}{where} (no mapping file)",
        reference_tensors=[TensorRoute(own, source) for own, source in sources.items() if own != source],
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


def decoder_layers(model: nn.Module, config: Any) -> tuple[str, nn.ModuleList]:
    """The decoder layers: the outermost ModuleList ``num_hidden_layers`` long whose items hold projections."""
    count = getattr(config, "num_hidden_layers", None)
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == count and count \
                and all(projections(layer) for layer in module):
            return path, module
    raise refused(getattr(config, "model_type", None), f"transformers' {type(model).__name__} has no list of {count} "
                  f"decoder layers (config num_hidden_layers = {count}) to find the FFN in")


def projections(module: nn.Module, direct: bool = False) -> list[Projection]:
    """The module's projections (nn.Linear, transformers' Conv1D: by class, through the MRO), in the order they are
    registered; ``direct``: only its own children."""
    aliases = load_aliases()
    found = []
    members = module.named_children() if direct else module.named_modules()
    for name, child in members:
        weight = getattr(child, "weight", None)
        layout = aliases.layout_of([cls.__name__ for cls in type(child).__mro__])
        if layout is None or not isinstance(weight, nn.Parameter) or weight.dim() != 2:
            continue
        d_out, d_in = weight.shape if layout == "out_in" else weight.shape[::-1]
        found.append(Projection(name, int(d_in), int(d_out), layout, getattr(child, "bias", None) is not None))
    return found


def ffn_of(projs: list[Projection], d: int) -> tuple[tuple[Projection, ...], Projection, int] | None:
    """(in projections, out projection, d_ff) when ``projs`` read d -> d_ff (one; two alike; one fused [gate; up])
    and then d_ff -> d, the last registered writing; None for anything else (attention's q/k/v/o)."""
    if len(projs) not in (2, 3):
        return None
    *ins, out = projs
    width = out.d_in
    if out.d_out != d or any(p.d_in != d for p in ins):
        return None
    if len(ins) == 2 and all(p.d_out == width for p in ins) or len(ins) == 1 and ins[0].d_out in (width, 2 * width):
        return tuple(ins), out, width
    return None


def find_ffn(layer: nn.Module, d: int) -> FFN | None:
    """The layer's FFN: the child that is one (holding an activation, when two children read alike), else the
    layer's own projections with the activation between them (OPT)."""
    found = []
    for name, child in layer.named_children():
        shape = ffn_of(projections(child), d)
        if shape is not None:
            found.append(FFN(name, child, *shape))
    if len(found) > 1:
        found = [f for f in found if activation_module(f.module) is not None]
    if len(found) == 1:
        return found[0]
    shape = ffn_of(projections(layer, direct=True), d)
    act = activation_module(layer)
    if found or shape is None or act is None or len(shape[0]) != 1:
        return None
    act_name = next(name for name, child in layer.named_children() if child is act)
    return FFN("", layer, *shape, inline=(shape[0][0].name, act_name, shape[1].name))


def has_experts(layer: nn.Module, d: int) -> bool:
    """Whether the layer holds a mixture of experts: a ModuleList of FFNs, or parameters stacked over E experts
    (3-D, not a convolution's) beside a router that scores them (a 2-D weight [E, d] or [d, E]).  A 3-D parameter
    alone is no expert stack (RWKV's [1, 1, d] mixes, RecurrentGemma's block-diagonal gates)."""
    matrices = {tuple(p.shape) for p in layer.parameters() if p.dim() == 2}
    for module in layer.modules():
        if isinstance(module, nn.ModuleList) and any(ffn_of(projections(m), _width_in(m)) for m in module):
            return True
        if isinstance(module, nn.modules.conv._ConvNd):
            continue
        stacks = {p.shape[0] for p in module.parameters(recurse=False) if p.dim() == 3}
        if any((count, d) in matrices or (d, count) in matrices for count in stacks):
            return True
    return False


def _width_in(module: nn.Module) -> int:
    projs = projections(module)
    return projs[-1].d_out if projs else -1


def ffn_groups(layers: list[nn.Module], indices: list[int], d: int) -> list[list[int]]:
    """The layers (by number) grouped by their FFN's path, class and shapes, in order of first appearance: one
    group where every layer is alike; a layer holding no FFN parity reads comes first (uniform_ffn refuses it)."""
    groups: dict[str, list[int]] = {}
    for index, layer in zip(indices, layers, strict=True):
        ffn = find_ffn(layer, d)
        key = None if ffn is None else (ffn.path, type(ffn.module), [(p.d_in, p.d_out) for p in (*ffn.ins, ffn.out)])
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
    first = ffns[0]
    takes = [name for name, p in inspect.signature(first.module.forward).parameters.items()
             if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not first.inline and len(takes) != 1:
        raise refused(model_type, f"transformers' {type(first.module).__name__}.forward takes ({', '.join(takes)}), "
                      "not the FFN's input alone (it does more than the FFN, e.g. adds the residual), and checking "
                      "such a module is not built yet")
    buffers = [name for name, _ in first.module.named_buffers()
               if not first.inline or name.split(".")[0] in first.inline]
    if buffers:
        raise refused(model_type, f"transformers' {type(first.module).__name__} holds buffers ({', '.join(buffers)}: "
                      "values its parameters do not carry), and reading them into the reference is not built yet")
    shape = [(p.d_in, p.d_out) for p in (*first.ins, first.out)]
    for i, f in zip(indices, ffns, strict=True):
        if (f.path, type(f.module), [(p.d_in, p.d_out) for p in (*f.ins, f.out)]) != \
                (first.path, type(first.module), shape):
            raise refused(model_type, f"layer {i}'s FFN ({type(f.module).__name__}, d_ff {f.width}) differs from "
                          f"layer {indices[0]}'s ({type(first.module).__name__}, d_ff {first.width}), and per-layer "
                          "layouts are not derived yet")
    return first


def checkpoint_names(model: nn.Module, ckpt: Checkpoint, paths: list[str], ffn: FFN,
                     model_type: str | None) -> dict[str, str]:
    """Model parameter name -> the checkpoint tensor that fills it, for the FFN parameters under ``paths``:
    transformers' own load-time renaming (``rename_source_key``) applied to every checkpoint key."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    conversions = get_model_conversion_mapping(model)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    state = model.state_dict()
    wanted = {f"{path}.{name}" for path in paths for name, _ in ffn.module.named_parameters()
              if not ffn.inline or name.split(".")[0] in ffn.inline}
    found: dict[str, str] = {}
    for key in ckpt.weight_map:
        own, converter = rename_source_key(key, renamings, converters, model.base_model_prefix, state)
        if own in wanted and converter is None:
            found.setdefault(own, key)
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
    second = stems.get(other, [str(other) if part == str(one) else part for part in first])
    template = [("{layer}" if (a, b) == (str(one), str(other)) else a) for a, b in zip(first, second, strict=False)]
    if len(first) != len(second) or template.count("{layer}") != 1 or [
            p for p, a, b in zip(template, first, second, strict=False) if p != "{layer}" and a != b]:
        raise refused(model_type, f"the checkpoint's FFN tensors of layers {one} and {other} ({'.'.join(first)}, "
                      f"{'.'.join(second)}) differ in more or less than the layer number", "for its names ")
    stem = ".".join(first) + "."
    return ".".join(template), {own: key[len(stem):] for own, key in keys[one].items()}


def activation_of(module: nn.Module) -> str | None:
    """The function of the FFN's activation as parity.ffn names it ('silu', 'gelu', 'gelu_tanh', 'relu'), read off
    its class through transformers' ACT2CLS (torch's nn.GELU by its ``approximate``); None: none of those."""
    from transformers.activations import ACT2CLS

    act = activation_module(module)
    if act is None:
        return None
    if type(act) is nn.GELU:
        return "gelu_tanh" if act.approximate == "tanh" else "gelu"
    names = {name for name, entry in ACT2CLS.items() if (entry[0] if isinstance(entry, tuple) else entry) is type(act)}
    kinds = {_SAME_FUNCTION[name] for name in names if name in _SAME_FUNCTION}
    return kinds.pop() if len(kinds) == 1 else None


def activation_label(module: nn.Module) -> str:
    act = activation_module(module)
    return type(act).__name__ if act is not None else "no activation module"


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


def target_routes(ffn: FFN, roles: dict[str, str], sources: dict[str, str]) -> list[TensorRoute]:
    """parity.ffn's parameters filled from the checkpoint's tensors: an nn.Linear weight as stored, a Conv1D one
    transposed, a fused [gate; up] in halves.  A bias the checkpoint lacks is no route (parity zeroes it, saying so)."""
    routes = []
    for proj in (*ffn.ins, ffn.out):
        role = roles.get(proj.name)
        if role is None:
            continue
        parts = [("gate", (0, 2)), ("up", (1, 2))] if role == "gate_up" else [(role, None)]
        transform = "transpose" if proj.layout == "in_out" else "none"
        for part, chunk in parts:
            routes.append(TensorRoute(f"{ROLE_TARGETS[part]}.weight", sources[f"{proj.name}.weight"], transform, chunk))
            if proj.bias:
                routes.append(TensorRoute(f"{ROLE_TARGETS[part]}.bias", sources[f"{proj.name}.bias"], "none", chunk))
    return routes


def repository_gap(ffn: FFN, d: int, unsaid: str | None) -> str | None:
    """What parity.ffn's modules lack to express this FFN (None: one does)."""
    act, label = activation_of(ffn.module), activation_label(ffn.module)
    projected = {f"{p.name}.{leaf}" for p in (*ffn.ins, ffn.out) for leaf in ("weight", "bias")}
    others = [name for name, _ in ffn.module.named_parameters() if name not in projected] if not ffn.inline else []
    if others:
        return f"it holds parameters besides its projections ({', '.join(others[:3])})"
    if unsaid:
        return unsaid
    if len(ffn.ins) == 2 or ffn.fused:
        return None if act in GATED else (f"it is a gated FFN running {label}, and parity.ffn's gated modules run "
                                           "SiLU (SwiGLU) or tanh GELU (GeGLU)")
    if act not in CLASSIC:
        return f"it runs {label}, and parity.ffn.FeedForward runs ReLU, exact GELU or tanh GELU"
    if ffn.width != 4 * d:
        return f"its d_ff is {ffn.width}, and parity.ffn.FeedForward's d_ff is always 4·d ({4 * d})"
    return None


def default_target(ffn: FFN, d: int, sources: dict[str, str]) -> tuple[str, dict[str, Any], list[TensorRoute]]:
    """[target].class, [target].args and [tensors] for the repository module that expresses this FFN; where none
    does, a target that refuses in one line when built (exit 2), and the same routes for ``--target``."""
    roles, unsaid = projection_roles(ffn)
    routes = target_routes(ffn, roles, sources)
    gap = repository_gap(ffn, d, unsaid)
    bias = any(p.bias for p in (*ffn.ins, ffn.out))
    gated = len(ffn.ins) == 2 or ffn.fused
    args: dict[str, Any] = {"emb_size": d, "hidden_dim": ffn.width, "bias": bias, "dropout": 0.0} if gated else \
        {"emb_size": d, "activation": activation_of(ffn.module) or "relu", "dropout": 0.0}
    if gap is not None:
        return refusing_target(type(ffn.module).__name__ if not ffn.inline else "+".join(ffn.inline), gap), args, \
            routes
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

    found = [find_experts(decoder.layers[i], decoder.d) for i in moe]
    first = found[0]
    if first is None or any(f is None or (f.path, type(f.module), f.count, f.width) !=
                            (first.path, type(first.module), first.count, first.width) for f in found):
        raise refused(decoder.model_type, f"transformers' {type(decoder.layers[moe[0]]).__name__} holds experts that "
                      "are not one fused module (gate_up_proj and down_proj stacked over experts) of the same shape "
                      "in every layer with experts", "with an [experts] table ")
    module_path = decoder.module_path(first.path)
    layer_key, experts = expert_layout(decoder.model, decoder.ckpt, module_path, first, tuple(moe[:2]),
                                       lambda why, what="": refused(decoder.model_type, why, what))
    shown_class = type(first.module).__name__
    target = GATED.get(activation_of(first.module)) or refusing_target(shown_class, experts_gap(first))
    tensors = [dataclasses.replace(route, target=f"{ROLE_TARGETS[role.removesuffix('_bias')]}."
                                                 f"{'bias' if role.endswith('_bias') else 'weight'}")
               for role, route in ((r.target, r) for r in experts.routes)]
    name = f"derived from transformers {transformers.__version__} {shown_class} at {module_path}"
    where = "" if decoder.layers_note(moe) is None else f" (layers {spans(moe)})"
    routed = Mapping(
        name=name, path=Path(name), model_types=[decoder.model_type], layer_key=layer_key,
        reference_module=module_path, target_class=target, tensors=tensors, num_layers=len(decoder.layers),
        target_args={"emb_size": decoder.d, "hidden_dim": first.width, "bias": first.biased, "dropout": 0.0},
        hidden_size=decoder.d, experts=experts, derived=True, layers=decoder.layers_note(moe),
        description=f"{decoder.model_type}: {first.count} experts per layer{where}, layout derived from "
                    f"transformers' {shown_class}")
    shared = shared_path(decoder.layers[moe[0]], first, decoder.d)
    if shared is None:
        return [routed]
    layers = [decoder.layers[i] for i in moe]
    ffn = uniform_ffn(layers, moe, decoder.d, decoder.model_type, find=lambda layer, d: ffn_at(layer, shared, d))
    return [routed, dense_mapping(decoder, moe, ffn, unit=shared.rsplit(".", 1)[-1])]


def experts_gap(experts: ExpertsModule) -> str:
    """What parity.ffn's gated modules lack to express these experts."""
    if activation_module(experts.module) is None:
        return ("its experts compute their gated activation in their own code (no activation module: "
                f"{', '.join(n for n in ('alpha', 'limit') if hasattr(experts.module, n)) or 'its own formula'}), "
                "and parity.ffn's gated modules run SiLU (SwiGLU) or tanh GELU (GeGLU) on the gate alone")
    return (f"its experts are gated FFNs running {activation_label(experts.module)}, and parity.ffn's gated modules "
            "run SiLU (SwiGLU) or tanh GELU (GeGLU)")


def shared_path(layer: nn.Module, experts: ExpertsModule, d: int) -> str | None:
    """The path (relative to the layer) of a dense FFN beside the layer's experts: a shared expert; the outermost
    where one holds another."""
    found = [path for path, module in layer.named_modules()
             if path and not path.startswith(experts.path) and ffn_of(projections(module), d)
             and activation_module(module) is not None]
    outer = [path for path in found if not any(path.startswith(other + ".") for other in found)]
    return outer[0] if len(outer) == 1 else None


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
