"""MODEL argument -> (mapping, checkpoint, transformers config).

MODEL may be a mapping name (its default hub checkpoint, or the synthetic stand-in when
the hub cannot be reached), a hub id, a local folder, a .safetensors or .gguf file, or
(with allow_pickle) a folder of pickle-based weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parity.sources.checkpoint import Checkpoint
from parity.sources.registry import open_local
from parity.errors import CheckpointError, EmptyValueError, GatedRepoError, MappingError, OfflineError, UnknownModelError
from parity.spec.mapping import Mapping, builtin_mappings, fits, load_mapping, mapping_for_model_type


@dataclass
class Resolved:
    model: str
    mapping: Mapping
    checkpoint: Checkpoint
    config: Any
    notes: list[str] = field(default_factory=list)


def open_checkpoint(spec: str, revision: str | None = None, allow_pickle: bool = False) -> Checkpoint:
    """MODEL or --checkpoint: an existing path (or one that looks like a path), else a hub id."""
    path = Path(spec).expanduser()
    if path.exists() or spec.startswith((".", "/", "~")) or spec.endswith((".safetensors", ".bin", ".pth", ".gguf")):
        return open_local(path, allow_pickle=allow_pickle)
    from parity.sources.hub import looks_like_hub_id, open_hub

    if not looks_like_hub_id(spec):
        raise UnknownModelError(f"'{spec}' is neither a mapping name, an existing path nor a hub id (owner/name)")
    return open_hub(spec, revision)


def require_values(**given: object) -> None:
    """An empty string is never a usable MODEL, checkpoint, mapping or revision; treated as absent, it
    would quietly turn into another question (`--checkpoint ''` checks MODEL as a hub id)."""
    for name, value in given.items():
        if isinstance(value, str) and not value.strip():
            raise EmptyValueError(f"{name} is empty ({value!r}): {EMPTY_HINTS[name]}")


EMPTY_HINTS = {"model": "give a mapping name (see `parity list`), a hub id (owner/name) or a local path",
               "checkpoint": "give a local path or a hub id (owner/name), or leave it out to use the mapping's default",
               "mapping": "give the path of a mapping file (FILE.toml), or leave it out to use the built-in one",
               "revision": "give a branch, tag or commit, or leave it out for the default branch"}


def resolve(model: str, checkpoint: str | None = None, mapping: str | Path | None = None,
            revision: str | None = None, allow_pickle: bool = False) -> Resolved:
    require_values(model=model, checkpoint=checkpoint, mapping=mapping, revision=revision)
    mappings = builtin_mappings()
    chosen = load_mapping(mapping) if mapping is not None else None
    notes: list[str] = []
    named = mappings.get(model) if not Path(model).expanduser().exists() else None
    if named is not None and chosen is None:
        chosen = named
    if checkpoint is None and named is not None:
        ckpt = _default_checkpoint(named, revision)
    else:
        spec = checkpoint or model
        if named is None and checkpoint is None and "/" not in model and not Path(model).expanduser().exists():
            raise UnknownModelError(
                f"'{model}' is not a mapping name ({', '.join(sorted(mappings))}), a local path, or a hub id (owner/name)."
                " Run `parity list` to see the mappings."
            )
        ckpt = open_checkpoint(spec, revision, allow_pickle)
    model_type = ckpt.raw_config.get("model_type")
    if chosen is None:
        chosen = mapping_for_model_type(model_type, ckpt.has)
    elif mapping is None and not fits(chosen, ckpt.has):  # `parity llama --checkpoint x.gguf`: the family's GGUF mapping
        sibling = _fitting_mapping(model_type, ckpt)
        if sibling is not None:
            notes.append(f"this checkpoint stores mapping '{chosen.name}''s tensors under other names; "
                         f"using mapping '{sibling.name}' of the same family")
            chosen = sibling
    if model_type not in chosen.model_types:
        notes.append(f"config.json says model_type={model_type!r}, which mapping '{chosen.name}' "
                     f"does not list ({', '.join(chosen.model_types)}); using it as asked")
    config = load_config(ckpt)
    notes.extend(ckpt.notes)
    notes.extend(chosen.notes)
    notes.extend(activation_override_notes(ckpt.raw_config, config))
    return Resolved(model, chosen, ckpt, config, notes)


def _fitting_mapping(model_type: str | None, ckpt: Checkpoint) -> Mapping | None:
    try:
        candidate = mapping_for_model_type(model_type, ckpt.has)
    except MappingError:
        return None
    return candidate if fits(candidate, ckpt.has) else None


def _default_checkpoint(mapping: Mapping, revision: str | None) -> Checkpoint:
    from parity.sources.hub import open_hub
    from parity.sources.synthetic import synthetic_checkpoint

    if not mapping.default_checkpoint:
        raise UnknownModelError(f"mapping '{mapping.name}' names no default_checkpoint; pass --checkpoint PATH_OR_ID")
    try:
        return open_hub(mapping.default_checkpoint, revision)
    except (OfflineError, GatedRepoError) as exc:
        if mapping.synthetic_config is None:
            raise
        why = "gated" if isinstance(exc, GatedRepoError) else "not reachable and not cached"
        return synthetic_checkpoint(
            mapping,
            f"SYNTHETIC weights: the default checkpoint {mapping.default_checkpoint} is {why}; "
            f"random weights with its real shapes and on-disk format stand in. "
            f"Pass --checkpoint to check real weights.",
        )


def load_config(ckpt: Checkpoint) -> Any:
    from transformers import AutoConfig

    from parity.sources.skeleton import quiet_transformers

    quiet_transformers()
    model_type = ckpt.raw_config.get("model_type")
    try:
        if ckpt.config_dir is not None:
            return AutoConfig.from_pretrained(str(ckpt.config_dir))
        return AutoConfig.for_model(model_type, **{k: v for k, v in ckpt.raw_config.items() if k != "model_type"})
    except Exception as exc:  # transformers raises ValueError/KeyError/OSError for unusable configs
        raise CheckpointError(
            f"{ckpt.location}: transformers cannot load its config "
            f"(model_type={model_type!r}): {type(exc).__name__}: {' '.join(str(exc).split())}"
        ) from None


def activation_override_notes(raw: dict, config: Any) -> list[str]:
    """Where transformers runs another activation than config.json names (Gemma 1's 'gelu')."""
    from parity.spec.families import ACTIVATION_ATTRS

    notes = []
    for attr in ACTIVATION_ATTRS:
        said = raw.get(attr)
        runs = getattr(config, attr, None)
        if isinstance(said, str) and isinstance(runs, str) and said != runs:
            notes.append(f"config.json says {attr}={said!r}; transformers overrides it to {runs!r}")
    return notes
