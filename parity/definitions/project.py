"""A project's list of checks and compares (`[tool.parity]` in pyproject.toml, or parity.toml); which of them
a run takes (`-k`, `--shard K/N`) is ``parity.definitions.run_selection``.

Reading and validating the file is pure data work: no torch, no transformers.  Every
error names the file and the entry, because a CI log is read by someone who did not
write the file.
"""

from __future__ import annotations

import errno
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parity.definitions.files import read_text
from parity.definitions.policy import synthetic_action
from parity.definitions.values import (
    BASELINE_MINIMUM,
    atol_value,
    baseline_number,
    device_value,
    dtype_value,
    seed_value,
)
from parity.errors import ProjectConfigError

PROJECT_FILES = ("parity.toml", "pyproject.toml")

_TOP_KEYS = {"checks", "compares", "baseline", "baseline_factor", "baseline_slack", "junit", "html", "defaults"}
_CHECK_KEYS = {"name", "model", "checkpoint", "layers", "layer", "target", "mapping", "revision", "seed", "atol",
               "tolerance", "logits", "experts", "block", "allow_pickle", "require_real", "device", "dtype"}
# [[compares]]: `parity compare A B` run by `parity check`; [defaults] keys of this set apply to compares too
_COMPARE_KEYS = {"name", "a", "b", "revision", "revision_b", "layers", "layer", "experts", "seed", "allow_pickle",
                 "require_real"}


@dataclass
class CheckSpec:
    """One check: what `parity MODEL ...` would run."""

    model: str
    checkpoint: str | None = None
    layers: Any = None  # None | "all" | "0,3" | "2-7" | int | list[int]
    target: str | None = None
    mapping: str | None = None
    revision: str | None = None
    seed: int = 0
    atol: float | None = None
    name: str | None = None
    logits: bool = False
    allow_pickle: bool = False
    experts: Any = None  # MoE: None | "all" | "0,3" | list[int]
    # MoE: True checks each layer's whole sparse block as one unit; False one expert at a time; None: a block when
    # the target holds more than one expert and no experts were selected
    block: bool | None = None
    require_real: bool = False  # synthetic weights are an error (exit 2), not a check; project files default to true
    device: str = "cpu"  # where the target runs: cpu, cuda, cuda:N, mps
    dtype: str = "float32"  # the target's compute dtype: float32, bfloat16, float16
    where: str = ""  # "parity.toml: checks[2]" for error messages

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        parts = [self.model]
        if self.checkpoint:
            parts.append(f"@ {self.checkpoint}")
        if self.target:
            parts.append(f"[{self.target}]")
        return " ".join(parts)

    @property
    def block_choice(self) -> bool | None:
        """``block`` as the run takes it: experts selected (``--experts``) mean one expert at a time."""
        return self.block if self.block is not None or self.experts is None else False

    def inputs(self) -> list[tuple[str, str | None]]:
        """What the check reads (no output may be written over one of them)."""
        return [("checkpoint", self.checkpoint), ("model", self.model), ("mapping", self.mapping)]


@dataclass
class CompareSpec:
    """One comparison: what `parity compare A B ...` would run (a project file's ``[[compares]]`` entry)."""

    a: str  # the reference checkpoint (the truth)
    b: str  # the candidate, made from A
    layers: Any = None  # None | "all" | "0,3" | "2-7" | int | list[int]
    revision: str | None = None  # hub revision of A
    revision_b: str | None = None  # hub revision of B
    seed: int = 0
    name: str | None = None  # the label in reports and the baseline's key (`compare NAME | layer N`)
    allow_pickle: bool = False
    require_real: bool = False  # a synthetic stand-in on either side is an error (exit 2); project files: true
    where: str = ""  # "parity.toml: compares[0]" for error messages
    experts: Any = None  # MoE: None | "all" | "0,3" | list[int]
    kind = "compare"  # a class constant: what a suite's JSON calls the entry

    @property
    def label(self) -> str:
        return self.name or f"compare {self.a} {self.b}"

    def inputs(self) -> list[tuple[str, str | None]]:
        return [("A", self.a), ("B", self.b)]


@dataclass
class Project:
    path: Path
    checks: list[CheckSpec | CompareSpec]  # the [[checks]], then the [[compares]]
    baseline: str | None = None
    baseline_factor: float | None = None
    baseline_slack: float | None = None
    junit: str | None = None
    html: str | None = None  # the HTML report's file (--html)
    notes: list[str] = field(default_factory=list)


def find_project_file(folder: Path) -> tuple[Path, dict]:
    """The nearest project file, in ``folder`` or its parents (as ruff, pytest and mypy look): in each folder
    parity.toml first, else pyproject.toml with a [tool.parity] table (one without it is passed over)."""
    start = folder.resolve()
    for here in (start, *start.parents):
        for name in PROJECT_FILES:
            path = here / name
            if not _exists(path) and not path.is_symlink():
                continue
            data = _read_toml(path)  # a FIFO or a folder of that name is refused, never read
            if name == "parity.toml":
                return path, data
            table = _tool_parity(data, path)
            if table is not None:
                return path, table
    raise ProjectConfigError(
        f"{folder}: no parity.toml and no [tool.parity] table in pyproject.toml, here or in any parent folder. "
        "Add one listing the checks, e.g. [[tool.parity.checks]] with model = \"gpt2\" and layers = [0, 11] "
        "(docs/ci.md: 'Many checks at once'), or run `parity MODEL` for a single check."
    )


def load_project(path: str | Path | None = None, cwd: Path | None = None) -> Project:
    """Read and validate a project file (default: the current directory's)."""
    if path is None:
        file, table = find_project_file(cwd or Path.cwd())
    else:
        file = Path(path)
        if not _exists(file) and not file.is_symlink():
            raise ProjectConfigError(f"{file}: project file not found")
        data = _read_toml(file)
        table = _tool_parity(data, file) if file.name == "pyproject.toml" else data
        if table is None:
            raise ProjectConfigError(
                f"{file}: has no [tool.parity] table; add one listing the checks ([[tool.parity.checks]] with "
                "model = \"gpt2\", ...; docs/ci.md: 'Many checks at once'), or give --config a parity.toml")
    return parse_project(table, file)


def _tool_parity(data: dict, path: Path) -> Any:
    """pyproject.toml's [tool.parity] (None: absent); a `tool` that is not a table is the file's error."""
    tool = data.get("tool", {})
    if not isinstance(tool, dict):
        raise ProjectConfigError(f"{path}: 'tool' = {tool!r:.60} must be a table ([tool.parity], [tool.ruff], ...)")
    return tool.get("parity")


def _exists(path: Path) -> bool:
    """Path.exists, for any text a file may hold: a name too long for the file system is not a file there
    (and one that cannot be looked at counts as there: reading it then says why)."""
    try:
        return path.exists()
    except OSError as exc:
        return exc.errno != errno.ENAMETOOLONG


def _read_toml(path: Path) -> dict:
    text = read_text(path, "project file", ProjectConfigError)  # a FIFO or a device is refused, never read
    try:
        return tomllib.loads(text)
    except ValueError as exc:  # TOMLDecodeError, or an integer of more than 4300 digits
        raise ProjectConfigError(f"{path}: invalid TOML: {exc}") from None
    except RecursionError:
        raise ProjectConfigError(f"{path}: invalid TOML: nested too deeply to read") from None


def require_unique_labels(specs: list) -> None:
    """Each entry's label (its name, or the one made from its model/target, A and B) keys its baseline entries, its
    reports and -k: two entries with one label would share baseline keys, and each run would read the other's
    figures as 'made from other weights'.  Refused where the file is read, naming both entries."""
    seen: dict[str, str] = {}
    for spec in specs:
        if spec.label in seen:
            how = "name" if spec.name else "label (made from its fields: it has no name)"
            other = seen[spec.label].split(": ")[-1]
            fix = "give it another 'name'" if spec.name else "give it a 'name'"
            raise ProjectConfigError(f"{spec.where}: {how} {spec.label!r} is also {other}'s; labels key the baseline "
                                     f"and -k, so each entry needs its own: {fix}")
        seen[spec.label] = spec.where


def parse_project(table: dict, file: Path) -> Project:
    prefix = "tool.parity." if file.name == "pyproject.toml" else ""
    if not isinstance(table, dict):
        raise ProjectConfigError(f"{file}: '{prefix.rstrip('.') or 'parity'}' must be a table")
    for key in table:
        if key not in _TOP_KEYS:
            raise ProjectConfigError(f"{file}: unknown key '{prefix}{key}'; expected one of {sorted(_TOP_KEYS)}")
    defaults = table.get("defaults", {})
    if not isinstance(defaults, dict):
        raise ProjectConfigError(f"{file}: '{prefix}defaults' must be a table of check keys shared by every check")
    checks, compares = table.get("checks"), table.get("compares")
    if compares is not None and (not isinstance(compares, list) or not compares
                                 or not all(isinstance(c, dict) for c in compares)):
        raise ProjectConfigError(
            f"{file}: '{prefix}compares' must be a non-empty array of tables ([[{prefix}compares]] with 'a' and 'b')")
    if (checks is not None or compares is None) and (
            not isinstance(checks, list) or not checks or not all(isinstance(c, dict) for c in checks)):
        raise ProjectConfigError(
            f"{file}: '{prefix}checks' must be a non-empty array of tables ([[{prefix}checks]] with at least 'model'), "
            f"unless the file lists [[{prefix}compares]]")
    specs: list[CheckSpec | CompareSpec] = [
        _parse_check({**defaults, **entry}, f"{file.name}: {prefix}checks[{i}]", file.parent)
        for i, entry in enumerate(checks or [])]
    shared = {key: value for key, value in defaults.items() if key in _COMPARE_KEYS}
    specs += [_parse_compare({**shared, **entry}, f"{file.name}: {prefix}compares[{i}]", file.parent)
              for i, entry in enumerate(compares or [])]
    require_unique_labels(specs)
    project = Project(file, specs)
    for key, kind in (("baseline", str), ("junit", str), ("html", str), ("baseline_factor", (int, float)),
                      ("baseline_slack", (int, float))):
        value = table.get(key)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            raise ProjectConfigError(f"{file}: '{prefix}{key}' has the wrong type ({type(value).__name__})")
        if isinstance(value, str) and key in ("baseline", "junit", "html"):
            if not value.strip():  # an empty path names nothing: taken as absent, the file would silently go missing
                raise ProjectConfigError(f"{file}: '{prefix}{key}' is empty; give a file name or leave the key out")
            value = str(file.parent / value)
        if value is not None and key in BASELINE_MINIMUM:
            try:
                value = baseline_number(key, float(value))
            except ValueError as exc:
                raise ProjectConfigError(f"{file}: '{prefix}{key}' {exc}") from None
        setattr(project, key, value)
    return project


def _parse_check(entry: dict, where: str, base: Path) -> CheckSpec:
    def fail(what: str) -> ProjectConfigError:
        shown = f" (model {entry['model']!r})" if isinstance(entry.get("model"), str) else ""
        return ProjectConfigError(f"{where}{shown}: {what}")

    for key in entry:
        if key not in _CHECK_KEYS:
            raise fail(f"unknown key '{key}'; expected one of {sorted(_CHECK_KEYS)}")
    if not isinstance(entry.get("model"), str) or not entry["model"]:
        raise fail("'model' is required: a mapping name, hub id or local folder")
    for key in ("checkpoint", "target", "mapping", "revision", "name"):
        if key in entry and not isinstance(entry[key], str):
            raise fail(f"'{key}' must be a string")
        if key in entry and not entry[key].strip():  # "" joined to the project folder would name the folder
            raise fail(f"'{key}' is empty: give a value or leave the key out")
    layers, seed = _layers_and_seed(entry, fail)
    if "atol" in entry and "tolerance" in entry:
        raise fail("give 'atol' or 'tolerance' (the same thing), not both")
    atol = entry.get("atol", entry.get("tolerance"))
    try:
        atol = None if atol is None else atol_value(atol)
    except ValueError as exc:
        raise fail(f"'atol' {exc}") from None
    compute = {}
    for key, rule, default in (("device", device_value, "cpu"), ("dtype", dtype_value, "float32")):
        try:
            compute[key] = rule(entry.get(key, default))
        except ValueError as exc:
            raise fail(f"'{key}' {exc}") from None
    logits, allow_pickle = entry.get("logits", False), entry.get("allow_pickle", False)
    require_real = entry.get("require_real", synthetic_action("parity check") == "refuse")  # CI: definitions/policy.py
    if not all(isinstance(flag, bool) for flag in (logits, allow_pickle, require_real)):
        raise fail("'logits', 'allow_pickle' and 'require_real' must be true or false")
    block = entry.get("block")
    if block is not None and not isinstance(block, bool):
        raise fail("'block' must be true or false")
    experts = _experts(entry, fail)
    mapping = entry.get("mapping")
    if mapping is not None and not Path(mapping).is_absolute():
        mapping = str(base / mapping)  # relative to the project file, like every path in it
    checkpoint = entry.get("checkpoint")
    if checkpoint is not None and not Path(checkpoint).is_absolute() and _exists(base / checkpoint):
        checkpoint = str(base / checkpoint)
    model = entry["model"]
    if not Path(model).is_absolute() and _exists(base / model):
        model = str(base / model)  # same rule as `parity MODEL`: an existing path wins over a name
    return CheckSpec(model=model, checkpoint=checkpoint, layers=layers, target=entry.get("target"), mapping=mapping,
                     revision=entry.get("revision"), seed=seed, atol=None if atol is None else float(atol),
                     name=entry.get("name"), logits=logits, allow_pickle=allow_pickle, experts=experts,
                     block=block, require_real=require_real, where=where, **compute)


def _layers_and_seed(entry: dict, fail: Callable[[str], ProjectConfigError]) -> tuple[Any, int]:
    """An entry's 'layers' (or 'layer') and 'seed', validated as `--layers` and `--seed` are."""
    if "layer" in entry and "layers" in entry:
        raise fail("give 'layer' or 'layers', not both")
    layers = entry.get("layers", entry.get("layer"))
    if layers is not None and not (
            (isinstance(layers, int) and not isinstance(layers, bool)) or isinstance(layers, str)
            or (isinstance(layers, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in layers))):
        raise fail("'layers' must be \"all\", \"0,3,5\", \"2-7\", an integer or a list of integers")
    try:
        return layers, seed_value(entry.get("seed", 0))
    except ValueError as exc:
        raise fail(f"'seed' {exc}") from None


def _local(value: str, base: Path) -> str:
    """A source as given, or the path relative to the project file's folder when one exists there (the rule of
    `parity MODEL`: an existing path wins over a name)."""
    return str(base / value) if not Path(value).is_absolute() and _exists(base / value) else value


def _experts(entry: dict, fail) -> Any:
    """An entry's 'experts' (MoE): "all", "0,3", "2-5" or a list of integers; None when absent."""
    experts = entry.get("experts")
    if experts is not None and not (isinstance(experts, str) or (
            isinstance(experts, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in experts))):
        raise fail("'experts' must be \"all\", \"0,3\", \"2-5\" or a list of integers")
    return experts


def _parse_compare(entry: dict, where: str, base: Path) -> CompareSpec:
    def fail(what: str) -> ProjectConfigError:
        sides = " and ".join(repr(entry[k]) for k in ("a", "b") if isinstance(entry.get(k), str))
        return ProjectConfigError(f"{where}{f' ({sides})' if sides else ''}: {what}")

    for key in entry:
        if key == "baseline":
            raise fail("'baseline' is the project's, not a compare's: set baseline = \"FILE\" at the top of the "
                       "table; checks and compares share that file (each keyed by its name)")
        if key not in _COMPARE_KEYS:
            raise fail(f"unknown key '{key}'; expected one of {sorted(_COMPARE_KEYS)}")
    for key in ("a", "b"):
        if not isinstance(entry.get(key), str) or not entry[key].strip():
            what = "the reference checkpoint (the truth)" if key == "a" else "the candidate, made from A"
            raise fail(f"'{key}' is required: {what}; a local folder, .gguf file or hub id")
    for key in ("revision", "revision_b", "name"):
        if key in entry and (not isinstance(entry[key], str) or not entry[key].strip()):
            raise fail(f"'{key}' must be a non-empty string (or leave the key out)")
    layers, seed = _layers_and_seed(entry, fail)
    allow_pickle = entry.get("allow_pickle", False)
    require_real = entry.get("require_real", synthetic_action("parity check") == "refuse")
    if not all(isinstance(flag, bool) for flag in (allow_pickle, require_real)):
        raise fail("'allow_pickle' and 'require_real' must be true or false")
    return CompareSpec(a=_local(entry["a"], base), b=_local(entry["b"], base), layers=layers,
                       revision=entry.get("revision"), revision_b=entry.get("revision_b"), seed=seed,
                       name=entry.get("name"), allow_pickle=allow_pickle, require_real=require_real, where=where,
                       experts=_experts(entry, fail))


