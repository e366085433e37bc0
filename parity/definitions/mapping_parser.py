"""Reading a mapping file: TOML parsed, every key validated (an error names the file, the line and what
was expected), ``extends`` chains resolved once per file and merged.
"""

from __future__ import annotations

import string
import tomllib
from pathlib import Path
from typing import Any

from parity.definitions.datafiles import NOT_MAPPINGS, builtin_mapping_dir
from parity.definitions.files import not_regular, read_text, shown
from parity.definitions.mapping import TRANSFORMS, Experts, Mapping, TensorRoute, _attribute_path, line_of
from parity.definitions.toml_text import toml_text
from parity.errors import MappingError

_TOP_KEYS = {"name", "description", "model_types", "default_checkpoint", "num_layers", "hidden_size",
             "notes", "checkpoint", "reference", "target", "tensors", "synthetic", "experts"}

_CHECKPOINT_KEYS = {"layer_key", "key_prefixes"}

_REFERENCE_KEYS = {"module", "tensors"}

_TARGET_KEYS = {"class", "args"}

_TENSOR_KEYS = {"from", "transform", "chunk", "interleaved", "optional"}

_SYNTHETIC_KEYS = {"config"}

_EXPERT_KEYS = {"count", "stacked", "transposed", "gate", "up", "down", "gate_bias", "up_bias", "down_bias"}


def _fail(path: Path, key: str, what: str) -> MappingError:
    error = MappingError(f"{path}: key '{key}': {what}")
    error.key = key  # load_mapping adds the line it is on
    return error


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


def _parse_route(path: Path, target: str, spelled: Any, table: str = "tensors") -> TensorRoute:
    where = f"{table}.\"{target}\""
    source = spelled.get("from") if isinstance(spelled, dict) else spelled
    if isinstance(source, str) and source.strip() in ("?", ""):
        raise _fail(path, where, f"is still the placeholder {source!r}: write the checkpoint tensor (relative to the "
                                 "layer, e.g. \"up_proj.weight\") that fills this parameter; the comments beside the "
                                 "printed mapping list each tensor's shape and role")
    if isinstance(spelled, str):
        return TensorRoute(target, spelled)
    if not isinstance(spelled, dict):
        raise _fail(path, where, "expected a tensor name or a table {from = ..., transform = ...}")
    if "zeros" in spelled:  # a parameter the checkpoint has no tensor for, declared: zeros, said in the report
        if spelled != {"zeros": True} or table != "tensors":
            raise _fail(path, where, "expected exactly { zeros = true } (only in [tensors]: a parameter of your module "
                                     "that the checkpoint has no tensor for)")
        return TensorRoute(target, "", zeros=True)
    _check_keys(path, spelled, _TENSOR_KEYS, where + ".")
    source = _require(path, spelled, "from", str, where + ".")
    transform = spelled.get("transform", "none")
    if transform not in TRANSFORMS:
        raise _fail(path, where + ".transform", f"unknown transform {transform!r}; expected one of {list(TRANSFORMS)}")
    chunk = spelled.get("chunk")
    if chunk is not None:
        if (not isinstance(chunk, list) or len(chunk) != 2 or not all(isinstance(c, int) for c in chunk)
                or not 0 <= chunk[0] < chunk[1]):
            raise _fail(path, where + ".chunk", "expected [index, count] with 0 <= index < count")
        chunk = (chunk[0], chunk[1])
    optional = spelled.get("optional", False)
    if not isinstance(optional, bool):
        raise _fail(path, where + ".optional", "expected true or false")
    interleaved = spelled.get("interleaved", False)
    if not isinstance(interleaved, bool) or interleaved and chunk is None:
        raise _fail(path, where + ".interleaved", "expected true or false, and true only with a chunk (rows index, "
                                                  "index + count, ... instead of one block)")
    return TensorRoute(target, source, transform, chunk, optional, interleaved=interleaved)


def _check_template(path: Path, key: str, template: str, placeholders: tuple[str, ...] = ("layer",)) -> None:
    """Only plain placeholders: ``{layer[0]}``, ``{layer.real}``, ``{layer!r}`` or ``{layer:>1000000000}`` would
    index, reach into, or pad (to a gigabyte) the number instead of naming a layer."""
    allowed = " and ".join("{" + name + "}" for name in placeholders)
    try:
        fields = [(f, fmt, conv) for _, f, fmt, conv in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        raise _fail(path, key, f"not a valid template ({exc}); the placeholders are {allowed}") from None
    for name, fmt, conversion in fields:
        if name not in placeholders or fmt or conversion:
            written = "{" + name + (f"!{conversion}" if conversion else "") + (f":{fmt}" if fmt else "") + "}"
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
    return module, [_parse_route(path, t, spelled, "reference.tensors") for t, spelled in tensors.items()]


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
    transposed = table.get("transposed", False)
    if not isinstance(transposed, bool) or transposed and not stacked:
        raise _fail(path, "experts.transposed", "expected true or false, and true only with 'stacked' tensors (each "
                                                "expert's slice stored [in, out])")
    biases = tuple(_parse_route(path, role, table[role], "experts") for role in ("gate_bias", "up_bias", "down_bias")
                   if role in table)
    return Experts(table["count"], routes["gate"], routes["up"], routes["down"], tuple(stacked), transposed, biases)


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
