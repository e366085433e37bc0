"""A mixture-of-experts layer's layout derived from transformers itself: where each expert's tensors are.

transformers 5 keeps a layer's experts fused in one module (``MixtralExperts``, ``Qwen3MoeExperts``, ...): two
parameters stacked over the E experts, ``gate_up_proj`` ([E, 2·ff, d], or [E, d, 2·ff] where the module computes
``x @ W``) and ``down_proj``.  What a checkpoint stores is often something else: one tensor per expert and
projection (``mlp.experts.{e}.gate_proj.weight``, Mixtral's ``block_sparse_moe.experts.{e}.w1.weight``), which
transformers' load-time conversion (``WeightConverter``: ``MergeModulelist`` stacks the experts, ``Concatenate``
puts gate before up) turns into the fused parameters; or the fused tensors themselves under another name (Granite
MoE's ``input_linear``), which a ``WeightRenaming`` renames.  Both are read here from that conversion: which
checkpoint tensor, in which order of the concatenation, fills which parameter; nothing is guessed from names.

The result is the ``[experts]`` table a mapping file would hold (parity.definitions.mapping.Experts): each expert
is then checked on its own against transformers' experts module holding that expert (parity.engine.experts).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from torch import nn

from parity.definitions.mapping import Experts, TensorRoute
from parity.engine.layout.renaming import Renamed

FUSED = ("gate_up_proj", "down_proj")  # transformers 5's fused experts module: its two stacked parameters
UNGATED = ("up_proj", "down_proj")  # ... and where its experts have no gate (has_gate False: NemotronH's)
BIASES = ("gate_up_proj_bias", "down_proj_bias")  # and their biases, where it has them (GPT-OSS)


@dataclass(frozen=True)
class ExpertsModule:
    """A layer's fused experts module as transformers builds it: ``path`` relative to the layer."""

    path: str
    module: nn.Module
    count: int
    width: int  # one expert's d_ff
    transposed: bool  # stored [E, in, out] (x @ W), not nn.Linear's [E, out, in]

    @property
    def interleaved(self) -> bool:
        """gate and up alternate along gate_up_proj's output rows (transformers' decorator: is_concatenated)."""
        return getattr(self.module, "is_concatenated", True) is False

    @property
    def biased(self) -> bool:
        return isinstance(getattr(self.module, "gate_up_proj_bias", None), nn.Parameter)

    @property
    def gated(self) -> bool:
        """Its experts have a gate (gate_up_proj); an ungated one's are down(act(up(x))): has_gate False."""
        return hasattr(self.module, "gate_up_proj")

    @property
    def stacks(self) -> tuple[str, str]:
        return FUSED if self.gated else UNGATED


def experts_transposed(module: nn.Module, d: int) -> bool | None:
    """Whether the module's ``gate_up_proj`` is [E, d, 2·ff] (x @ W): what transformers' experts decorator says
    (``is_transposed``), else read off the shape against d; None where the shape cannot tell (2·ff = d)."""
    said = getattr(module, "is_transposed", None)
    if isinstance(said, bool):
        return said
    _, rows, cols = (module.gate_up_proj if hasattr(module, "gate_up_proj") else module.up_proj).shape
    if (rows == d) == (cols == d):
        return None
    return rows == d


def find_experts(layer: nn.Module, d: int) -> ExpertsModule | None:
    """The layer's fused experts module: one holding ``gate_up_proj`` and ``down_proj`` stacked over experts (or
    ``up_proj`` and ``down_proj``, where transformers' decorator says its experts have no gate: has_gate False)."""
    for path, module in layer.named_modules():
        params = dict(module.named_parameters(recurse=False))
        names = UNGATED if getattr(module, "has_gate", True) is False else FUSED
        if all(name in params and params[name].dim() == 3 for name in names):
            transposed = experts_transposed(module, d)
            if transposed is None:
                return None
            down = params["down_proj"].shape
            width = int(down[1] if transposed else down[2])
            return ExpertsModule(path, module, int(down[0]), width, transposed)
    return None


def expert_layout(renamed: Renamed, experts_path: str, experts: ExpertsModule,
                  layers: tuple[int, ...], refuse: Any) -> tuple[str, Experts]:
    """(layer_key, [experts]) for the checkpoint: per-expert tensors that transformers' conversion merges, or the
    fused tensors themselves.  ``experts_path``: the module's path with '{layer}'; ``layers``: the first one or
    two layers with experts, read to tell the layer number in the names; ``refuse(why, what)`` makes the exit-2
    error; ``renamed``: the checkpoint's keys as transformers' load-time conversion names them."""
    found: dict[int, dict[str, list[tuple[str, str | None]]]] = defaultdict(lambda: defaultdict(list))
    for key, (own, pattern) in renamed.keys.items():
        for layer in layers:
            prefix = experts_path.format(layer=layer) + "."
            if own.startswith(prefix) and own[len(prefix):] in experts.stacks + BIASES:
                found[layer][own[len(prefix):]].append((key, pattern))
    lacking = [name for layer in layers for name in experts.stacks if not found[layer].get(name)]
    switch = _switch_mlp(renamed, experts_path, experts, layers, refuse) if lacking else None
    if switch is not None:
        return switch
    if lacking:
        raise refuse(f"transformers' {type(experts.module).__name__} needs '{experts_path.format(layer=layers[0])}."
                     f"{lacking[0]}' (or the tensors transformers' load-time conversion merges into it), which this "
                     "checkpoint does not hold", "for its names ")
    interleaving = interleaved_on_disk(renamed.converters, experts)
    per_expert = any(pattern is not None and pattern not in interleaving
                     for keys in found[layers[0]].values() for _, pattern in keys)
    if per_expert and any(found[layers[0]].get(name) for name in BIASES):
        raise refuse(f"transformers' {type(experts.module).__name__} has biased experts that this checkpoint keeps "
                     "per expert, and reading per-expert biases is not built yet", "with an [experts] table ")
    if per_expert:
        return _per_expert(found, renamed.converters, experts, layers, refuse)
    on_disk = any(pattern in interleaving for keys in found[layers[0]].values() for _, pattern in keys)
    return _fused(found, experts, layers, refuse, interleaved=on_disk)


def interleaved_on_disk(converters: list, experts: ExpertsModule) -> set[str]:
    """The source patterns of converters that turn one fused tensor whose gate and up rows alternate (gate first)
    into the module's [gate; up] halves: transformers' ``Interleave`` along gate_up_proj's output dim (Inkling 2's
    ``w13_weight``).  Each expert's gate and up are then that tensor's alternate rows, as GPT-OSS's module holds
    them."""
    from transformers.core_model_loading import Interleave

    dim = 2 if experts.transposed else 1
    return {pattern for c in converters for pattern in c.source_patterns
            if len(c.source_patterns) == 1 and len(c.operations) == 1 and isinstance(c.operations[0], Interleave)
            and c.operations[0].dim == dim and not c.operations[0].inverse and not experts.interleaved
            and any(str(t).endswith("gate_up_proj") for t in c.target_patterns)}


SWITCH_MLP = ("gate_proj", "up_proj", "down_proj")  # MLX-LM's SwitchGLU: each role stacked [E, out, in]


def _switch_mlp(renamed: Renamed, experts_path: str, experts: ExpertsModule, layers: tuple[int, ...],
                refuse: Any) -> tuple[str, Experts] | None:
    """MLX-LM's layout (what its models' ``sanitize`` and mlx_lm.convert write): each role's experts stacked in one
    tensor beside the experts module, ``switch_mlp.{gate_proj,up_proj,down_proj}.weight`` [E, out, in] (SwitchGLU
    computes x @ W.T per expert), under the names transformers' renaming gives the block (Mixtral's
    block_sparse_moe is its mlp).  None where the checkpoint does not hold them."""
    if not experts.gated or experts.biased:
        return None
    stems = {}
    for layer in layers:
        block = experts_path.format(layer=layer).rsplit(".", 1)[0]
        wanted = {f"{block}.switch_mlp.{role}.weight": role for role in SWITCH_MLP}
        held = {wanted[own]: key for key, (own, _) in renamed.keys.items() if own in wanted}
        if len(held) != len(SWITCH_MLP):
            return None
        stems[layer] = held["gate_proj"].removesuffix(".gate_proj.weight")
    leaves = [f"{role}.weight" for role in SWITCH_MLP]
    routes = [TensorRoute(role.removesuffix("_proj"), leaf) for role, leaf in zip(SWITCH_MLP, leaves, strict=True)]
    return _layer_key(stems, layers, refuse), Experts(experts.count, *routes, stacked=tuple(leaves))


def _varying(keys: list[str], label: str, refuse: Any) -> int:
    """The index of the one dotted part in which ``keys`` differ, a number in each (the layer or the expert);
    ``refuse`` where they differ in more or less than one place."""
    parts = [key.split(".") for key in keys]
    varying = [i for i in range(len(parts[0])) if len({p[i] if len(p) > i else None for p in parts}) > 1]
    if len({len(p) for p in parts}) != 1 or len(varying) != 1 or not all(p[varying[0]].isdigit() for p in parts):
        raise refuse(f"the checkpoint's expert tensors ({', '.join(keys[:2])}) differ in more or less than the "
                     f"{label} number", "for its names ")
    return varying[0]


def _with(key: str, index: int, label: str) -> str:
    parts = key.split(".")
    parts[index] = "{" + label + "}"
    return ".".join(parts)


def _layer_key(stems: dict[int, str], layers: tuple[int, ...], refuse: Any) -> str:
    """The layer's stem of its expert tensors with '{layer}' where two layers differ (one layer: the number of
    the stem that is the layer's)."""
    first = stems[layers[0]]
    if len(layers) > 1:
        return _with(first, _varying([first, stems[layers[1]]], "layer", refuse), "layer")
    return _with(first, first.split(".").index(str(layers[0])), "layer")


def _per_expert(found: dict, converters: list, experts: ExpertsModule, layers: tuple[int, ...], refuse: Any
                ) -> tuple[str, Experts]:
    """One tensor per expert and projection, merged by transformers (MergeModulelist, then Concatenate for gate_up
    in the converter's source order: gate first, as the fused module computes ``gate, up = ... .chunk(2)``)."""
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    stems: dict[int, str] = {}
    leaves: dict[str, str] = {}
    for layer, params in found.items():
        for param, keys in params.items():
            converter = by_pattern.get(keys[0][1])
            operations = [type(op).__name__ for op in converter.operations] if converter else []
            wanted = ["MergeModulelist", "Concatenate"] if param == "gate_up_proj" else ["MergeModulelist"]
            joined = getattr(converter.operations[-1], "dim", None) if converter else None
            if operations != wanted or wanted[-1] == "Concatenate" and joined != (2 if experts.transposed else 1):
                raise refuse(f"transformers fills '{param}' of {type(experts.module).__name__} with "
                             f"{' + '.join(operations) or 'no conversion'} (dim {joined}), and parity reads per-expert "
                             f"tensors merged with {' + '.join(wanted)} along the output dim", "for its names ")
            stacked = stack_count(experts, param)
            for pattern in converter.source_patterns:
                names = sorted(key for key, p in keys if p == pattern)
                if len(names) != stacked:
                    raise refuse(f"the checkpoint holds {len(names)} tensors matching '{pattern}' in layer {layer}, "
                                 f"and transformers' module stacks {stacked} in '{param}'", "for its names ")
                at = _varying(names, "expert", refuse)
                stem = ".".join(_with(names[0], at, "expert").split(".")[:at + 1])
                if stems.setdefault(layer, stem) != stem:
                    raise refuse(f"the checkpoint keeps an expert's projections under two stems ({stems[layer]}, "
                                 f"{stem})", "for its names ")
                role = ("gate", "up")[converter.source_patterns.index(pattern)] if param == "gate_up_proj" else \
                    param.removesuffix("_proj")  # up, down
                leaves.setdefault(role, ".".join(names[0].split(".")[at + 1:]))
    routes = {role: TensorRoute(role, leaf) for role, leaf in leaves.items()}
    return _layer_key(stems, layers, refuse), Experts(experts.count, routes.get("gate"), routes["up"], routes["down"])


def _fused(found: dict, experts: ExpertsModule, layers: tuple[int, ...], refuse: Any, *, interleaved: bool = False
           ) -> tuple[str, Experts]:
    """The fused tensors stored as such (transformers renames them at most): each expert a slice of them, gate
    and up the halves of gate_up's rows (``interleaved``: its alternate rows, as stored on disk), read in
    nn.Linear's [out, in] (``transposed``: stored [in, out])."""
    stems, leaves = {}, {}
    for layer, params in found.items():
        keys = [keys[0][0] for keys in params.values()]
        parts = [key.split(".") for key in keys]
        common = 0
        while all(len(p) > common + 1 and p[common] == parts[0][common] for p in parts):
            common += 1
        stems[layer] = ".".join(parts[0][:common])
        for param, keys in params.items():
            leaves.setdefault(param, keys[0][0][len(stems[layer]) + 1:])
    gate_up, down = leaves[experts.stacks[0]], leaves["down_proj"]
    biases = ()
    if experts.biased:
        missing = [name for name in BIASES if name not in leaves]
        if missing:
            raise refuse(f"transformers' {type(experts.module).__name__} needs '{missing[0]}', which this checkpoint "
                         "does not hold beside its experts", "for its names ")
        biases = (*gate_and_up(leaves["gate_up_proj_bias"], experts, "_bias"),
                  TensorRoute("down_bias", leaves["down_proj_bias"]))
    gate_up_routes = gate_and_up(gate_up, experts, alternate=interleaved) if experts.gated else \
        (None, TensorRoute("up", gate_up))
    layout = Experts(experts.count, *gate_up_routes, TensorRoute("down", down),
                     stacked=tuple(leaves.values()), transposed=experts.transposed, biases=biases)
    return _layer_key(stems, layers, refuse), layout


def stack_count(experts: ExpertsModule, param: str) -> int:
    """How many slices the module stacks in ``param``: its experts, or more where the module computes the experts
    past down_proj's count as the identity (LongCat-Flash's zero-computation experts: gate_up_proj holds E + Z
    slices, down_proj E, and only the first E are FFNs, the experts checked)."""
    stack = getattr(experts.module, param, None)
    return int(stack.shape[0]) if isinstance(stack, nn.Parameter) else experts.count


def gate_and_up(fused: str, experts: ExpertsModule, suffix: str = "", alternate: bool = False
                ) -> tuple[TensorRoute, TensorRoute]:
    """The gate and up routes out of one fused tensor: its halves, or its alternate rows where transformers'
    module interleaves them (``is_concatenated`` False: gate = rows 0::2, up = rows 1::2) or the tensor on disk
    does (``alternate``)."""
    return tuple(TensorRoute(role + suffix, fused, chunk=(i, 2), interleaved=experts.interleaved or alternate)
                 for i, role in enumerate(("gate", "up")))
