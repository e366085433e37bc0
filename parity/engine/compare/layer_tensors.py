"""One layer's FFN tensors of both checkpoints of a compare, side by side, tensor by tensor.

Each side's layer is read under the reference's names (``read_side``: GGUF dequantized, Conv1D transposed, fused
halves split), each with how its checkpoint stores it (``conversion.Storage``).  ``tensor_rows`` then says per
tensor what the report's ``conversion.tensors`` holds: both dtypes and shapes, whether B's is A's bit for bit, how
far B's is from A's against how far the conversion alone moves it, and for a quantized B each value's distance in
its steps, its grid and its scales against A's.  Kept apart from the comparison, which judges the layer's function.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch

from parity.definitions.mistakes import MistakeId, diagnosis
from parity.definitions.records import Candidate, Diagnosis
from parity.engine.compare import conversion
from parity.engine.layer import FINGERPRINT_SCHEME, route_tensor, weights_fingerprint
from parity.engine.side import Side
from parity.errors import WeightDefectError

DIFFERS = 1e-6  # a tensor differs when max|B - A|/max|A| exceeds 2 x its conversion's own + this


@dataclass
class SideLayer:
    """One checkpoint's FFN tensors of one layer, under the reference's names, as stored (GGUF: dequantized)."""

    routed: dict[str, torch.Tensor]
    storage: dict[str, conversion.Storage]
    fingerprint: str | None = None  # of the stored tensors (weights_fingerprint), for a baseline's entry
    finite: bool = False  # read through the checked path: no NaN/Inf anywhere (no overflow to look for)
    facts: dict = field(default_factory=dict)  # what the read's one pass found, under the reference's names


def read_side(side: Side, layer: int, truth: bool, expert: int | None = None) -> SideLayer:
    """The layer's (expert's, for MoE) FFN tensors of one checkpoint, routed to the reference's names.  The truth
    (A) must be finite (a NaN there is bad input, exit 2); B's Inf is a finding (cast_overflow), so B is read raw."""
    routes = side.reader.reference_routes(layer)
    prefix = side.reader.layer_prefix(layer, expert)
    try:
        stored = side.read_layer(layer, expert, dtype=None)
        facts = side.reader.facts
    except WeightDefectError:
        if truth:
            raise
        sources = list(dict.fromkeys(r.source for r in routes))
        raw = (side.checkpoint.read([prefix + s for s in sources]) if expert is None
               else side.reader._read(prefix, sources, expert))  # stacked experts: sliced to this one
        stored, facts = {key[len(prefix):]: value for key, value in raw.items()}, None
    routed = {r.target: route_tensor(r, stored[r.source]) for r in routes}
    storage = {r.target: conversion.storage_of(side.checkpoint, prefix + r.source, stored[r.source], r, expert)
               for r in routes}
    named = {r.target: facts.get(r.source) for r in routes if r.chunk is None} if facts is not None else {}
    return SideLayer(routed, storage, weights_fingerprint(stored, facts), finite=facts is not None, facts=named)


def pair_fingerprint(a: SideLayer, b: SideLayer) -> str | None:
    """One fingerprint for both sides' stored layer: a baseline entry made from another A or another B is
    reported as made from other weights, never compared."""
    if a.fingerprint is None or b.fingerprint is None:
        return None
    digest = hashlib.blake2b(f"{a.fingerprint}|{b.fingerprint}".encode(), digest_size=8)
    return FINGERPRINT_SCHEME + digest.hexdigest()


# a compare has no --atol: a tolerance as large as the output is the conversion's own deviation


def tensor_rows(a: SideLayer, b: SideLayer) -> tuple[list[dict], dict[str, torch.Tensor], bool]:
    """Per tensor: how each side stores it, whether B's is bit-identical to A's, how far it is (relative) against
    how far its conversion alone moves it, and for a quantized B how many values lie beyond their step.  Also A's
    tensors converted as B stores them (float32), and whether every one of B's equals its conversion exactly."""
    rows, converted, exact = [], {}, True
    for name, ta in a.routed.items():
        tb, store = b.routed[name], b.storage[name]
        row: dict[str, Any] = {"name": name, "a_dtype": a.storage[name].dtype, "storage": store.dtype,
                               "a_shape": list(ta.shape), "b_shape": list(tb.shape), "identical": False,
                               "relative_distance": None, "conversion": None, "conversion_distance": None,
                               "differs": True, "steps": None, "step_source": store.step_source, "grid": None,
                               "ulps": None, "scale": None, "overflow": None}
        rows.append(row)
        if ta.shape != tb.shape:
            exact = False
            continue
        row["identical"] = ta.dtype == tb.dtype and bool(torch.equal(ta, tb))
        row["overflow"] = None if b.finite else conversion.overflow(ta, tb, store.dtype)
        a32, b32 = ta.float(), tb.float()
        scale = float(a32.abs().max()) if a32.numel() else 0.0
        converted[name], row["conversion"], a_steps = conversion.reference_conversion(ta, store)
        row["conversion_distance"] = conversion.relative_distance(converted[name], a32, scale=scale)
        same = bool(torch.equal(converted[name], b32))
        exact = exact and same
        row["relative_distance"] = (row["conversion_distance"] if same else
                                    conversion.relative_distance(b32, a32, scale=scale))
        row["differs"] = not row["identical"] and not (
            row["relative_distance"] <= 2 * row["conversion_distance"] + DIFFERS)
        if store.quantized and store.steps is not None and store.steps.shape == ta.shape:
            allowed, row["grid"] = conversion.quantized_bounds(a32, b32, store, row["a_dtype"], a_steps)
            if a_steps is not None:  # A quantized from A alone: where B holds that, the format's quantizer put it
                allowed = conversion.as_converted(allowed, a32, b32, converted[name])
                # and B holding all of it is on the grid that quantizer chose for A's values, whatever its codes
                # look like (K-quants beside 4 columns x300: quiet sub-blocks hold 1 to 3 codes, read as "codes on
                # one level in 2" on 606 of 768 rows)
                if same:
                    row["grid"] = None
            row["steps"] = conversion.step_excess(a32, b32, store.steps, allowed)
            if store.group is not None and row["steps"]["values_beyond_step"]:  # held to its values: it differs
                row["differs"] = True
        # values moved by more than a step (each block's scale refit to A's), or steps wide enough to hide a factor
        if (store.importance is not None or store.group is not None or store.nearest) \
                and ta.dim() == 2:
            row["scale"] = conversion.scale_excess(a32, b32, store, converted[name])
        elif not store.quantized and not same:  # each value of a cast or re-save held to its own rounding
            row["ulps"] = conversion.ulp_excess(converted[name], b32, store.dtype)
    return rows, converted, exact


def shape_finding(a: SideLayer, b: SideLayer) -> Diagnosis | None:
    """A tensor of B whose shape is not A's: transposed (A's shape reversed), truncated (smaller along a
    dimension, holding A's leading values), or another shape (shape_mismatch)."""
    for name, ta in a.routed.items():
        tb = b.routed[name]
        if ta.shape == tb.shape:
            continue
        shapes = f"{name}: A {list(ta.shape)}, B {list(tb.shape)}"
        if ta.dim() == 2 and tuple(tb.shape) == tuple(reversed(ta.shape)):
            distance = conversion.relative_distance(tb.t(), ta)
            return diagnosis(MistakeId.TENSOR_TRANSPOSED, None, None,
                             f"{shapes}; B transposed back is {distance:.2e} (relative) from A",
                             [Candidate(str(MistakeId.TENSOR_TRANSPOSED), f"{name}.T", distance)])
        if tb.dim() == ta.dim() and all(sb <= sa for sb, sa in zip(tb.shape, ta.shape, strict=True)):
            lead = ta[tuple(slice(0, s) for s in tb.shape)]
            distance = conversion.relative_distance(tb, lead)
            return diagnosis(MistakeId.TENSOR_TRUNCATED, None, None,
                             f"{shapes}; B is {distance:.2e} (relative) from A's leading block of that shape",
                             [Candidate(str(MistakeId.TENSOR_TRUNCATED), f"{name} = A's leading block", distance)])
        return diagnosis(MistakeId.SHAPE_MISMATCH, None, None, shapes)
    return None


def group_tensors(a: SideLayer, b: SideLayer) -> dict:
    """Each integer group-quantized tensor of B's layer: (A's values, B's, B's grid), in the layout the file stores,
    for ``group_grid.layer_factor``."""
    found = {}
    for name, store in b.storage.items():
        x = conversion.stored_layout(store.route, a.routed[name].float()) if store.group is not None else None
        held = conversion.stored_layout(store.route, b.routed[name].float()) if x is not None else None
        if held is not None and held.shape == x.shape:
            found[name] = (x, held, store.group)
    return found
