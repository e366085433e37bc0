"""MODEL argument -> (mapping, checkpoint, transformers config).

MODEL may be a mapping name (its default hub checkpoint, or the synthetic stand-in when
the hub cannot be reached), a hub id, a local folder, a .safetensors or .gguf file, or
(with allow_pickle) a folder of pickle-based weights.
"""

from __future__ import annotations

import errno
import re
import string
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parity.definitions.files import shown
from parity.definitions.mapping import ConfigValue, Mapping
from parity.definitions.mapping_parser import load_mapping
from parity.definitions.registry import builtin_mappings, fits, mapping_for_model_type, mappings_for_model_type
from parity.errors import (
    CheckpointError,
    EmptyValueError,
    GatedRepoError,
    MappingError,
    OfflineError,
    UnknownModelError,
    UsageError,
)
from parity.sources.checkpoint import Checkpoint
from parity.sources.config_check import (
    MAX_EXPERTS,
    MAX_WIDTH,
    check_activation,
    check_config_values,
    config_where,
    int_problem,
    short,
)
from parity.sources.registry import open_local


@dataclass
class Resolved:
    model: str
    mapping: Mapping
    checkpoint: Checkpoint
    config: Any
    notes: list[str] = field(default_factory=list)


def open_checkpoint(location: str, revision: str | None = None, allow_pickle: bool = False, *,
                    revision_option: str = "--revision") -> Checkpoint:
    """MODEL or --checkpoint: an existing path (or one that looks like a path), else a hub id.  A revision given
    with a local path is refused (``revision_option`` names it as the user gave it): ignored, it would let a user
    believe they checked another commit."""
    path = Path(location).expanduser()
    looks_local = location.startswith((".", "/", "~")) or location.endswith((".safetensors", ".bin", ".pth", ".gguf"))
    if looks_local or path_exists(path):
        if revision is not None:
            raise UsageError(f"{revision_option} {shown(revision)}: '{shown(location)}' is a local path, and a "
                             "revision names a commit, branch or tag of a hub repository; leave the revision out, or "
                             "give the hub id (owner/name) to read that revision")
        return open_local(path, allow_pickle=allow_pickle)
    from parity.sources.hub import looks_like_hub_id, open_hub

    if not looks_like_hub_id(location):
        raise UnknownModelError(f"'{shown(location)}' is neither a mapping name, an existing path nor a hub id "
                                "(owner/name)")
    try:
        return open_hub(location, revision)
    except (UnknownModelError, OfflineError) as exc:  # 'ckpt/model' is a relative path as much as a hub id
        found = "no such hub repository" if isinstance(exc, UnknownModelError) else "no such hub repository cached"
        raise type(exc)(f"'{location}': no such folder ({path.resolve()}), and {found}: {exc}") from None


def path_exists(path: Path) -> bool:
    """Whether something is at ``path``; one that cannot even be looked at (a parent folder without permission)
    counts as there: opening it then says why it cannot be read."""
    try:
        return path.exists()
    except OSError as exc:
        return exc.errno != errno.ENAMETOOLONG


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


def resolve(model: str, checkpoint: str | None = None, mapping: str | Path | Mapping | None = None,
            revision: str | None = None, allow_pickle: bool = False, *, revision_option: str = "--revision"
            ) -> Resolved:
    require_values(model=model, checkpoint=checkpoint, mapping=mapping, revision=revision)
    mappings = builtin_mappings()
    chosen = mapping if isinstance(mapping, Mapping) else load_mapping(mapping) if mapping is not None else None
    notes: list[str] = []
    named = mappings.get(model) if not path_exists(Path(model).expanduser()) else None
    if named is None and model in mappings and checkpoint is None:  # a folder here bears a mapping's name
        notes.append(f"'{model}' is a local path here ({Path(model).resolve()}), checked as such instead of mapping "
                     f"'{model}''s default {mappings[model].default_checkpoint}; for that one, run from another "
                     f"folder or pass --checkpoint {mappings[model].default_checkpoint}")
    if named is not None and chosen is None:
        chosen = named
    if checkpoint is None and named is not None:
        ckpt = _default_checkpoint(named, revision)
    else:
        location = checkpoint or model
        if named is None and checkpoint is None and "/" not in model and not path_exists(Path(model).expanduser()):
            raise UnknownModelError(
                f"'{shown(model)}' is not a mapping name ({', '.join(sorted(mappings))}), a local path, "
                "or a hub id (owner/name). Run `parity list` to see the mappings."
            )
        ckpt = open_checkpoint(location, revision, allow_pickle, revision_option=revision_option)
    check_raw_config(ckpt)
    model_type = ckpt.raw_config.get("model_type")
    served = mappings_for_model_type(model_type)
    if chosen is None and (not served or is_gguf(ckpt) and not any(fits(m, ckpt.has) for m in served)):
        chosen = derived_mapping(ckpt)  # no mapping file (that fits a GGUF): transformers' own model says
    if chosen is None:
        chosen = mapping_for_model_type(model_type, ckpt.has)
    elif mapping is None and not fits(chosen, ckpt.has):
        # `parity llama --checkpoint x.gguf`: the family's GGUF mapping, or the layout derived in GGUF names
        sibling = _fitting_mapping(model_type, ckpt)
        if sibling is None and is_gguf(ckpt):
            sibling = derived_mapping(ckpt)
        if sibling is not None:
            notes.append(f"this checkpoint stores mapping '{chosen.name}''s tensors under other names; "
                         f"using mapping '{sibling.name}' of the same family")
            chosen = sibling
    if model_type not in chosen.model_types:
        notes.append(f"config.json says model_type={model_type!r}, which mapping '{chosen.name}' "
                     f"does not list ({', '.join(chosen.model_types)}); using it as asked")
    config = load_config(ckpt)
    check_sizes(chosen, ckpt, config)
    if mapping is None:  # a built-in default target that cannot express this FFN refuses in one line
        from parity.engine.layout.derive import expressible

        chosen = expressible(chosen, config)
    notes.extend(ckpt.notes)
    notes.extend(chosen.notes)
    notes.extend(activation_override_notes(ckpt.raw_config, config))
    return Resolved(model, chosen, ckpt, config, notes)


def is_gguf(ckpt: Checkpoint) -> bool:
    from parity.sources.gguf import GGUFCheckpoint

    return isinstance(ckpt, GGUFCheckpoint)


def derived_mapping(ckpt: Checkpoint) -> Mapping:
    """The layout transformers' own model implies (``layout.derive``); for a GGUF file, spelled in the names gguf's
    own map gives its architecture (``layout.gguf``)."""
    if is_gguf(ckpt):
        from parity.engine.layout.gguf import derive_gguf_mapping

        return derive_gguf_mapping(ckpt, load_config)
    from parity.engine.layout.derive import derive_mapping

    return derive_mapping(ckpt, load_config)


def _fitting_mapping(model_type: str | None, ckpt: Checkpoint) -> Mapping | None:
    try:
        candidate = mapping_for_model_type(model_type, ckpt.has)
    except MappingError:
        return None
    return candidate if fits(candidate, ckpt.has) else None


CHECK_ADVICE = "Pass --checkpoint to check real weights."  # a check's way out of the stand-in
COMPARE_ADVICE = "Give each side as a local path or a reachable hub id to compare real weights."  # a compare's


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
            f"random weights with its real shapes and on-disk format stand in. {CHECK_ADVICE}",
        )


def check_raw_config(ckpt: Checkpoint) -> None:
    """The config's values, checked before transformers or parity uses them (``sources.config_check``)."""
    where = config_where(ckpt.location, ckpt.config_dir)
    check_config_values(ckpt.raw_config, where, len(ckpt.weight_map))
    check_activation(ckpt.raw_config, where)


def check_sizes(mapping: Mapping, ckpt: Checkpoint, config: Any) -> None:
    """The mapping's sizes, as read from the config, against what the checkpoint holds: its last layer's (and
    last expert's) tensors must exist, and the inputs' width must be the one transformers' MLP takes.  A
    million layers claimed over three layers of weights is refused here, before anything is built or iterated."""
    count = _mapping_int(mapping, config, mapping.num_layers, "num_layers", MAX_WIDTH)
    last = max((i for i in mapping.layers or () if i < count), default=count - 1)  # the last it serves
    if not _holds(mapping, ckpt, last, 0):
        held = layers_held(mapping, ckpt.weight_map)
        raise _size_error(mapping, mapping.num_layers, "num_layers", count,
                          f"the checkpoint holds no tensor of layer {count - 1} (none under "
                          f"'{mapping.key_prefixes[0]}{mapping.layer_prefix(count - 1)}.'); it holds layers "
                          f"{'0-' + str(held - 1) if held else '(none under this mapping)'}")
    if mapping.experts is not None:
        experts = _mapping_int(mapping, config, mapping.experts.count, "experts.count", MAX_EXPERTS)
        first = mapping.first_layer
        if "{expert}" in mapping.layer_key and not _holds(mapping, ckpt, first, experts - 1):
            raise _size_error(mapping, mapping.experts.count, "experts.count", experts,
                              f"the checkpoint holds no tensor of layer {first}'s expert {experts - 1}")
    width = _mapping_int(mapping, config, mapping.hidden_size, "hidden_size", MAX_WIDTH)
    stated = getattr(config, "hidden_size", None)
    if isinstance(stated, int) and not isinstance(stated, bool) and stated != width:
        raise MappingError(f"{mapping.where('hidden_size')}: key 'hidden_size' gives {width}, but the checkpoint's "
                           f"config says hidden_size = {stated}: the inputs are [batch, tokens, hidden_size] and "
                           "transformers' MLP takes config.hidden_size; leave the key out or fix it")


def _mapping_int(mapping: Mapping, config: Any, size: Any, key: str, maximum: int) -> int:
    value = ConfigValue(config, mapping.path)(size, key)
    why = int_problem(value, 1, maximum)
    if why is not None:
        raise _size_error(mapping, size, key, value, why)
    return value


def _size_error(mapping: Mapping, size: Any, key: str, value: Any, why: str) -> Exception:
    """A size the mapping states as a literal is the mapping's error; one read from the config, the checkpoint's."""
    if not isinstance(size, (str, dict)):
        return MappingError(f"{mapping.where(key)}: key '{key}' = {short(value)}: {why}; fix the mapping")
    source = size if isinstance(size, str) else size.get("config")
    return CheckpointError(f"{mapping.path.name} reads '{key}' from {source} = {short(value)}: {why}; the checkpoint's "
                           "config does not describe its weights (fix the config, or use the one that came with them)")


def _holds(mapping: Mapping, ckpt: Checkpoint, layer: int, expert: int) -> bool:
    prefixes = tuple(f"{p}{mapping.layer_prefix(layer, expert)}." for p in mapping.key_prefixes)
    return any(name.startswith(prefixes) for name in ckpt.weight_map)


def layers_held(mapping: Mapping, names: Iterable[str]) -> int:
    """1 + the highest layer index under the mapping's layer_key among ``names`` (0: none)."""
    pattern = "".join(re.escape(literal) + ({"layer": r"(\d+)", "expert": r"\d+"}.get(field or "", ""))
                      for literal, field, _, _ in string.Formatter().parse(mapping.layer_key))
    prefixes = "|".join(re.escape(p) for p in mapping.key_prefixes)
    found = (re.match(f"(?:{prefixes}){pattern}\\.", name) for name in names)
    return max((int(m.group(1)) + 1 for m in found if m), default=0)


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
            f"{config_where(ckpt.location, ckpt.config_dir)}: transformers cannot load this config "
            f"(model_type={model_type!r}): {type(exc).__name__}: {' '.join(str(exc).split())[:600]}"
        ) from None


def activation_override_notes(raw: dict, config: Any) -> list[str]:
    """Where transformers runs another activation than config.json names (Gemma 1's 'gelu')."""
    from parity.definitions.families import ACTIVATION_ATTRS

    notes = []
    for attr in ACTIVATION_ATTRS:
        said = raw.get(attr)
        runs = getattr(config, attr, None)
        if isinstance(said, str) and isinstance(runs, str) and said != runs:
            notes.append(f"config.json says {attr}={said!r}; transformers overrides it to {runs!r}")
    return notes
