"""Every checkpoint key as transformers' load-time conversion names it, worked out once per derivation.

``transformers.core_model_loading.rename_source_key`` applies a model's ``WeightRenaming``s and at most one
``WeightConverter`` to a key (a DeepSeek V3 checkpoint holds some 91,000); a derived layout asks it about the dense
units and the experts alike, so the answers are computed once and kept.
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
