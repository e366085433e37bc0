"""``parity compare A B``: checkpoint B (converted, re-saved, cast, quantized) judged against checkpoint A, one
layer at a time, as functions.

Both checkpoints are resolved as a check resolves one (``engine.layout.resolve``: format, layout, config), each
held as an ``engine.side.Side`` (no target, device or tolerance: what a check adds), and each layer's FFN tensors
are read under transformers' own names through that checkpoint's layout (``Side.read_layer`` and its reference
routes: GGUF dequantized and renamed, Conv1D transposed, fused halves split).  The oracle is
transformers' MLP built from A's config: filled with A's layer it is the truth, the same class filled with B's
layer the candidate.  Both run on parity's seeded inputs in float64; the float32 noise floor is A's MLP in
float32 against float64, as in a check.

The tolerance is what B's storage can honestly change (``conversion.py``): A's tensors converted the way B
stores them (nothing for the same dtype; rounded to B's dtype; re-quantized to B's GGUF type), run through
the same MLP, deviate from the truth by the *conversion deviation*; B passes when
``max|B - A| <= max(16 x noise floor, F x conversion deviation)``, every value of B is what its storage
can make of A's (a quantized value within its block's step, on a grid no coarser than the format's quantizer
chooses for A; a cast's within one ulp of A's cast), and nothing overflowed (F: ``CAST_FACTOR`` for a cast,
``QUANT_FACTOR`` for a quantization).  A failing layer is explained by replaying known conversion mistakes on A's
tensors (converted as B stores them) and naming the one B reproduces.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from parity import __version__
from parity.definitions.families import configured_activation
from parity.definitions.mistakes import MistakeId, diagnosis
from parity.definitions.project import CompareSpec
from parity.definitions.records import Candidate, Diagnosis
from parity.definitions.selection import Selection, parse_selection
from parity.engine.block import BLOCK_UNIT
from parity.engine.compare import conversion, folds, gguf_grid, group_grid
from parity.engine.compare.blocks import BlockComparison
from parity.engine.compare.findings import (
    activations_differ,
    beyond_finding,
    block_finding,
    block_replay_finding,
    grid_finding,
    group_replay_finding,
    permutation_finding,
    scale_finding,
)
from parity.engine.compare.inventory import inventory
from parity.engine.compare.layer_tensors import (
    SideLayer,
    group_tensors,
    pair_fingerprint,
    read_side,
    shape_finding,
    tensor_rows,
)
from parity.engine.compare.mistakes import Hypothesis, hypotheses
from parity.engine.compare.report import CompareLayer, CompareReport, conversion_record, unloadable
from parity.engine.inputs import make_inputs
from parity.engine.layout.resolve import CHECK_ADVICE, COMPARE_ADVICE, require_values, resolve
from parity.engine.memory import young_objects_only
from parity.engine.reference import activation_name
from parity.engine.results import LayerResult, Report
from parity.engine.side import Side, run_reference
from parity.engine.upcast import compute_in
from parity.engine.verdict import Runs, judge, parity_tolerance, unverifiable_reason
from parity.errors import (
    LayerRangeError,
    MappingError,
    MissingTensorError,
    ParityError,
    QuantizedLayoutError,
    SyntheticWeightsError,
    UsageError,
)
from parity.sources.skeleton import reference_label

QUANT_FACTOR = 2.0  # a quantized B passes within this x the deviation re-quantizing A's tensors causes
CAST_FACTOR = 4.0  # a cast B within this x the deviation rounding A's tensors to B's dtype causes
NEIGHBOURS = 2  # a shifted layer is searched this many layers either side


CONVERSION_TOO_LARGE = "A converted as B stores it deviates that far: B's storage cannot carry this layer's function"
BY_VALUES = "judged by its values"  # a layer whose function cannot tell a mistake at B's width (by_values)
EXPLAINS = 0.5  # a replay names the mistake only when B is at most this fraction of its distance from A away from it
# ... and for a GPTQ export, whose distance from a replay (round to nearest) keeps all that its compensation moved it,
# this: the tests' GPTQ-like int4 export in groups of 128 on a broad calibration with four channels x30
# (test_quantized_gptq_outliers.broad_hessian), gate and up exchanged, lies 6.58 from the exchange replay and 11.0
# from A (0.60; its faithful layers lie 3.7 to 3.9 x round to nearest's deviation from A) and was named tensor_scaled
# x 0.0013 (a least-squares factor of unrelated tensors); the replay that explained nothing moved A 0.94 of the way
EXPLAINS_GPTQ = 0.7


class Comparison:
    """Both checkpoints resolved once; ``compare_layer`` then judges one layer at a time."""

    def __init__(self, a: str, b: str, *, revision: str | None = None, revision_b: str | None = None,
                 allow_pickle: bool = False, seed: int = 0, experts: Selection = None, require_real: bool = False):
        require_values(model=a, revision=revision)
        require_values(model=b, revision=revision_b)
        self.a = Side(resolve(a, revision=revision, allow_pickle=allow_pickle))
        try:
            resolved_b = resolve(b, revision=revision_b, allow_pickle=allow_pickle, revision_option="--revision-b")
        except MappingError as exc:  # B lacks what its own layout needs: read B as A is, naming what B lacks
            resolved_b = resolve_like(self.a, b, exc, revision=revision_b, allow_pickle=allow_pickle)
        self.b = Side(resolved_b)
        self.labels = (a, b)
        if require_real:
            require_real_sides(self.a, self.b, self.labels)
        self.seed = seed
        self.require_same_experts()
        self.require_same_ffn()
        self.experts = self.a.expert_indices(experts)  # [None] for a dense model; the selected experts for MoE
        self.parts = [self.part(a, b, experts) for a, b in self.paired_parts()]
        routed = [(c.a, c.b) for c in (self, *self.parts) if c.a.num_experts is not None]
        # MoE: each layer's whole block too, unless the run selects experts (then those experts are what it judges)
        units = [c.a.mapping.reference_module for c in (self, *self.parts)]
        self.blocks = (BlockComparison(*routed[0], units=units, seed=seed) if routed and experts in (None, "all")
                       else None)
        self.expert_map: dict[int, list[int]] = {}  # layer -> B's expert e holds A's expert map[e] (a permutation)
        self.same_files = same_files(self.a, self.b)
        self.notes = self.config_notes() + ([
            f"A and B are the same files ({self.a.checkpoint.location}): a pass shows only that parity reads them; it "
            "proves nothing about a conversion (give B as the converted, cast or re-saved copy)"]
            if self.same_files else [])

    def require_same_experts(self) -> None:
        """Both dense, or both a mixture of the same number of experts per layer."""
        counts = (self.a.num_experts, self.b.num_experts)
        if counts[0] != counts[1]:
            spelled = ["dense" if n is None else f"a mixture of {n} experts per layer" for n in counts]
            raise UsageError(f"{self.labels[1]} is no conversion of {self.labels[0]}: A's FFN is {spelled[0]}, B's "
                             f"{spelled[1]}; `parity compare` judges two stores of one model's layers")

    def paired_parts(self) -> list[tuple[Side, Side]]:
        """A's further layouts (dense layers, shared experts) with B's: the same units, or B is another model."""
        units = [[(p.mapping.unit, p.mapping.layers, p.num_experts) for p in side.parts] for side in (self.a, self.b)]
        if units[0] != units[1]:
            spelled = [", ".join(f"{unit or 'FFN'} of layers {list(layers or [])}" for unit, layers, _ in side) or
                       "none" for side in units]
            raise UsageError(f"{self.labels[1]} is no conversion of {self.labels[0]}: besides its main layout A's "
                             f"layers hold {spelled[0]}, B's {spelled[1]}; `parity compare` judges two stores of one "
                             "model's layers")
        return list(zip(self.a.parts, self.b.parts, strict=True))

    def part(self, a: Side, b: Side, experts: Selection) -> Comparison:
        """This comparison for one further layout of both sides (its units judged as the main layout's are)."""
        part = copy.copy(self)
        part.a, part.b, part.parts = a, b, []
        part.experts = a.expert_indices(experts if a.num_experts is not None else None)
        return part

    def units(self, layer: int) -> list[tuple[Comparison, int | None]]:
        """What is compared of a layer, in order: each layout serving it, each selected expert of one with experts."""
        return [(part, expert) for part in (self, *self.parts) if part.a.mapping.serves(layer)
                for expert in part.experts]

    def require_same_ffn(self) -> None:
        """B must hold A's model: an MLP of the same parameters and shapes in transformers (a Mistral exported to
        GGUF reads back as LLaMA's MLP, which has Mistral's parameters: that is one model)."""
        shapes = [dict(side.reference.tensor_shapes(side.mapping.reference_path(side.mapping.first_layer)))
                  for side in (self.a, self.b)]
        if shapes[0] != shapes[1]:
            spelled = [", ".join(f"{n} {list(s)}" for n, s in sorted(side.items())) for side in shapes]
            raise UsageError(f"{self.labels[1]} is no conversion of {self.labels[0]}: A's FFN has {spelled[0]}; B's "
                             f"has {spelled[1]}; `parity compare` judges two stores of one model's layers")

    def config_notes(self) -> list[str]:
        """Where B's config describes another model than A's (each such layer fails: config_changed, and a layer
        A has and B lacks: layer_missing)."""
        notes = [f"{change}: every layer fails as config_changed" for change in [self.config_change()] if change]
        if self.a.num_layers > self.b.num_layers:
            notes.append(f"A has {self.a.num_layers} layers, B {self.b.num_layers}: A's layers {self.b.num_layers} "
                         "and up fail as layer_missing")
        elif self.a.num_layers < self.b.num_layers:
            notes.append(f"A has {self.a.num_layers} layers, B {self.b.num_layers}: B's layers beyond A's are not "
                         "compared (A has nothing to judge them against)")
        return notes

    def config_change(self) -> str | None:
        """How B's config changes the FFN's function where its tensors cannot say: another activation.  Names are
        resolved through transformers' ACT2FN (what a model loading the config runs), so an alias of the same
        function ("swish" for "silu") is no change."""
        act_a, act_b = configured_activation(self.a.config), configured_activation(self.b.config)
        if act_a == act_b:
            return None
        differs = activations_differ(act_a, act_b)
        if differs is None:
            return None
        return f"B's config names activation {act_b!r}, A's {act_a!r}: a model loading B runs {act_b} ({differs})"

    @property
    def num_layers(self) -> int:
        """A's: every layer of the truth is judged; one B lacks fails as layer_missing."""
        return self.a.num_layers

    def run(self, layers: Selection = None, on_layer: Callable[[Report, LayerResult], None] | None = None
            ) -> CompareReport:
        """``run_comparison`` of these layers (what ``engine.suite`` calls for a project's compare)."""
        return run_comparison(self, layers, on_layer)

    def layers(self, selection: Selection) -> list[int]:
        try:
            return parse_selection(selection, self.num_layers)
        except LayerRangeError as exc:
            raise LayerRangeError(f"{exc} (A has {self.a.num_layers} layers, B {self.b.num_layers})") from None

    # -- running the oracle ---------------------------------------------------------------------------
    def run64(self, layer: int, tensors: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """transformers' MLP (A's config) holding ``tensors``, on ``x`` in float64."""
        module = self.a.reference_from(layer, tensors)
        with torch.no_grad():
            return compute_in(module, torch.float64)(x.double())

    def missing(self, layer: int, expert: int | None, mistake: MistakeId, detail: str,
                kind: str = "missing in B") -> CompareLayer:
        """A unit of A that B lacks (a layer, or a tensor of it), or holds in a layout that cannot be read as its
        config states (``kind``): failed, with the finding."""
        result = unloadable(layer, diagnosis(mistake, None, None, detail), [], self.a.checkpoint.weights)
        result.expert = expert
        result.conversion["kind"] = kind
        return result

    def compare_layer(self, layer: int, expert: int | None = None) -> CompareLayer:
        """One layer (one expert of it, for MoE) of B judged against A's."""
        a_expert = expert if expert is None else self.expert_map.get(layer, range(expert + 1))[expert]
        a = read_side(self.a, layer, truth=True, expert=a_expert)
        try:
            b = read_side(self.b, layer, truth=False, expert=expert)
        except MissingTensorError as exc:  # a conversion that dropped a tensor: B's finding, not bad input
            return self.missing(layer, expert, MistakeId.TENSOR_MISSING, str(exc))
        except QuantizedLayoutError as exc:  # B stores its quantized tensors otherwise than its config states
            return self.missing(layer, expert, MistakeId(exc.mistake_id), str(exc), kind=exc.kind)
        folds.undo(self.a, self.b, layer, a, b)  # AWQ's scales folded into the norm: B's FFN put back on A's input
        rows, converted, exact = tensor_rows(a, b)
        shaped = shape_finding(a, b)
        if shaped is not None:
            result = unloadable(layer, shaped, rows, self.a.checkpoint.weights)
            result.expert = expert
            result.fingerprint = pair_fingerprint(a, b)
            return result
        reference = self.a.reference_from(layer, a.routed)
        x = make_inputs(reference, self.a.hidden_size, self.seed, layer, expert)
        truth = run_reference(reference, x)
        del reference
        out_b = self.run64(layer, b.routed, x)
        changed = any(row["conversion"] != "as stored" for row in rows)
        # B holding exactly A's conversion (a faithful export) computes the conversion's output: no run of its own
        out_conv = out_b if exact else self.run64(layer, converted, x)
        conv_dev = float((out_conv - truth.out64).abs().max()) if changed else 0.0
        if not math.isfinite(conv_dev):  # A's values overflow B's dtype too: that is B's finding, not a bound
            conv_dev = 0.0
        noise = float((truth.out32 - truth.out64).abs().max())
        scale = float(truth.out64.abs().max())
        quantized = any(s.quantized for s in b.storage.values())
        factor = QUANT_FACTOR if quantized else CAST_FACTOR
        if any(s.levels is not None for s in b.storage.values()):  # a grid parity cannot read: B's own levels
            factor = conversion.LEVELS_FACTOR
        why = past = None
        if any(s.importance is not None for s in b.storage.values()):  # an importance-weighted GGUF quantizer
            levels = any(s.levels is not None and s.importance is not None for s in b.storage.values())
            factor = max(factor, gguf_grid.IMPORTANCE_LEVELS_FACTOR if levels else gguf_grid.IMPORTANCE_FACTOR)
            why = (f"B's metadata names an importance matrix (quantize.imatrix), in a type whose llama.cpp quantizer "
                   f"uses it: each value within {gguf_grid.IMPORTANCE_STEPS:g} steps of A's, each block's step within "
                   f"{gguf_grid.IMPORTANCE_GRID_FACTOR:g} x A's, B's least-squares factor on A near 1 (tensor, "
                   "row, block)")
        if any(s.group is not None for s in b.storage.values()):  # integer groups: GPTQ judged by the function
            factor, why, past = group_grid.layer_factor(
                group_tensors(a, b), room=scale / conv_dev if conv_dev else math.inf,
                ratio=float((out_b - truth.out64).abs().max()) / conv_dev if conv_dev else 0.0)
        tolerance = max(parity_tolerance(noise, scale, None), factor * conv_dev)
        runs = Runs(truth.out64, truth.out32, out_b, out_b)
        result = judge(layer, expert, runs, a.routed, truth.z, tolerance, self.a.checkpoint.weights, a.facts,
                       too_large=CONVERSION_TOO_LARGE)
        result = CompareLayer(**{f.name: getattr(result, f.name) for f in dataclasses.fields(LayerResult)})
        why = by_values(result, runs, a, b.storage, rows, conv_dev, past=past) or why
        result.conversion = conversion_record(rows, b.storage, conv_dev, result.max_abs_diff, factor, changed, why=why)
        result.fingerprint = pair_fingerprint(a, b)
        self.verdict(result, (layer, expert), a, b, x, truth.out64, rows)
        gc.collect()
        return result

    def verdict(self, result: CompareLayer, unit: tuple[int, int | None], a: SideLayer, b: SideLayer, x: torch.Tensor,
                out64: torch.Tensor, rows: list[dict]) -> None:
        """Findings about B's blocks first (a NaN/Inf scale, every code zero), then the config, overflow; a layer
        whose function differs beyond its tolerance is explained by replays of conversion mistakes, then by what its
        values show (a grid too coarse, values beyond their step or ulp); one within its tolerance only by these."""
        overflowed = [(row["name"], row["overflow"]) for row in rows if row.get("overflow")]
        beyond = [row for row in rows if (row.get("steps") or {}).get("values_beyond_step")
                  or (row.get("ulps") or {}).get("values_beyond_ulp")]
        scaled = any((row.get("scale") or {}).get("beyond") for row in rows)
        found = block_finding(rows, b.storage, result.max_abs_diff)
        if found is not None:  # a defect of B's blocks, read from its file: whatever the layer's tolerance
            result.passed, result.unverifiable, result.diagnosis = False, None, found
            return
        if result.unverifiable is not None:
            return
        changed = self.config_change()
        if changed is not None:  # B's tensors may be A's, but a model loading B computes another function
            result.passed = False
            result.diagnosis = diagnosis(MistakeId.CONFIG_CHANGED, None, result.max_abs_diff, changed)
            return
        if overflowed:
            cast = {row["name"] for row in rows
                    if row["a_dtype"] != row["storage"] and not b.storage[row["name"]].quantized}
            mistake = MistakeId.CAST_OVERFLOW if any(n in cast for n, _ in overflowed) else MistakeId.NONFINITE_VALUES
            result.passed = False
            result.diagnosis = diagnosis(mistake, None, result.max_abs_diff,
                                         "; ".join(f"{n}: {why}" for n, why in overflowed))
            return
        if result.passed and not beyond and not scaled and not any(row.get("grid") for row in rows):
            return
        # within its tolerance, a replay could only name what the function cannot show; but an integer group matrix
        # held to its values (group_grid: biased, no grid of A's, most codes moved) is a mistake the replays name
        # ... and one judged by its values (by_values), whose function passes whatever B holds
        replay = not result.passed or any(b.storage[row["name"]].group is not None for row in beyond) \
            or BY_VALUES in result.conversion["tolerance_rule"]
        result.passed = False
        result.diagnosis = self.explain(unit, a, b, x, out64, result.tolerance if replay else -math.inf,
                                        result.max_abs_diff or math.inf, rows, beyond)

    def explain(self, unit: tuple[int, int | None], a: SideLayer, b: SideLayer, x: torch.Tensor,
                out64: torch.Tensor, tolerance: float, reference_distance: float, rows: list[dict],
                beyond: list[dict]) -> Diagnosis:
        """Replay each conversion mistake on A's tensors, converted the way B stores them, and name the one B's
        output reproduces within the layer's tolerance and at most ``EXPLAINS`` times B's distance from A (a replay
        that moves A only a little toward B explains nothing: a grid 2.5x too coarse once read as tensor_scaled
        x1.004, 1.19 from B against A's 1.27); else a grid coarser than the format's quantizer makes of A, else a
        finding about the steps, else unexplained.  Only
        when no single-tensor replay explains it are A's other experts of the layer, then its neighbouring layers,
        read."""
        layer = unit[0]
        differing = [row["name"] for row in rows if row["differs"]]
        candidates: list[Candidate] = []
        best = None
        if tolerance >= 0:  # -inf: the layer's function is within its tolerance, no replay to run
            out_b = self.run64(layer, b.routed, x)
            best = self.replay_all(layer, hypotheses(a.routed, b.routed, b.storage, differing), a, b, x, out_b,
                                   candidates)
            for search in (self.expert_hypotheses, self.neighbour_hypotheses):
                if best is not None and best[0] <= tolerance:
                    break
                shifted = self.replay_all(layer, search(unit, a, b), a, b, x, out_b, candidates)
                if shifted is not None and (best is None or shifted[0] < best[0]):
                    best = shifted
        reach, explains = compensated(b.storage, biased=group_grid.any_biased(group_tensors(a, b)))
        if best is not None and best[0] <= min(tolerance * reach, explains * reference_distance):
            return diagnosis(best[1], best[0], reference_distance, best[2], candidates)
        replayed = block_replay_finding(beyond, a.routed, b.routed, b.storage, reference_distance, candidates)
        if replayed is not None:  # an FP8 mistake B's every value reproduces: before what its grid shows
            return replayed
        replayed = group_replay_finding(beyond, a.routed, b.routed, b.storage, reference_distance, candidates)
        if replayed is not None:  # an integer group mistake B's values are unbiased against
            return replayed
        moved = permutation_finding(beyond, a.routed, b.routed, b.storage, reference_distance, candidates)
        if moved is not None:  # rows or columns in another order: before the grid and the scales they upset
            return moved
        rescaled = scale_finding(rows, b.storage, reference_distance, candidates)
        if rescaled is not None:  # an importance-weighted tensor, a row or a block multiplied after quantizing
            return rescaled
        coarse = grid_finding(rows, b.storage, reference_distance, candidates)
        if coarse is not None:
            return coarse
        if beyond:
            return beyond_finding(beyond, reference_distance, candidates)
        closest = f"closest: {best[1]}, {best[2]}, at {best[0]:.2e}; " if best else ""
        detail = f"{closest}tensors beyond the conversion's bound: {', '.join(differing) or 'none'}"
        return diagnosis(MistakeId.CONVERSION_UNEXPLAINED, best[0] if best else None, reference_distance, detail,
                         candidates)

    def replay_all(self, layer: int, found: list[Hypothesis], a: SideLayer, b: SideLayer, x: torch.Tensor,
                   out_b: torch.Tensor, candidates: list[Candidate]) -> tuple[float, MistakeId, str] | None:
        best = None
        for hypothesis in found:
            tensors = hypothesis.tensors(a.routed)
            if any(tensors[n].shape != b.routed[n].shape for n in tensors):
                continue
            converted = {n: conversion.convert_like(t, b.storage[n])[0] for n, t in tensors.items()}
            distance = float((out_b - self.run64(layer, converted, x)).abs().nan_to_num(math.inf).max())
            candidates.append(Candidate(str(hypothesis.id), hypothesis.detail, distance))
            if best is None or distance < best[0]:
                best = (distance, hypothesis.id, hypothesis.detail)
        return best

    def neighbour_hypotheses(self, unit: tuple[int, int | None], a: SideLayer, b: SideLayer) -> list[Hypothesis]:
        """B's layer holding A's layer j (all its tensors, or those closer to layer j's than to this one's), for
        the layers within NEIGHBOURS (for MoE: the same expert of layer j); each neighbour is read, compared by
        values and dropped in turn."""
        layer, expert = unit
        found = []
        for other in range(max(0, layer - NEIGHBOURS), min(self.a.num_layers, layer + NEIGHBOURS + 1)):
            if other == layer or not self.a.mapping.serves(other):  # a layer of another kind holds no such unit
                continue
            mine, theirs = (f"layer {layer}", f"layer {other}") if expert is None else (
                f"layer {layer} expert {expert}", f"layer {other} expert {expert}")
            found.extend(held_from(read_side(self.a, other, truth=True, expert=expert).routed, a, b,
                                   MistakeId.LAYER_SHIFTED, f"B's {mine} holds A's {theirs}"))
        return found

    def expert_hypotheses(self, unit: tuple[int, int | None], a: SideLayer, b: SideLayer) -> list[Hypothesis]:
        """For MoE: B's expert e holding A's expert f of the same layer (all its tensors, or those closer to f's
        than to e's), for every other expert of the layer; each is read, compared by values and dropped in turn."""
        layer, expert = unit
        if expert is None:
            return []
        found = []
        for other in range(self.a.num_experts or 0):
            if other != expert:
                found.extend(held_from(read_side(self.a, layer, truth=True, expert=other).routed, a, b,
                                       MistakeId.EXPERT_SHIFTED,
                                       f"B's expert {expert} of layer {layer} holds A's expert {other}"))
        return found

    # -- the report -----------------------------------------------------------------------------------
    def report(self) -> CompareReport:
        import transformers

        probe = self.a.reference.meta_module(self.a.mapping.reference_path(self.a.mapping.first_layer))
        a, b = self.a.checkpoint, self.b.checkpoint
        # a check's GGUF note says target and reference share the dequantized weights; here only B's are dequantized
        notes = [*(n.split("; target and reference")[0] for n in self.a.resolved.notes),
                 *(f"B: {n.split('; target and reference')[0]}" for n in self.b.resolved.notes), *self.notes]
        weights = "synthetic" if "synthetic" in (a.weights, b.weights) else "real"
        return CompareReport(
            model=self.labels[0], checkpoint=a.location, weights=weights, mapping=self.a.mapping.name,
            units=self.a.unit_names(),
            target=b.location, reference=reference_label(probe),
            reference_activation=activation_name(probe, configured_activation(self.a.config)),
            versions={"parity": __version__, "transformers": transformers.__version__, "torch": torch.__version__},
            seed=self.seed, notes=notes,
            weights_note=(a.weights_note or b.weights_note or "").replace(CHECK_ADVICE, COMPARE_ADVICE) or None,
            comparison={"reference": {"model": self.labels[0], "checkpoint": a.location,
                                      "mapping": self.a.mapping.name, "weights": a.weights},
                        "candidate": {"model": self.labels[1], "checkpoint": b.location,
                                      "mapping": self.b.mapping.name, "weights": b.weights},
                        "inventory": None, "same_files": self.same_files,
                        "outside_ffn": "tensors outside the FFN layers are inventoried (present, shape, dtype) "
                                       "from headers; their values are not judged"})


def held_from(theirs: dict[str, torch.Tensor], a: SideLayer, b: SideLayer, mistake: MistakeId,
              detail: str) -> list[Hypothesis]:
    """B's tensors that are closer to ``theirs`` (another layer's or expert's of A) than to A's own: one
    hypothesis taking those from ``theirs``, or none when no tensor is."""
    closer = [n for n in a.routed if theirs[n].shape == b.routed[n].shape
              and conversion.relative_distance(b.routed[n], theirs[n])
              < conversion.relative_distance(b.routed[n], a.routed[n])]
    if not closer:
        return []
    taken = {n: theirs[n] for n in closer}
    return [Hypothesis(mistake, f"{detail} ({', '.join(closer)})", lambda t, taken=taken: {**t, **taken})]


def open_comparison(spec: CompareSpec) -> Comparison:
    """Both checkpoints of a compare resolved (``Comparison``): with ``require_real``, a synthetic stand-in on either
    side is a SyntheticWeightsError before anything is computed."""
    return Comparison(spec.a, spec.b, revision=spec.revision, revision_b=spec.revision_b,
                      allow_pickle=spec.allow_pickle, seed=spec.seed, experts=spec.experts,
                      require_real=spec.require_real)


def resolve_like(a: Side, b: str, refused: MappingError, *, revision: str | None, allow_pickle: bool) -> Any:
    """B resolved through A's derived layout, where B's own could not be derived (a conversion that dropped a
    tensor, a shared expert): B is then judged unit by unit, each tensor it lacks a finding on its layer
    (tensor_missing), instead of the whole compare stopping.  Only for B of A's model type and storage (not a GGUF
    file beside a folder); else the derivation's own error stands."""
    from parity.engine.layout.resolve import is_gguf

    if not a.mapping.derived:
        raise refused
    try:
        resolved = resolve(b, mapping=a.mapping, revision=revision, allow_pickle=allow_pickle,
                           revision_option="--revision-b")
    except ParityError:
        raise refused from None
    same = (resolved.checkpoint.raw_config.get("model_type") == a.checkpoint.raw_config.get("model_type")
            and is_gguf(resolved.checkpoint) == is_gguf(a.checkpoint))
    if not same:
        raise refused
    resolved.notes.append(f"B's own layout could not be derived ({refused}); B is read through A's")
    return resolved


def require_real_sides(a: Side, b: Side, labels: tuple[str, str]) -> None:
    """A SyntheticWeightsError naming the side that has only the synthetic stand-in."""
    for side, name in ((a, labels[0]), (b, labels[1])):
        if side.checkpoint.weights != "real":
            why = (side.checkpoint.weights_note or "").removeprefix("SYNTHETIC weights: ").split(";")[0]
            error = SyntheticWeightsError(
                f"{name}: real weights are required, but {why or 'only synthetic weights are available'}: a "
                "comparison of stand-ins proves nothing about either checkpoint. Give a local path or a reachable "
                "hub id (without --require-real, or with require_real = false in a project file, the stand-ins are "
                "compared and every view says SYNTHETIC).")
            error.reason = why or "only synthetic weights are available"
            raise error


def same_files(a: Side, b: Side) -> bool:
    """A and B one set of files (one folder, one file, one hub snapshot): compared (it shows parity reads the
    checkpoint end to end), and said in every view, since its pass proves nothing about a conversion."""
    return Path(a.checkpoint.location).expanduser().resolve() == Path(b.checkpoint.location).expanduser().resolve()


def by_values(result: CompareLayer, runs: Runs, a: SideLayer, storage: dict, rows: list[dict],
              conv_dev: float, *, past: str | None = None) -> str | None:
    """A layer whose tolerance reaches its output's magnitude only because the conversion alone moves the output
    that far (MLX affine at 2 bits: 0.70 of it; compressed-tensors' int4 in groups of 128 of heavy-tailed weights:
    0.42), judged by its values where every quantized tensor is held to them, the function then evidence.  Held are
    a format that rounds to nearest on its stored grid (``Storage.nearest``: each value within its step of A's, each
    group's scale a writer's choice for A's, B's least-squares factor on A's conversion within
    ``conversion.CONVERTED_SCALE``) and integer groups (``group_grid``: on a grid of A's, unbiased, most codes A's
    round to nearest, the factors of tensor, rows and groups near 1).  "Could not be verified" there, where B held
    exactly what mlx.core.quantize writes for A, was a false alarm.  ``past``: why the tolerance reaches that far
    where it is not the conversion alone (group_grid.layer_factor: GPTQ's compensation past what the output
    allows).  Clears the layer's unverifiable and says so (for its tolerance rule); None where the layer is
    otherwise judged."""
    scale = float(runs.reference64.abs().max())
    held = [storage[row["name"]] for row in rows if storage[row["name"]].quantized]
    if result.unverifiable is None or not held or not result.tolerance >= scale > conv_dev \
            or not all((s.nearest or s.group is not None) and s.steps is not None for s in held) \
            or any(row["steps"] is None for row in rows if storage[row["name"]].quantized) \
            or unverifiable_reason(a.routed, runs, 0.0, a.facts) is not None:
        return None
    result.unverifiable = None
    result.passed = result.max_abs_diff is not None and result.max_abs_diff <= result.tolerance
    cause = past or (f"the conversion alone moves the output by {conv_dev / scale:.2f} of its largest magnitude, so "
                     "that tolerance would pass a module that outputs zeros")
    return (f"{BY_VALUES}: {cause}; each tensor is held to its values "
            "as its grid holds them (within its step of A's, or on a grid of A's with A's round-to-nearest codes but "
            "for GPTQ's compensation), each group's scale to a writer's choice for A's values, B's least-squares "
            "factors on A near 1")


def values_note(report: CompareReport) -> None:
    """Which layers were judged by their values (``by_values``), said once in every view."""
    valued = [r for r in report.layers if BY_VALUES in ((getattr(r, "conversion", None) or {}).get("tolerance_rule")
                                                        or "")]
    if valued:
        units = ", ".join(str(r.layer) + ("" if r.expert is None else f"/e{r.expert}") for r in valued)
        report.notes.append(f"layer{'s' if len(valued) > 1 else ''} {units} judged by the values of B: the "
                            "tolerance B's conversion needs reaches about as far as the output does (the conversion "
                            "alone, or GPTQ's compensation), so the function cannot tell a mistake; every tensor of "
                            "B is held to its values as its grid holds them, every group's scale to a writer's "
                            "choice for A's, B's least-squares factors on A near 1 (each layer's tolerance_rule)")


def compensated(storage: dict, *, biased: bool = False) -> tuple[float, float]:
    """How much farther than the layer's tolerance a replay may lie from B and still name its mistake, and the
    fraction of B's distance from A it may lie at (``EXPLAINS``): a replay converts A by round to nearest, and an
    integer-group B quantized by GPTQ lies from any such replay as far as its compensation moves a faithful export
    from round to nearest (``group_grid.GPTQ_FACTOR`` over ``FACTOR``, and ``EXPLAINS_GPTQ``; the stories260K
    stand-in's llm-compressor GPTQ int4/32 export with gate and up exchanged: the exchange replay 3.74 from B, A 13.2,
    the layer's 3 x tolerance 2.49).  AWQ rounds to nearest on its grid: 1 and EXPLAINS, as for every other format.
    ``biased``: a matrix of B's layer off A's rounding one way (``group_grid.any_biased``), which no compensation
    moves: EXPLAINS (compressed-tensors' int8 codes of up_proj, 6 in 10 moved one up, lie 0.68 of their distance from
    A from a zero point replayed one off, which moves every code)."""
    grids = [s.group for s in storage.values() if s.group is not None]
    if any(not group_grid.by_awq(grid) for grid in grids):
        return group_grid.GPTQ_FACTOR / group_grid.FACTOR, EXPLAINS if biased else EXPLAINS_GPTQ
    return 1.0, EXPLAINS


def run_comparison(comparison: Comparison, layers: Selection = None,
                   on_layer: Callable[[Report, LayerResult], None] | None = None) -> CompareReport:
    """Compare the selected layers (default all), one at a time (each selected expert of a layer, for MoE, as its
    own unit), then inventory what lies outside the FFN."""
    report = comparison.report()
    chosen = comparison.layers(layers)
    with young_objects_only():  # the per-layer gc.collect() then costs milliseconds, not 0.2-0.5 s
        for layer in chosen:
            held = comparison.b.num_layers
            blocks = comparison.blocks if comparison.blocks is not None and layer < held else None
            if blocks is not None and blocks.serves(layer):
                permuted(comparison, report, layer, blocks.expert_order(layer))
            for unit, expert in comparison.units(layer):
                result = (unit.compare_layer(layer, expert) if layer < held else unit.missing(
                    layer, expert, MistakeId.LAYER_MISSING, f"B has {held} layers, A's layer {layer} is not in B"))
                result.unit = unit.a.mapping.unit
                report.layers.append(result)
                if on_layer is not None:
                    on_layer(report, result)
            whole = blocks.compare(layer, CompareLayer) if blocks is not None and blocks.serves(layer) else None
            if whole is not None:
                report.layers.append(whole)
                if on_layer is not None:
                    on_layer(report, whole)
    if comparison.blocks is not None:
        blocks_note(comparison.blocks, report)
    values_note(report)
    report.comparison["inventory"] = inventory(comparison.a, comparison.b, chosen)
    return report


def permuted(comparison: Comparison, report: CompareReport, layer: int, order: list[int] | None) -> None:
    """B's experts of ``layer`` are A's permuted, with the router's rows alike: each is judged against the expert
    of A it holds, and the report says so."""
    if order is None:
        return
    comparison.expert_map[layer] = order
    pairs = ", ".join(f"B's {e} = A's {a}" for e, a in enumerate(order) if e != a)
    report.notes.append(f"layer {layer}: B's experts are A's in another order, the router's rows permuted alike "
                        f"({pairs}): each expert of B is judged against the one of A it holds, and the block unit "
                        "judges whether the order keeps the function (it does unless the router groups experts by "
                        "position)")


def blocks_note(blocks: BlockComparison, report: CompareReport) -> None:
    """What the block units covered, or why there are none."""
    if blocks.unreadable is not None:
        report.notes.append(f"the whole MoE blocks are not compared: {blocks.unreadable}")
    elif any(r.unit == BLOCK_UNIT for r in report.layers):
        report.units = list(dict.fromkeys([*report.units, BLOCK_UNIT]))
        report.notes.append("each MoE layer's whole sparse block (router, top-k, experts, shared experts) is also "
                            "compared as one unit 'block', transformers' block from A's config holding each side's "
                            "tensors")
