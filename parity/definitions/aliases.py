"""The alias table (``mappings/aliases.toml``): the role a module's parameter plays, read off its name.

Pure data work, no torch: ``parity.engine.check.routes`` uses it to route a checkpoint into a user's
module whose parameter names follow a common naming.  Every name is looked up exactly; nothing
here guesses by similarity.
"""

from __future__ import annotations

import functools
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from parity.definitions.datafiles import ALIASES_FILE, builtin_mapping_dir
from parity.errors import MappingError

KINDS = ("gated", "classic")
SIDES = ("in", "out")
_ROLE_KEYS = {"kind", "side", "names", "fuses"}
_OTHER_TABLES = {"biases", "layout", "constructor", "config_fields", "groups", "leaves"}
# what parity knows about a checkpoint's FFN that [config_fields.facts] may name
_SHAPE_SUFFIX = re.compile(r"(.*[^_.])_([A-Z]{1,4})")  # 'experts.w1_EFD' -> ('experts.w1', 'EFD')
FACTS = ("ffn_bias", "ffn_width", "ffn_activation", "gelu_approximate", "head_dim", "rope_theta")


@dataclass(frozen=True)
class Role:
    """One projection of an FFN: its kind (gated or classic), the side that touches the model width d
    ("in": nn.Linear weight [d_ff, d]; "out": [d, d_ff]), and the names modules give it."""

    name: str
    kind: str
    side: str
    names: frozenset[str]
    biases: frozenset[str] = frozenset()
    fuses: tuple[str, ...] = ()  # gate_up: the roles it holds, in order along dim 0


@dataclass(frozen=True)
class Group:
    """[[groups]]: names that together identify one project's layout.  ``members``: submodule or bare parameter
    name -> role ("gate", or "up.bias" for a bare bias); ``layout``: how its bare weights are stored."""

    members: dict[str, str]
    layout: str = "out_in"

    def role_of(self, member: str) -> tuple[str, str]:
        role, _, kind = self.members[member].partition(".")
        return role, kind or "weight"


@dataclass(frozen=True)
class ConfigFields:
    """[config_fields]: how a field a target's constructor reads, and the transformers config lacks, is answered
    (parity.engine.check.config_view).  Each maps the name a module reads to its answer."""

    aliases: dict[str, str]  # name -> the transformers config's own field ("n_embd" -> "hidden_size")
    facts: dict[str, str]  # name -> a fact about the checkpoint's FFN ("bias" -> "ffn_bias")
    values: dict[str, tuple[bool | int | float | str, str]]  # name -> (value, why) ("dropout" -> 0.0)


@dataclass(frozen=True)
class Aliases:
    path: Path
    roles: dict[str, Role]
    out_in: tuple[str, ...]  # owner class names whose weight is [out, in] (nn.Linear)
    in_out: tuple[str, ...]  # owner class names whose weight is [in, out] (transformers' Conv1D)
    config_names: tuple[str, ...]  # constructor parameters that take the transformers config
    config_fields: ConfigFields = field(default_factory=lambda: ConfigFields({}, {}, {}))
    groups: tuple[Group, ...] = ()
    # a projection's own parameter names, by framework: leaf -> "weight" | "bias" ([leaves])
    leaves: dict[str, str] = field(default_factory=lambda: {"weight": "weight", "bias": "bias"})
    layer_names: tuple[str, ...] = ()  # constructor parameters that take the index of the layer checked

    def leaf_kind(self, leaf: str) -> str | None:
        """'weight' | 'bias' for a projection's own parameter name (torch's weight, Flax's kernel, picoGPT's w)."""
        return self.leaves.get(leaf.lower())

    def roles_of(self, name: str) -> set[tuple[str, str]]:
        """Every (role, "weight" | "bias") the parameter ``name`` may be, by its last component(s).  A name none of
        the table's names is may carry a shape suffix, one capital letter per dimension (Shazeer's shape-suffix
        style: torchtitan's ``w1_EFD``, llama-models' ``router_DE``): it is read as the name before the suffix."""
        found = self._roles_of(name)
        suffixed = _SHAPE_SUFFIX.fullmatch(name)
        return found or (self._roles_of(suffixed.group(1)) if suffixed else found)

    def _roles_of(self, name: str) -> set[tuple[str, str]]:
        parts = name.lower().split(".")
        leaf, found = parts[-1], set()
        kind = self.leaf_kind(leaf)
        if kind is not None and len(parts) > 1:
            found |= {(r.name, kind) for r in self.roles.values() if parts[-2] in r.names}
        found |= {(r.name, "weight") for r in self.roles.values() if leaf in r.names}
        found |= {(r.name, "bias") for r in self.roles.values() if leaf in r.biases}
        return found

    def layout_of(self, class_names: list[str]) -> str | None:
        """'out_in' | 'in_out' for a weight owned by a module of these classes (its MRO), else None."""
        for name in class_names:
            if name in self.out_in:
                return "out_in"
            if name in self.in_out:
                return "in_out"
        return None


def aliases_path() -> Path:
    return builtin_mapping_dir() / ALIASES_FILE


@functools.lru_cache(maxsize=4)
def load_aliases(path: Path | None = None) -> Aliases:
    """Read and validate the alias table (default: the built-in one, beside the mappings)."""
    path = path or aliases_path()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise MappingError(f"{path}: cannot read the alias table: {exc}") from None
    biases = _string_lists(path, data.get("biases", {}), "biases")
    roles = {}
    for name, table in data.items():
        if name in _OTHER_TABLES:
            continue
        roles[name] = _role(path, name, table, biases.get(name, []))
    unknown = set(biases) - set(roles)
    if unknown:
        raise MappingError(f"{path}: key 'biases.{sorted(unknown)[0]}': no such role; roles: {sorted(roles)}")
    _check_unique(path, roles)
    layout = _string_lists(path, data.get("layout", {}), "layout")
    constructor = _string_lists(path, data.get("constructor", {}), "constructor")
    return Aliases(path, roles, tuple(layout.get("out_in", [])), tuple(layout.get("in_out", [])),
                   tuple(constructor.get("config", [])), _config_fields(path, data.get("config_fields", {})),
                   _groups(path, data.get("groups", []), roles), _leaves(path, data.get("leaves", {})),
                   tuple(constructor.get("layer", [])))


def _leaves(path: Path, table: object) -> dict[str, str]:
    """[leaves]: weight = [...], bias = [...]: each name one kind."""
    lists = _string_lists(path, table, "leaves")
    if set(lists) - {"weight", "bias"}:
        raise MappingError(f"{path}: key 'leaves': expected the lists weight and bias")
    kinds = {name.lower(): kind for kind, names in lists.items() for name in names}
    if len(kinds) != sum(len(v) for v in lists.values()):
        raise MappingError(f"{path}: key 'leaves': a name is listed twice")
    return kinds or {"weight": "weight", "bias": "bias"}


def _groups(path: Path, table: object, roles: dict[str, Role]) -> tuple[Group, ...]:
    """[[groups]]: each with members = { name = "role" | "role.bias" } of known roles, one kind, and a layout."""
    if not isinstance(table, list):
        raise MappingError(f"{path}: key 'groups': expected [[groups]] tables")
    groups = []
    for index, entry in enumerate(table):
        where = f"{path}: [[groups]] #{index + 1}"
        members, layout = (entry.get("members"), entry.get("layout", "out_in")) if isinstance(entry, dict) else (0, 0)
        if (not isinstance(members, dict) or not members or set(entry) - {"members", "layout"}
                or layout not in ("out_in", "in_out")):
            raise MappingError(f"{where}: expected members = {{ name = \"role\" }} and layout \"out_in\" | \"in_out\"")
        group = Group({str(k): v for k, v in members.items()}, layout)
        for member, value in members.items():
            role, kind = group.role_of(member) if isinstance(value, str) else ("", "")
            if role not in roles or kind not in ("weight", "bias"):
                raise MappingError(f"{where}: member '{member}' = {value!r}: expected one of {sorted(roles)}, "
                                   "optionally with .bias")
        if len({roles[group.role_of(m)[0]].kind for m in members}) != 1:
            raise MappingError(f"{where}: its members mix gated and classic roles")
        groups.append(group)
    return tuple(groups)


def _config_fields(path: Path, table: object) -> ConfigFields:
    """[config_fields]: aliases and facts are tables of name lists, values a table of {value, why}; a name has one
    answer."""
    if not isinstance(table, dict) or set(table) - {"aliases", "facts", "values"}:
        raise MappingError(f"{path}: key 'config_fields': expected the tables aliases, facts and values")
    aliases = _string_lists(path, table.get("aliases", {}), "config_fields.aliases")
    facts = _string_lists(path, table.get("facts", {}), "config_fields.facts")
    unknown = set(facts) - set(FACTS)
    if unknown:
        raise MappingError(f"{path}: key 'config_fields.facts.{sorted(unknown)[0]}': no such fact; facts: {FACTS}")
    values: dict[str, tuple[bool | int | float | str, str]] = {}
    raw = table.get("values", {})
    for name, entry in (raw.items() if isinstance(raw, dict) else [("", None)]):
        if (not isinstance(entry, dict) or set(entry) != {"value", "why"} or not isinstance(entry["why"], str)
                or not isinstance(entry["value"], (bool, int, float, str))):
            raise MappingError(f"{path}: key 'config_fields.values.{name}': expected {{ value = ..., why = \"...\" }}")
        values[name] = (entry["value"], entry["why"])
    answers: dict[str, str] = {}
    for kind, names in [*((f"aliases.{k}", v) for k, v in aliases.items()),
                        *((f"facts.{k}", v) for k, v in facts.items()), *((f"values.{k}", [k]) for k in values)]:
        for name in names:
            if name in answers:
                raise MappingError(f"{path}: config field '{name}' is listed in config_fields.{answers[name]} and "
                                   f"config_fields.{kind}: a field must have one answer")
            answers[name] = kind
    return ConfigFields({n: k for k, names in aliases.items() for n in names},
                        {n: k for k, names in facts.items() for n in names}, values)


def _string_lists(path: Path, table: object, where: str) -> dict[str, list[str]]:
    if not isinstance(table, dict) or not all(
            isinstance(v, list) and all(isinstance(s, str) for s in v) for v in table.values()):
        raise MappingError(f"{path}: key '{where}': expected a table of lists of names")
    return table


def _role(path: Path, name: str, table: object, biases: list[str]) -> Role:
    if not isinstance(table, dict) or set(table) - _ROLE_KEYS:
        raise MappingError(f"{path}: key '{name}': expected a role table with keys {sorted(_ROLE_KEYS)}")
    kind, side, names = table.get("kind"), table.get("side"), table.get("names")
    if kind not in KINDS or side not in SIDES:
        raise MappingError(f"{path}: key '{name}': kind must be one of {KINDS} and side one of {SIDES}")
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise MappingError(f"{path}: key '{name}.names': expected a list of parameter names")
    fuses = tuple(table.get("fuses", ()))
    return Role(name, kind, side, frozenset(n.lower() for n in names), frozenset(b.lower() for b in biases), fuses)


def _check_unique(path: Path, roles: dict[str, Role]) -> None:
    """Within one kind, a name has one role: otherwise reading a role off a name would be a guess."""
    for kind in KINDS:
        seen: dict[tuple[str, str], str] = {}
        for role in (r for r in roles.values() if r.kind == kind):
            for key in [("weight", n) for n in role.names] + [("bias", b) for b in role.biases]:
                if key in seen:
                    raise MappingError(f"{path}: '{key[1]}' is listed for both {seen[key]} and {role.name} "
                                       f"({kind} FFNs): a name must have one role within a kind")
                seen[key] = role.name
