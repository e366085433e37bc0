"""The model of a mapping file: routes, the mapping, its experts and the values it reads off a config.

A mapping is plain TOML (``mappings/*.toml``; docs/own-module.md): per-family data that routes checkpoint
tensors into a target module.  ``mapping_parser`` reads and validates a file into these records,
``toml_text`` writes them back, ``registry`` holds the built-in ones.  No torch here: ``parity list`` stays
instant.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parity.definitions.datafiles import builtin_mapping_dir
from parity.errors import MappingError

TRANSFORMS = ("none", "transpose")


@dataclass(frozen=True)
class TensorRoute:
    """Fill one target parameter from one checkpoint tensor (name relative to the layer)."""

    target: str
    source: str
    transform: str = "none"
    chunk: tuple[int, int] | None = None  # (index, count) along dim 0, for fused tensors
    optional: bool = False  # skipped when the target has no such parameter (e.g. biases off)
    zeros: bool = False  # `param = { zeros = true }`: no checkpoint tensor; parity fills zeros and says so
    interleaved: bool = False  # the chunk is every count-th row from index (GPT-OSS's gate/up), not a block

    @property
    def reads(self) -> bool:
        """Whether this route reads a checkpoint tensor (a declared-zeros route reads none)."""
        return not self.zeros


@dataclass
class Mapping:
    name: str
    path: Path
    model_types: list[str]
    layer_key: str
    reference_module: str
    target_class: str
    target_args: dict[str, Any]
    tensors: list[TensorRoute]
    num_layers: Any
    hidden_size: Any
    description: str = ""
    default_checkpoint: str | None = None
    key_prefixes: list[str] = field(default_factory=lambda: [""])
    notes: list[str] = field(default_factory=list)
    synthetic_config: dict[str, Any] | None = None
    # reference parameter (HF name, relative to the MLP) -> checkpoint tensor; empty: the same name
    reference_tensors: list[TensorRoute] = field(default_factory=list)
    experts: Experts | None = None  # MoE: each expert's FFN is checked on its own
    text: str = field(default="", repr=False, compare=False)  # the file's text, for line numbers in later errors
    derived: bool = False  # no file: derived from transformers' own model (engine.layout.derive); ``name`` says so
    # a model whose layers are not all alike (dense layers before MoE ones, a shared expert beside the routed ones):
    # the layers this layout serves (None: every one), the unit's name in reports where it is not the layer or a
    # routed expert ('shared_expert'), and the checkpoint's further layouts, each checked as its own units
    layers: tuple[int, ...] | None = None
    unit: str | None = None
    parts: list[Mapping] = field(default_factory=list)
    width: int | None = None  # a derived unit's d_ff (an expert's, a shared expert's), which the config need not say

    def where(self, key: str) -> str:
        """'FILE:LINE' of a key, for errors found only once the target or reference exists."""
        line = line_of(self.text, key) if self.text else None
        return f"{self.path}:{line}" if line is not None else str(self.path)

    def layer_prefix(self, layer: int, expert: int | None = None) -> str:
        return self.layer_key.format(layer=layer, expert=0 if expert is None else expert)

    def reference_path(self, layer: int) -> str:
        return self.reference_module.format(layer=layer)

    def serves(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers

    @property
    def first_layer(self) -> int:
        """The first layer this layout serves: where its module and tensors are looked at once for all."""
        return self.layers[0] if self.layers else 0


@dataclass(frozen=True)
class Experts:
    """[experts]: how many experts a layer has and where one expert's gate/up/down projections are.

    ``stacked`` names checkpoint tensors holding every expert along dim 0 (transformers' fused
    layout, GGUF's ``ffn_*_exps``); one expert's slice is taken from them on read.  ``transposed``: each
    expert's slice is stored [in, out] (a module computing ``x @ W``, Llama 4's), read as nn.Linear's [out, in].
    ``flat``: the stacked tensors hold every expert's rows one after another ([E·ff, d], DBRX's), not along a
    dim of their own; one expert's slice is then its ff rows.
    """

    count: Any
    gate: TensorRoute | None  # None: experts without a gate, down(act(up(x))) (NemotronH's; derived only)
    up: TensorRoute
    down: TensorRoute
    stacked: tuple[str, ...] = ()
    transposed: bool = False
    biases: tuple[TensorRoute, ...] = ()  # gate_bias, up_bias, down_bias: each expert's biases, where it has them
    flat: bool = False

    @property
    def routes(self) -> list[TensorRoute]:
        """What one expert reads: its gate, up and down projections, then its biases."""
        return [route for route in (self.gate, self.up, self.down, *self.biases) if route is not None]


def route_spelling(route: TensorRoute) -> str | dict[str, Any]:
    """A route as a mapping file writes it: "name", {from = ..., transform = ..., chunk = ..., optional = ...}, or
    {zeros = true}."""
    if route.zeros:
        return {"zeros": True}
    spelled: dict[str, Any] = {"from": route.source}
    if route.transform != "none":
        spelled["transform"] = route.transform
    if route.chunk is not None:
        spelled["chunk"] = list(route.chunk)
    if route.interleaved:
        spelled["interleaved"] = True
    if route.optional:
        spelled["optional"] = True
    return route.source if len(spelled) == 1 else spelled


def route_arrows(tensors: dict[str, Any]) -> str:
    """Routes as spelled (``route_spelling``) in one line: 'param ← tensor' ('.T': transposed).  Optional routes
    (biases a checkpoint may lack) are left out: the JSON has them."""
    parts = []
    for target, spelled in tensors.items():
        if isinstance(spelled, str):
            parts.append(f"{target} ← {spelled}")
        elif spelled.get("zeros"):
            parts.append(f"{target} ← zeros")
        elif not spelled.get("optional"):
            chunk = f"[chunk {spelled['chunk'][0]}/{spelled['chunk'][1]}]" if spelled.get("chunk") else ""
            chunk = f"[rows {spelled['chunk'][0]}::{spelled['chunk'][1]}]" if spelled.get("interleaved") else chunk
            flip = ".T" if spelled.get("transform") == "transpose" else ""
            parts.append(f"{target} ← {spelled['from']}{chunk}{flip}")
    return ", ".join(parts)


def route_key(table: str, name: str) -> str:
    """The dotted key of one route, as line_of and the error messages write it."""
    return f'{table}."{name}"'


def unknown_route_names(mapping: Mapping, table: str, names: list[str], have: list[str], whose: str) -> str:
    """The message for routes (``names``, keys of ``table``) to parameters the module lacks: each
    with its line and the closest existing name, then the names that do exist."""
    parts = []
    for name in names:
        close = difflib.get_close_matches(name, have, n=1, cutoff=0.6)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        parts.append(f"{mapping.where(route_key(table, name))}: key '{route_key(table, name)}': "
                     f"{whose} has no parameter '{name}'{hint}")
    return "; ".join(parts) + f". Its parameters are: {', '.join(have) or '(none)'}"


def check_reference_routes(mapping: Mapping, reference_names: Iterable[str]) -> None:
    """Every key of [reference.tensors] must be a parameter of transformers' MLP (``reference_names``,
    relative to reference.module).  The reference is filled by its own parameter names, so a route
    to a name it lacks would be ignored and the checkpoint tensor of the same name used instead."""
    have = list(reference_names)
    missing = [route.target for route in mapping.reference_tensors if route.target not in have]
    if missing:
        raise MappingError(
            unknown_route_names(mapping, "reference.tensors", missing, have,
                                f"transformers' MLP at '{mapping.reference_module}'")
            + ". Write these names (transformers' own) on the left of [reference.tensors] and the checkpoint's "
              "tensor names on the right."
        )


def _attribute_path(attr: Any) -> bool:
    """A config attribute as mappings name it: dotted identifiers, none private ("rope_scaling.factor")."""
    return isinstance(attr, str) and all(part.isidentifier() and not part.startswith("_") for part in attr.split("."))

NONE = {"none": True}  # a mapping's spelling of Python's None: ffn_dim_multiplier = { none = true }


class ConfigValue:
    """Evaluates mapping values: "config.n_embd", {config = "mlp_bias", default = false}, "config",
    { none = true } (None), or literals."""

    def __init__(self, config: Any, path: Path):
        self.config = config
        self.path = path

    def __call__(self, value: Any, key: str) -> Any:
        if value == NONE:  # TOML has no null
            return None
        if isinstance(value, str) and (value == "config" or value.startswith("config.")):
            if value == "config":
                return self.config
            return self._lookup(value[len("config."):], key, required=True)
        if isinstance(value, dict) and set(value) <= {"config", "default"} and "config" in value:
            return self._lookup(value["config"], key, required="default" not in value, default=value.get("default"))
        return value

    def _lookup(self, attr: str, key: str, required: bool, default: Any = None) -> Any:
        if not _attribute_path(attr):
            raise MappingError(f"{self.path}: key '{key}': {attr!r:.80} is not a config attribute (dotted names, "
                               "none starting with '_'), e.g. \"config.hidden_size\" or { config = \"mlp_bias\" }")
        value = self.config
        for part in attr.split("."):
            if isinstance(value, dict):
                value = value.get(part, _MISSING)
            else:
                value = getattr(value, part, _MISSING)
            if value is _MISSING:
                if required:
                    raise MappingError(f"{self.path}: key '{key}': the checkpoint's config has no '{attr}'")
                return default
        return default if value is None and not required else value

_MISSING = object()


def _key_parts(key: str) -> list[str]:
    return [part.strip('"') for part in re.findall(r'"[^"]*"|[^.]+', key)]


def line_of(text: str, key: str) -> int | None:
    """The line (1-based) where a dotted key is written, or its nearest written parent; None if unknown.

    tomllib gives line numbers only for syntax errors; a validation error names a key, and a
    user needs the line to find it.  Handles [tables], inline tables and quoted keys.
    """
    parts = _key_parts(key)
    while parts:
        *tables, leaf = parts
        current: list[str] = []
        for number, line in enumerate(text.splitlines(), 1):
            header = re.match(r"\s*\[+([^\]]+)\]+", line)
            if header:
                current = _key_parts(header.group(1).strip())
                if current == parts:
                    return number
                continue
            code = line.split("#", 1)[0]
            if current == tables and _assigns(code, leaf, anywhere=True):
                return number
            if (len(tables) == len(current) + 1 and current == tables[:-1] and _assigns(code, tables[-1])
                    and _assigns(code, leaf, anywhere=True)):  # leaf inside an inline table
                return number
        parts = parts[:-1]
    return None


def _assigns(code: str, key: str, anywhere: bool = False) -> bool:
    """Whether this line of TOML assigns ``key`` (at its start, or anywhere, as in inline tables)."""
    lead = r"(^|[{,\s])" if anywhere else r"^\s*"
    return re.search(lead + r'("' + re.escape(key) + r'"|' + re.escape(key) + r")\s*=", code) is not None


def is_builtin(mapping: Mapping) -> bool:
    """Whether this is one of parity's own mappings (a file of the built-in folder, or one derived from transformers;
    not one the user wrote)."""
    return mapping.derived or mapping.path.resolve().parent == builtin_mapping_dir().resolve()
