"""The built-in mappings (``mappings/*.toml``, shipped in the wheel): parsed once per process, looked up by
name or by a config's ``model_type``.
"""

from __future__ import annotations

import functools

from parity.definitions.datafiles import NOT_MAPPINGS, builtin_mapping_dir
from parity.definitions.mapping import Mapping
from parity.definitions.mapping_parser import load_mapping
from parity.errors import MappingError


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
    sources = [r.source for r in mapping.tensors if not r.optional and r.reads]
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
        "Write a mapping file for it and pass it with --mapping FILE.toml (docs/own-module.md)."
    )
