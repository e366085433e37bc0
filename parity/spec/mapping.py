"""Mapping files: per-family data that routes checkpoint tensors into a target module.

A mapping is plain TOML (see ``mappings/*.toml`` and the README).  This module only
reads and validates it; it imports neither torch nor transformers so that ``parity
list`` stays instant.
"""

from __future__ import annotations

import difflib
import functools
import json
import re
import string
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parity.errors import MappingError
from parity.spec.datafiles import NOT_MAPPINGS, builtin_mapping_dir
from parity.spec.files import not_regular, read_text, shown

TRANSFORMS = ("none", "transpose")

_TOP_KEYS = {"name", "description", "model_types", "default_checkpoint", "num_layers", "hidden_size",
             "notes", "checkpoint", "reference", "target", "tensors", "synthetic", "experts"}
_CHECKPOINT_KEYS = {"layer_key", "key_prefixes"}
_REFERENCE_KEYS = {"module", "tensors"}
_TARGET_KEYS = {"class", "args"}
_TENSOR_KEYS = {"from", "transform", "chunk", "optional"}
_SYNTHETIC_KEYS = {"config"}
_EXPERT_KEYS = {"count", "stacked", "gate", "up", "down"}


@dataclass(frozen=True)
class TensorRoute:
    """Fill one target parameter from one checkpoint tensor (name relative to the layer)."""

    target: str
    source: str
    transform: str = "none"
    chunk: tuple[int, int] | None = None  # (index, count) along dim 0, for fused tensors
    optional: bool = False  # skipped when the target has no such parameter (e.g. biases off)


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

    def where(self, key: str) -> str:
        """'FILE:LINE' of a key, for errors found only once the target or reference exists."""
        line = line_of(self.text, key) if self.text else None
        return f"{self.path}:{line}" if line is not None else str(self.path)

    def layer_prefix(self, layer: int, expert: int | None = None) -> str:
        return self.layer_key.format(layer=layer, expert=0 if expert is None else expert)

    def reference_path(self, layer: int) -> str:
        return self.reference_module.format(layer=layer)


@dataclass(frozen=True)
class Experts:
    """[experts]: how many experts a layer has and where one expert's gate/up/down projections are.

    ``stacked`` names checkpoint tensors holding every expert along dim 0 (transformers' fused
    layout, GGUF's ``ffn_*_exps``); one expert's slice is taken from them on read.
    """

    count: Any
    gate: TensorRoute
    up: TensorRoute
    down: TensorRoute
    stacked: tuple[str, ...] = ()


def _fail(path: Path, key: str, what: str) -> MappingError:
    error = MappingError(f"{path}: key '{key}': {what}")
    error.key = key  # load_mapping adds the line it is on
    return error


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


def _check_keys(path: Path, table: dict, allowed: set[str], where: str) -> None:
    for key in table:
        if key not in allowed:
            raise _fail(path, f"{where}{key}", f"unknown key; expected one of {sorted(allowed)}")


def _require(path: Path, table: dict, key: str, kind: type, where: str = "") -> Any:
    if key not in table:
        raise _fail(path, f"{where}{key}", "is required")
    value = table[key]
    if not isinstance(value, kind):
        raise _fail(path, f"{where}{key}", f"expected {kind.__name__}, got {type(value).__name__}")
    return value


def _parse_route(path: Path, target: str, spec: Any, table: str = "tensors") -> TensorRoute:
    where = f"{table}.\"{target}\""
    source = spec.get("from") if isinstance(spec, dict) else spec
    if isinstance(source, str) and source.strip() in ("?", ""):
        raise _fail(path, where, f"is still the placeholder {source!r}: write the checkpoint tensor (relative to the "
                                 "layer, e.g. \"up_proj.weight\") that fills this parameter; the comments beside the "
                                 "printed mapping list each tensor's shape and role")
    if isinstance(spec, str):
        return TensorRoute(target, spec)
    if not isinstance(spec, dict):
        raise _fail(path, where, "expected a tensor name or a table {from = ..., transform = ...}")
    _check_keys(path, spec, _TENSOR_KEYS, where + ".")
    source = _require(path, spec, "from", str, where + ".")
    transform = spec.get("transform", "none")
    if transform not in TRANSFORMS:
        raise _fail(path, where + ".transform", f"unknown transform {transform!r}; expected one of {list(TRANSFORMS)}")
    chunk = spec.get("chunk")
    if chunk is not None:
        if (not isinstance(chunk, list) or len(chunk) != 2 or not all(isinstance(c, int) for c in chunk)
                or not 0 <= chunk[0] < chunk[1]):
            raise _fail(path, where + ".chunk", "expected [index, count] with 0 <= index < count")
        chunk = (chunk[0], chunk[1])
    optional = spec.get("optional", False)
    if not isinstance(optional, bool):
        raise _fail(path, where + ".optional", "expected true or false")
    return TensorRoute(target, source, transform, chunk, optional)


def _check_template(path: Path, key: str, template: str, placeholders: tuple[str, ...] = ("layer",)) -> None:
    """Only plain placeholders: ``{layer[0]}``, ``{layer.real}``, ``{layer!r}`` or ``{layer:>1000000000}`` would
    index, reach into, or pad (to a gigabyte) the number instead of naming a layer."""
    allowed = " and ".join("{" + name + "}" for name in placeholders)
    try:
        fields = [(f, spec, conv) for _, f, spec, conv in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        raise _fail(path, key, f"not a valid template ({exc}); the placeholders are {allowed}") from None
    for name, spec, conversion in fields:
        if name not in placeholders or spec or conversion:
            written = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
            raise _fail(path, key, f"placeholder {written!r} is not allowed; write plain {allowed} "
                                   "(no index, attribute, conversion or format spec)")


def parse_mapping(text: str, path: Path) -> Mapping:
    """Validate a mapping file's text; every error names the file and the key."""
    try:
        data = tomllib.loads(text)
    except ValueError as exc:  # TOMLDecodeError, or an integer of more than 4300 digits
        raise MappingError(f"{path}: invalid TOML: {exc}") from None
    except RecursionError:
        raise MappingError(f"{path}: invalid TOML: arrays or tables nested too deeply to read") from None
    _check_keys(path, data, _TOP_KEYS, "")
    name = _require(path, data, "name", str)
    model_types = _require(path, data, "model_types", list)
    if not all(isinstance(m, str) for m in model_types):
        raise _fail(path, "model_types", "expected a list of strings")
    layer_key, prefixes = _parse_checkpoint(path, _require(path, data, "checkpoint", dict))
    module, reference_routes = _parse_reference(path, _require(path, data, "reference", dict))
    target_class, args = _parse_target(path, _require(path, data, "target", dict))
    tensors = _require(path, data, "tensors", dict)
    if not tensors:
        raise _fail(path, "tensors", "must route at least one tensor")
    routes = [_parse_route(path, t, spec) for t, spec in tensors.items()]
    experts = _parse_experts(path, data["experts"]) if "experts" in data else None
    if experts is None and "{expert}" in layer_key:
        raise _fail(path, "checkpoint.layer_key", "uses {expert} but the mapping has no [experts] table")
    if experts is not None and reference_routes:
        raise _fail(path, "reference.tensors", "is not used by a mapping with [experts]: the reference gets each "
                                               "expert's tensors from [experts] gate/up/down; remove it")
    _check_plain_values(path, data)
    return Mapping(
        name=name, path=path, model_types=model_types, layer_key=layer_key, reference_module=module,
        target_class=target_class, target_args=args, tensors=routes,
        num_layers=data.get("num_layers", "config.num_hidden_layers"),
        hidden_size=data.get("hidden_size", "config.hidden_size"),
        description=data.get("description", ""), default_checkpoint=data.get("default_checkpoint"),
        key_prefixes=prefixes, notes=data.get("notes", []), synthetic_config=_parse_synthetic(path, data),
        reference_tensors=reference_routes, experts=experts, text=text,
    )


def _parse_checkpoint(path: Path, checkpoint: dict) -> tuple[str, list[str]]:
    _check_keys(path, checkpoint, _CHECKPOINT_KEYS, "checkpoint.")
    layer_key = _require(path, checkpoint, "layer_key", str, "checkpoint.")
    _check_template(path, "checkpoint.layer_key", layer_key, ("layer", "expert"))
    if "{layer}" not in layer_key:
        raise _fail(path, "checkpoint.layer_key", "must contain the placeholder {layer}")
    prefixes = checkpoint.get("key_prefixes", [""])
    if not isinstance(prefixes, list) or not all(isinstance(p, str) for p in prefixes):
        raise _fail(path, "checkpoint.key_prefixes", "expected a list of strings")
    if not prefixes:
        raise _fail(path, "checkpoint.key_prefixes", "is empty: list at least one prefix (\"\" for none), or leave "
                                                     "the key out")
    return layer_key, prefixes


def _parse_reference(path: Path, reference: dict) -> tuple[str, list[TensorRoute]]:
    _check_keys(path, reference, _REFERENCE_KEYS, "reference.")
    module = _require(path, reference, "module", str, "reference.")
    _check_template(path, "reference.module", module)
    tensors = reference.get("tensors", {})
    if not isinstance(tensors, dict):
        raise _fail(path, "reference.tensors", "expected a table: reference parameter = checkpoint tensor")
    return module, [_parse_route(path, t, spec, "reference.tensors") for t, spec in tensors.items()]


def _parse_target(path: Path, target: dict) -> tuple[str, dict]:
    _check_keys(path, target, _TARGET_KEYS, "target.")
    target_class = _require(path, target, "class", str, "target.")
    if ":" not in target_class:
        raise _fail(path, "target.class", f"expected 'package.module:Name', got {target_class!r}")
    args = target.get("args", {})
    if not isinstance(args, dict):
        raise _fail(path, "target.args", "expected a table of constructor arguments")
    return target_class, args


def _parse_synthetic(path: Path, data: dict) -> dict | None:
    synthetic = data.get("synthetic")
    if synthetic is None:
        return None
    if not isinstance(synthetic, dict):
        raise _fail(path, "synthetic", "expected a table")
    _check_keys(path, synthetic, _SYNTHETIC_KEYS, "synthetic.")
    return _require(path, synthetic, "config", dict, "synthetic.")


def _check_plain_values(path: Path, data: dict) -> None:
    for key in ("description", "default_checkpoint"):
        if key in data and not isinstance(data[key], str):
            raise _fail(path, key, "expected a string")
    for key in ("num_layers", "hidden_size"):
        if key in data:
            _check_size(path, key, data[key])
    notes = data.get("notes", [])
    if not isinstance(notes, list) or not all(isinstance(n, str) for n in notes):
        raise _fail(path, "notes", "expected a list of strings")


SIZE_LIMITS = {"num_layers": 2**16, "hidden_size": 2**24, "experts.count": 2**16}


def _check_size(path: Path, key: str, value: Any) -> None:
    """num_layers, hidden_size, experts.count: a literal integer in range, or where in the config to read it."""
    limit = SIZE_LIMITS[key]
    if isinstance(value, int) and not isinstance(value, bool):
        if not 1 <= value <= limit:
            raise _fail(path, key, f"{value} is out of range: expected an integer from 1 to {limit}")
        return
    if isinstance(value, str) and value.startswith("config.") and _attribute_path(value[len("config."):]):
        return
    if (isinstance(value, dict) and set(value) <= {"config", "default"} and _attribute_path(value.get("config"))
            and (isinstance(value.get("default"), int) and not isinstance(value.get("default"), bool)
                 and 1 <= value["default"] <= limit or "default" not in value)):
        return
    raise _fail(path, key, f"{value!r:.80} is not a size: expected an integer from 1 to {limit}, "
                           "\"config.ATTRIBUTE\", or { config = \"ATTRIBUTE\", default = N }")


def _attribute_path(attr: Any) -> bool:
    """A config attribute as mappings name it: dotted identifiers, none private ("rope_scaling.factor")."""
    return isinstance(attr, str) and all(part.isidentifier() and not part.startswith("_") for part in attr.split("."))


def _parse_experts(path: Path, table: Any) -> Experts:
    if not isinstance(table, dict):
        raise _fail(path, "experts", "expected a table {count = ..., gate = ..., up = ..., down = ...}")
    _check_keys(path, table, _EXPERT_KEYS, "experts.")
    if "count" not in table:
        raise _fail(path, "experts.count", "is required (e.g. \"config.num_local_experts\")")
    _check_size(path, "experts.count", table["count"])
    stacked = table.get("stacked", [])
    if not isinstance(stacked, list) or not all(isinstance(s, str) for s in stacked):
        raise _fail(path, "experts.stacked", "expected a list of checkpoint tensor names")
    routes = {}
    for role in ("gate", "up", "down"):
        if role not in table:
            raise _fail(path, f"experts.{role}", "is required: the checkpoint tensor of this expert's projection")
        routes[role] = _parse_route(path, role, table[role], "experts")
    return Experts(table["count"], routes["gate"], routes["up"], routes["down"], tuple(stacked))


def load_mapping(path: str | Path) -> Mapping:
    """Read and validate a mapping file.  ``extends = "gpt2"`` (a built-in mapping's name, or a mapping
    file, relative to this one) starts from that mapping's tables; this file's own override them
    (``merge_tables``).  Errors name this file and, where the key is written in it, the line.  Each file of
    an ``extends`` chain is read and resolved once per load, so a chain costs time linear in its depth."""
    return _load(Path(path), (), {})[0]


# One load's resolved files, by resolved path: (the Mapping, its merged tables, or None when it extends nothing,
# and its text).  Kept for one load only: a file edited between two loads is read afresh.
_Resolved = dict[Path, tuple[Mapping, dict | None, str]]


def _load(path: Path, chain: tuple[Path, ...], resolved: _Resolved) -> tuple[Mapping, dict | None, str]:
    key = path.resolve()
    if key in resolved:
        return resolved[key]
    text = _read_mapping(path)
    try:
        tables = _mapping_tables(text, path, chain, resolved)
        mapping = parse_mapping(text if tables is None else toml_text(tables), path)
    except MappingError as exc:
        line = line_of(text, exc.key) if getattr(exc, "key", None) else None
        if line is None:
            raise
        raise MappingError(str(exc).replace(f"{path}: ", f"{path}:{line}: ", 1)) from None
    mapping.text = text  # line numbers of later errors point into the file the user wrote
    resolved[key] = (mapping, tables, text)
    return resolved[key]


def _read_mapping(path: Path) -> str:
    text = read_text(path, "mapping file", MappingError)  # a FIFO or a device is refused, never read
    try:
        tomllib.loads(text)
    except RecursionError:  # tomllib recurses into nested arrays and tables: 5000 deep ends Python's stack
        raise MappingError(f"{path}: invalid TOML: arrays or tables nested too deeply to read") from None
    except ValueError:
        pass  # parse_mapping reports it, with the line
    return text


def _mapping_tables(text: str, path: Path, chain: tuple[Path, ...], resolved: _Resolved) -> dict | None:
    """The tables of ``extends``'s mapping merged with this file's; None when the file extends nothing."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return None  # parse_mapping reports it, with the line
    if "extends" not in data:
        return None
    base = data.pop("extends")
    if not isinstance(base, str) or not base.strip():
        raise _fail(path, "extends", "expected a built-in mapping name (see `parity list`) or a mapping file")
    base_path = extends_path(base, path)
    here = (*chain, path.resolve())
    if base_path.resolve() in here:
        raise _fail(path, "extends", f"'{base}' extends, directly or not, this very file: a circle")
    # the base is valid on its own (its errors name its own file), and resolved once: its tables are reused
    _, base_tables, base_text = _load(base_path, here, resolved)
    if base_path.resolve().parent == builtin_mapping_dir().resolve():  # reports name this file, not the built-in
        data.setdefault("name", path.stem)
    return merge_tables(tomllib.loads(base_text) if base_tables is None else base_tables, data)


def extends_path(base: str, path: Path) -> Path:
    """``extends``: a built-in mapping's name ("gpt2"), or a file (a name ending in .toml or holding a
    '/', relative to the extending file's folder)."""
    if not base.endswith(".toml") and "/" not in base and "\\" not in base:
        builtin = builtin_mapping_dir() / f"{base}.toml"
        if builtin.is_file() and builtin.name not in NOT_MAPPINGS:
            return builtin
        names = sorted(p.stem for p in builtin_mapping_dir().glob("*.toml") if p.name not in NOT_MAPPINGS)
        raise _fail(path, "extends", f"no built-in mapping '{base}' (built-ins: {', '.join(names)}); "
                                     "a mapping file is written as a path ending in .toml")
    found = Path(base).expanduser()
    found = found if found.is_absolute() else path.parent / found
    why = not_regular(found)
    if why == "does not exist":
        raise _fail(path, "extends", f"mapping file {shown(found)} not found")
    if why is not None:  # a FIFO, a device, a folder: say what it is, not "not found"
        raise _fail(path, "extends", f"mapping file {shown(found)} {why}")
    return found


# Tables a mapping replaces as a whole when it writes them: routes are never merged (an inherited route
# would fill, or demand, a parameter the new target may not have), nor are constructor arguments.
REPLACED_TABLES = {("tensors",), ("reference", "tensors"), ("experts",), ("target", "args"), ("synthetic", "config")}


def merge_tables(base: dict, child: dict, at: tuple[str, ...] = ()) -> dict:
    """``child``'s keys over ``base``'s: tables merge key by key, except REPLACED_TABLES, and a [target]
    that names a ``class`` replaces the inherited [target] (another class, other constructor arguments)."""
    merged = dict(base)
    for key, value in child.items():
        where = (*at, key)
        inherited = base.get(key)
        if (isinstance(value, dict) and isinstance(inherited, dict) and where not in REPLACED_TABLES
                and not (where == ("target",) and "class" in value)):
            merged[key] = merge_tables(inherited, value, where)
        else:
            merged[key] = value
    return merged


def is_builtin(mapping: Mapping) -> bool:
    """Whether this is one of parity's own mappings (not a file the user gave)."""
    return builtin_mappings().get(mapping.name) is mapping


def route_spelling(route: TensorRoute) -> str | dict[str, Any]:
    """A route as a mapping file writes it: "name", or {from = ..., transform = ..., chunk = ..., optional = ...}."""
    spec: dict[str, Any] = {"from": route.source}
    if route.transform != "none":
        spec["transform"] = route.transform
    if route.chunk is not None:
        spec["chunk"] = list(route.chunk)
    if route.optional:
        spec["optional"] = True
    return route.source if len(spec) == 1 else spec


def route_arrows(tensors: dict[str, Any]) -> str:
    """Routes as spelled (``route_spelling``) in one line: 'param ← tensor' ('.T': transposed).  Optional routes
    (biases a checkpoint may lack) are left out: the JSON has them."""
    parts = []
    for target, spec in tensors.items():
        if isinstance(spec, str):
            parts.append(f"{target} ← {spec}")
        elif not spec.get("optional"):
            chunk = f"[chunk {spec['chunk'][0]}/{spec['chunk'][1]}]" if spec.get("chunk") else ""
            parts.append(f"{target} ← {spec['from']}{chunk}{'.T' if spec.get('transform') == 'transpose' else ''}")
    return ", ".join(parts)


def mapping_text(extends: str, target_class: str, args: dict[str, Any] | None, tensors: dict[str, Any],
                 comments: dict[str, str] | None = None, header: str = "") -> str:
    """A mapping file that extends another and gives its own [target] and [tensors] (``--save-mapping``,
    and the mapping printed when routes cannot be read off names).  ``comments``: per tensor key."""
    comments = comments or {}
    # control characters (an ESC or DEL in a path) shown escaped: TOML refuses them even in a comment
    lines = [f"# {printable(line)}" if line else "#" for line in header.splitlines()]
    lines += [f"extends = {toml_value(extends)}", "", "[target]", f"class = {toml_value(target_class)}"]
    if args is not None:
        lines.append(f"args = {toml_value(args)}")
    lines += ["", "[tensors]   # target parameter = checkpoint tensor (names relative to the layer)"]
    for key, spec in tensors.items():
        comment = f"   # {comments[key]}" if comments.get(key) else ""
        lines.append(f"{toml_value(key)} = {toml_value(spec)}{comment}")
    return "\n".join(lines) + "\n"


def printable(text: str) -> str:
    """``text`` with every character that is not printable (control characters, lone surrogates of a
    non-UTF-8 file name) written as its Python escape."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


SAVED_MAPPING_MARK = "# Written by `parity "  # the first line of every mapping --save-mapping writes


def toml_text(tables: dict[str, Any]) -> str:
    """Plain data as TOML: top-level values, then one [table] per dict (nested dicts as inline tables)."""
    lines = [f"{toml_key(k)} = {toml_value(v)}" for k, v in tables.items() if not isinstance(v, dict)]
    for name, table in tables.items():
        if isinstance(table, dict):
            lines += ["", f"[{toml_key(name)}]"]
            lines += [f"{toml_key(k)} = {toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def toml_key(key: str) -> str:
    """A key bare where TOML allows it (``args = { config = "config" }``), else quoted."""
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else toml_value(key)


def toml_value(value: Any) -> str:
    """One TOML value (strings and keys quoted; None as { none = true }, the spelling ConfigValue reads)."""
    if value is None:
        return "{ none = true }"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        items = ", ".join(f"{toml_key(str(k))} = {toml_value(v)}" for k, v in value.items())
        return f"{{ {items} }}" if items else "{}"
    raise TypeError(f"no TOML spelling for {type(value).__name__}")


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


def builtin_mappings() -> dict[str, Mapping]:
    """All built-in mappings by name (``mappings/*.toml``), parsed once per process."""
    return dict(_builtin_mappings())


@functools.lru_cache(maxsize=1)
def _builtin_mappings() -> dict[str, Mapping]:
    found = {}
    for path in sorted(builtin_mapping_dir().glob("*.toml")):
        if path.name in NOT_MAPPINGS:
            continue
        mapping = load_mapping(path)
        found[mapping.name] = mapping
    return found


def fits(mapping: Mapping, has) -> bool:
    """Whether a checkpoint (its ``has(name)``) holds layer 0's tensors under this mapping's names."""
    sources = [r.source for r in mapping.tensors if not r.optional]
    return any(all(has(f"{prefix}{mapping.layer_prefix(0)}.{s}") for s in sources) for prefix in mapping.key_prefixes)


def mappings_for_model_type(model_type: str | None) -> list[Mapping]:
    """Built-in mappings serving ``model_type``; the plain HF-format one (no '-' suffix) first."""
    found = [m for m in builtin_mappings().values() if model_type in m.model_types]
    return sorted(found, key=lambda m: ("-" in m.name, m.name))


def mapping_for_model_type(model_type: str | None, has=None) -> Mapping:
    """The mapping for a checkpoint: of those serving its model_type, the one whose tensor names it holds."""
    mappings = builtin_mappings()
    candidates = mappings_for_model_type(model_type)
    if candidates:
        fitting = [m for m in candidates if has is not None and fits(m, has)]
        return (fitting or candidates)[0]
    served = sorted({t for m in mappings.values() for t in m.model_types})  # each once: gpt2, gpt2-gguf, ... share one
    raise MappingError(
        f"no mapping serves model_type {model_type!r} (config.json); known model types: {', '.join(served)}. "
        "Write a mapping file for it and pass it with --mapping FILE.toml (README: 'Adding a model family')."
    )


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
