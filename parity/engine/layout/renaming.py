"""Every checkpoint key as transformers' load-time conversion names it, worked out once per derivation.

``transformers.core_model_loading.rename_source_key`` applies a model's ``WeightRenaming``s and at most one
``WeightConverter`` to a key (a DeepSeek V3 checkpoint holds some 91,000); a derived layout asks it about the dense
units and the experts alike, so the answers are computed once and kept.

A converter that cuts one checkpoint tensor into several parameters along dim 0 (``Chunk(dim=0)``: HRM's and OLMo's
fused ``gate_up_proj`` / ``ff_proj`` on disk, gate and up in the module) fills each target parameter with one
chunk, in the order of its target patterns: ``Renamed.chunks`` says which.

A converter that takes several source tensors of which a checkpoint holds only the first (Inkling 2 Loop's expert
dequantization reads ``w13_weight`` with its scales, amax and denominator; a checkpoint saved unquantized holds only
``w13_weight``) is reduced to what it does to that one tensor: each operation is run on a random tensor alone, and one
that returns it unchanged is dropped (``lone_source``).  What is left is read as any converter; nothing left, a
renaming.
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
    renamed = {key: rename_source_key(key, renamings, converters, model.base_model_prefix, state) for key in keys}
    held = {pattern for _, pattern in renamed.values()}
    reduced = {id(c): lone_source(c) for c in converters
               if len(c.source_patterns) > 1 and held.intersection(c.source_patterns) == {c.source_patterns[0]}}
    if not reduced:
        return Renamed(renamed, converters)
    renaming_only = {c.source_patterns[0] for c in converters if id(c) in reduced and reduced[id(c)] is None}
    renamed = {key: (own, None if pattern in renaming_only else pattern) for key, (own, pattern) in renamed.items()}
    return Renamed(renamed, [reduced.get(id(c), c) for c in converters if reduced.get(id(c), c) is not None])


# every dimension odd, above 2 and unlike the others: an operation that reorders, halves or swaps any dimension
# changes this tensor (on [2, 4, 6], Interleave(dim=0) returned it unchanged and would have been dropped)
PROBE = (3, 5, 7)


def lone_source(converter: Any) -> Any:
    """``converter`` given only its first source tensor: a converter of that tensor alone with the operations that
    change it (each run on a random tensor, kept unless it returns that tensor unchanged), or None where none does."""
    import torch
    from transformers.core_model_loading import WeightConverter

    source, targets = converter.source_patterns[0], list(converter.target_patterns)
    kept = []
    for op in converter.operations:
        probe = torch.randn(PROBE, generator=torch.Generator().manual_seed(0))
        try:
            out = op.convert({source: [probe]}, [source], targets)
        except Exception:  # an operation that cannot take the tensor alone changes it: kept, read as it is
            kept.append(op)
            continue
        values = list(out.values()) if isinstance(out, dict) else []
        lone = values[0][0] if len(values) == 1 and isinstance(values[0], list) else values[0] if values else None
        if not (len(values) == 1 and isinstance(lone, torch.Tensor) and lone.shape == probe.shape
                and torch.equal(lone, probe)):
            kept.append(op)
    if not kept:
        return None
    return WeightConverter(source_patterns=source, target_patterns=targets, operations=kept)
