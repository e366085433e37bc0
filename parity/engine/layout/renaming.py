"""Every checkpoint key as transformers' load-time conversion names it, worked out once per derivation.

``transformers.core_model_loading.rename_source_key`` applies a model's ``WeightRenaming``s and at most one
``WeightConverter`` to a key (a DeepSeek V3 checkpoint holds some 91,000); a derived layout asks it about the dense
units and the experts alike, so the answers are computed once and kept.

A converter that cuts one checkpoint tensor into several parameters along dim 0 (``Chunk(dim=0)``: HRM's and OLMo's
fused ``gate_up_proj`` / ``ff_proj`` on disk, gate and up in the module) fills each target parameter with one
chunk, in the order of its target patterns: ``Renamed.chunks`` says which.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn


@dataclass(frozen=True)
class Renamed:
    """checkpoint key -> (model parameter, the matched converter's source pattern or None), and the converters."""

    keys: dict[str, tuple[str, str | None]]
    converters: list[Any]

    def chunks(self) -> dict[str, tuple[str, tuple[int, int]]]:
        """Model parameter -> (checkpoint key, (index, count)) for each parameter a ``Chunk(dim=0)`` converter fills
        from one checkpoint tensor (its target patterns plain names, found in the parameter's name)."""
        from transformers.core_model_loading import Chunk

        found = {}
        by_pattern = {pattern: c for c in self.converters for pattern in c.source_patterns}
        for key, (own, pattern) in self.keys.items():
            converter = by_pattern.get(pattern)
            if converter is None or len(converter.source_patterns) != 1 or [
                    (type(op), getattr(op, "dim", None)) for op in converter.operations] != [(Chunk, 0)]:
                continue
            targets = list(converter.target_patterns)
            if not own.endswith(targets[0]):
                continue
            stem = own[:len(own) - len(targets[0])]
            for index, target in enumerate(targets):
                found[stem + target] = (key, (index, len(targets)))
        return found


def renamed_keys(model: nn.Module, keys: list[str]) -> Renamed:
    """``keys`` renamed by transformers' own load-time conversion for ``model``."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    conversions = get_model_conversion_mapping(model)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    state = model.state_dict()
    return Renamed({key: rename_source_key(key, renamings, converters, model.base_model_prefix, state)
                    for key in keys}, converters)
