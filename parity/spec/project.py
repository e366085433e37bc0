"""A project's list of checks (`[tool.parity]` in pyproject.toml, or parity.toml), and
how a CI matrix splits them (`--shard K/N`).

Reading and validating the file is pure data work: no torch, no transformers.  Every
error names the file and the entry, because a CI log is read by someone who did not
write the file.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parity.errors import ProjectConfigError, ShardError
from parity.spec.values import BASELINE_MINIMUM, atol_value, baseline_number, seed_value

PROJECT_FILES = ("parity.toml", "pyproject.toml")

_TOP_KEYS = {"checks", "baseline", "baseline_factor", "baseline_slack", "junit", "defaults"}
_CHECK_KEYS = {"name", "model", "checkpoint", "layers", "layer", "target", "mapping", "revision", "seed", "atol",
               "tolerance", "logits", "experts", "allow_pickle", "require_real"}


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
    require_real: bool = False  # synthetic weights are an error (exit 2), not a check; project files default to true
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


@dataclass
class Project:
    path: Path
    checks: list[CheckSpec]
    baseline: str | None = None
    baseline_factor: float | None = None
    baseline_slack: float | None = None
    junit: str | None = None
    notes: list[str] = field(default_factory=list)


def find_project_file(folder: Path) -> tuple[Path, dict]:
    """parity.toml first, else pyproject.toml with a [tool.parity] table."""
    for name in PROJECT_FILES:
        path = folder / name
        if not path.is_file():
            continue
        data = _read_toml(path)
        if name == "parity.toml":
            return path, data
        table = data.get("tool", {}).get("parity")
        if table is not None:
            return path, table
    raise ProjectConfigError(
        f"{folder}: no parity.toml and no [tool.parity] table in pyproject.toml. Add one listing the checks, e.g.\n"
        "  [[tool.parity.checks]]\n  model = \"gpt2\"\n  layers = [0, 11]\n"
        "(README: 'Many checks at once'), or run `parity MODEL` for a single check."
    )


def load_project(path: str | Path | None = None, cwd: Path | None = None) -> Project:
    """Read and validate a project file (default: the current directory's)."""
    if path is None:
        file, table = find_project_file(cwd or Path.cwd())
    else:
        file = Path(path)
        if not file.is_file():
            raise ProjectConfigError(f"{file}: project file not found")
        data = _read_toml(file)
        table = data.get("tool", {}).get("parity", data) if file.name == "pyproject.toml" else data
    return parse_project(table, file)


def _read_toml(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ProjectConfigError(f"{path}: invalid TOML: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ProjectConfigError(f"{path}: cannot read: {exc}") from None


def parse_project(table: dict, file: Path) -> Project:
    prefix = "tool.parity." if file.name == "pyproject.toml" else ""
    if not isinstance(table, dict):
        raise ProjectConfigError(f"{file}: '{prefix or 'parity'}' must be a table")
    for key in table:
        if key not in _TOP_KEYS:
            raise ProjectConfigError(f"{file}: unknown key '{prefix}{key}'; expected one of {sorted(_TOP_KEYS)}")
    defaults = table.get("defaults", {})
    if not isinstance(defaults, dict):
        raise ProjectConfigError(f"{file}: '{prefix}defaults' must be a table of check keys shared by every check")
    checks = table.get("checks")
    if not isinstance(checks, list) or not checks or not all(isinstance(c, dict) for c in checks):
        raise ProjectConfigError(
            f"{file}: '{prefix}checks' must be a non-empty array of tables ([[{prefix}checks]] with at least 'model')")
    specs = [_parse_check({**defaults, **entry}, f"{file.name}: {prefix}checks[{i}]", file.parent)
             for i, entry in enumerate(checks)]
    project = Project(file, specs)
    for key, kind in (("baseline", str), ("junit", str), ("baseline_factor", (int, float)),
                      ("baseline_slack", (int, float))):
        value = table.get(key)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            raise ProjectConfigError(f"{file}: '{prefix}{key}' has the wrong type ({type(value).__name__})")
        if isinstance(value, str) and key in ("baseline", "junit"):
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
    if "layer" in entry and "layers" in entry:
        raise fail("give 'layer' or 'layers', not both")
    layers = entry.get("layers", entry.get("layer"))
    if layers is not None and not (
            (isinstance(layers, int) and not isinstance(layers, bool)) or isinstance(layers, str)
            or (isinstance(layers, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in layers))):
        raise fail("'layers' must be \"all\", \"0,3,5\", \"2-7\", an integer or a list of integers")
    try:
        seed = seed_value(entry.get("seed", 0))
    except ValueError as exc:
        raise fail(f"'seed' {exc}") from None
    if "atol" in entry and "tolerance" in entry:
        raise fail("give 'atol' or 'tolerance' (the same thing), not both")
    atol = entry.get("atol", entry.get("tolerance"))
    try:
        atol = None if atol is None else atol_value(atol)
    except ValueError as exc:
        raise fail(f"'atol' {exc}") from None
    logits, allow_pickle = entry.get("logits", False), entry.get("allow_pickle", False)
    require_real = entry.get("require_real", True)  # a project file is CI: random weights prove nothing there
    if not all(isinstance(flag, bool) for flag in (logits, allow_pickle, require_real)):
        raise fail("'logits', 'allow_pickle' and 'require_real' must be true or false")
    experts = entry.get("experts")
    if experts is not None and not (isinstance(experts, str) or (
            isinstance(experts, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in experts))):
        raise fail("'experts' must be \"all\", \"0,3\", \"2-5\" or a list of integers")
    mapping = entry.get("mapping")
    if mapping is not None and not Path(mapping).is_absolute():
        mapping = str(base / mapping)  # relative to the project file, like every path in it
    checkpoint = entry.get("checkpoint")
    if checkpoint is not None and not Path(checkpoint).is_absolute() and (base / checkpoint).exists():
        checkpoint = str(base / checkpoint)
    model = entry["model"]
    if not Path(model).is_absolute() and (base / model).exists():
        model = str(base / model)  # same rule as `parity MODEL`: an existing path wins over a name
    return CheckSpec(model=model, checkpoint=checkpoint, layers=layers, target=entry.get("target"), mapping=mapping,
                     revision=entry.get("revision"), seed=seed, atol=None if atol is None else float(atol),
                     name=entry.get("name"), logits=logits, allow_pickle=allow_pickle, experts=experts,
                     require_real=require_real, where=where)


def parse_shard(text: str) -> tuple[int, int]:
    """'2/4' -> (2, 4): this job runs the second of four shares."""
    try:
        k, n = (int(part) for part in text.split("/"))
    except ValueError:
        raise ShardError(f"--shard {text!r}: expected K/N, e.g. 1/4 (this job's number K of N jobs)") from None
    if not 1 <= k <= n:
        raise ShardError(f"--shard {text!r}: need 1 <= K <= N")
    return k, n


def shard_units(units: list, shard: tuple[int, int] | None) -> list:
    """Round-robin: unit i belongs to shard (i mod N) + 1.

    Units are (check, layer) pairs in file order and layer order, so the split is stable
    across jobs and runs, and one large check is spread over every job, not given to one.
    """
    if shard is None:
        return list(units)
    k, n = shard
    return [unit for i, unit in enumerate(units) if i % n == k - 1]
