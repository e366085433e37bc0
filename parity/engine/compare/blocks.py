"""`parity compare A B` on a mixture of experts: B's whole sparse block judged against A's, beside each expert.

Each expert compared on its own proves the experts; the block (transformers' own, built from A's config) adds the
router, its selection bias and the shared experts' gate, which no expert unit reads.  A conversion that permutes the
experts and the router's rows alike computes the same function: the block passes, and the permutation is read off
the router's rows (``expert_order``) so that each of B's experts is judged against the expert of A it holds.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from parity.definitions.mapping import TensorRoute
from parity.definitions.mistakes import MistakeId, diagnosis
from parity.definitions.records import Diagnosis
from parity.engine.block import (
    BLOCK_UNIT,
    BlockReader,
    block_inputs,
    block_output,
    chosen_experts,
    filled_block,
    first_projection,
    gate_reach,
    reference_block,
    router_name,
)
from parity.engine.results import LayerResult
from parity.engine.verdict import Runs, judge, parity_tolerance
from parity.errors import CheckpointError, ParityError


class BlockComparison:
    """The block units of a comparison whose layout has routed experts (both sides, ``engine.side.Side``)."""

    def __init__(self, a: Any, b: Any, *, units: list[str] = (), seed: int = 0):
        self.a, self.b = BlockReader(a), BlockReader(b)
        self.seed = seed  # the comparison's: the block's inputs are drawn from it, as each unit's are
        self.site = self.a.site
        # the block's children other units judge (shared experts), by their path in the block: ``units`` are the
        # comparison's units' module paths ('model.layers.{layer}.mlp.shared_expert')
        self.judged = tuple(f"{unit.removeprefix(self.site.path + '.')}." for unit in units
                            if unit.startswith(self.site.path + "."))
        self.unreadable: str | None = None  # why B's block could not be read (a GGUF file without its router)
        self.lacking: dict[int, list[str]] = {}  # layer -> the block tensors of A's that B lacks (its router, say)
        self.read: tuple[int, tuple | None] | None = None  # the last layer's sides, read once for both uses

    def serves(self, layer: int) -> bool:
        return self.a.mapping.serves(layer) and self.unreadable is None

    def sides(self, layer: int) -> tuple[dict, dict, list] | None:
        """A's and B's block tensors under transformers' names (float64), and A's experts' gate/up/down; None where
        B's cannot be read."""
        if self.read is not None and self.read[0] == layer:
            return self.read[1]
        self.read = (layer, self._sides(layer))
        return self.read[1]

    def _sides(self, layer: int) -> tuple[dict, dict, list] | None:
        try:  # experts transformers keeps otherwise than fused (DBRX's flattened ones), or B's file names
            own_a, _, experts = self.a.layer_tensors(layer)
            own_b, _, _ = self.b.layer_tensors(layer)
        except ParityError as exc:
            self.unreadable = str(exc)
            return None
        if set(own_a) - set(own_b):  # B's block cannot run as A's: that layer's block unit fails
            self.lacking[layer] = sorted(set(own_a) - set(own_b))
            return None
        if set(own_a) != set(own_b):
            self.unreadable = f"B's block of layer {layer} holds {sorted(set(own_b) - set(own_a))} where A's does not"
            return None
        return own_a, own_b, experts

    def router_order(self, layer: int) -> list[int] | None:
        """B's router row e -> A's row it equals, where B's rows are A's permuted (else None)."""
        found = self.sides(layer)
        if found is None:
            return None
        own_a, own_b, _ = found
        meta = self.a.side.reference.meta_module(self.site.path.format(layer=layer))
        name = router_name(meta, self.site, self.a.side.num_experts, self.a.side.hidden_size)
        return None if name is None else expert_order(own_a[name], own_b[name])

    def expert_order(self, layer: int) -> list[int] | None:
        """B's expert e -> A's expert it holds, where B's router rows AND experts are A's permuted alike."""
        order = self.router_order(layer)
        if order is None:
            return None
        own_a, own_b, _ = self.sides(layer)
        fused = [name for name in own_a if name.startswith(self.site.experts + ".")]
        alike = all(torch.allclose(own_b[n][e], own_a[n][a], rtol=1e-2, atol=0.0)
                    for n in fused for e, a in enumerate(order))
        return order if alike else None

    def explain(self, layer: int, expected: dict[str, torch.Tensor]) -> Diagnosis | None:
        """Why B's block computes another function when its experts do not: the router's rows permuted alone, or a
        tensor outside the experts changed beyond B's own rounding of A's (``expected``: what B's block should hold)."""
        own_a, own_b, _ = self.sides(layer)
        order = self.router_order(layer)
        if order is not None:
            pairs = ", ".join(f"row {e} is A's row {a}" for e, a in enumerate(order) if e != a)
            why = ("its experts are in A's order" if self.expert_order(layer) is None else
                   "its experts are permuted alike, but the block routes by the experts' positions (a router that "
                   "picks groups of experts by index, DeepSeek's n_group), so the order changes which are chosen")
            return diagnosis(MistakeId.ROUTER_ROWS_PERMUTED, None, None, f"B's router ({pairs}); {why}")
        changed = []
        for name, a in own_a.items():
            if name.startswith((self.site.experts + ".", *self.judged)):
                continue
            moved = float((own_b[name] - expected[name]).abs().max())
            if moved > 0:
                changed.append(f"{name} (max |B - A| {moved:.3g}, A's largest {float(a.abs().max()):.3g})")
        if not changed:
            return None
        return diagnosis(MistakeId.BLOCK_TENSOR_CHANGED, None, None, "B's " + "; ".join(changed))

    def compare(self, layer: int, result_type: type) -> LayerResult | None:
        """B's block of ``layer`` against A's, as one unit ``block`` (``result_type``: the comparison's row type);
        None where the blocks cannot be compared (``unreadable`` says why)."""
        name = type(self.a.side.reference.meta_module(self.site.path.format(layer=layer))).__name__
        try:
            with reference_block(name, layer):
                return self._compare(layer, result_type)
        except CheckpointError as exc:
            self.unreadable = str(exc).split("; check one expert")[0]
            return None

    def _compare(self, layer: int, result_type: type) -> LayerResult | None:
        """B's block against the block that holds what B's units hold (its experts, in A's order where they are
        permuted; its shared experts) and A's tensors around them as B's dtypes store them: what no unit judges (the
        router, its selection bias, the shared experts' gate) is judged here, and B's quantized experts, judged on
        their own grid by their units, move neither side."""
        found = self.sides(layer)
        if found is None:
            return self.lacking_unit(layer, result_type) if layer in self.lacking else None
        own_a, own_b, experts = found
        meta = self.a.side.reference.meta_module(self.site.path.format(layer=layer))
        site = self.site
        block64, block32 = (filled_block(meta, site, own_a, dtype) for dtype in (torch.float64, torch.float32))
        expected = self.expected(own_a, own_b, self.expert_order(layer))
        block_conv, block_b = (filled_block(meta, site, tensors, torch.float64) for tensors in (expected, own_b))
        gates = [first_projection(expert) for expert in experts]
        inputs = block_inputs(block64, block32, site, gate_reach(lambda: enumerate(gates)), count=len(gates),
                              d=gates[0].shape[1], seed=self.seed, layer=layer)
        x = inputs.x.double()
        count = self.a.side.num_experts
        inputs.tied |= (inputs.chosen != chosen_experts(block_conv, site, x, count)).any(-1)  # the storage's ties
        outs = [block_output(module, x) for module in (block64, block_conv, block_b)]
        out32 = block_output(block32, inputs.x).double()
        kept = ~inputs.tied
        out64, out_conv, out_b = (o.reshape(-1, o.shape[-1])[kept].unsqueeze(0) for o in outs)
        out32 = out32.reshape(-1, out32.shape[-1])[kept].unsqueeze(0)
        conv_dev = float((out_conv - out64).abs().max()) if out64.numel() else 0.0
        noise, scale = float((out32 - out64).abs().max()), float(out64.abs().max())
        tolerance = parity_tolerance(noise, scale, None)
        result = judge(layer, None, Runs(out_conv, out32 - out64 + out_conv, out_b, out_b), own_a, None, tolerance,
                       self.a.side.checkpoint.weights)
        row = result_type(**{f.name: getattr(result, f.name) for f in dataclasses.fields(LayerResult)})
        row.unit, row.coverage = BLOCK_UNIT, inputs.coverage() | {"set_aside_agree": _agreeing(outs, inputs.tied,
                                                                                                tolerance)}
        if not row.passed and row.unverifiable is None and row.diagnosis is None:
            row.diagnosis = self.explain(layer, expected) or diagnosis(MistakeId.UNEXPLAINED, None, row.max_abs_diff)
        row.conversion = {"kind": "whole block", "tolerance_rule": "the noise floor: B against A's block holding B's "
                          "experts and shared experts (their units judge them)", "conversion_deviation": conv_dev,
                          "ratio_to_conversion": None,
                          "identical": all(torch.equal(own_a[n], own_b[n]) for n in own_a), "tensors": []}
        return row

    def lacking_unit(self, layer: int, result_type: type) -> LayerResult:
        """The block unit of a layer whose B lacks tensors of A's block (its router, a shared expert's gate): failed,
        tensor_missing naming them, since the block cannot route as A's (its experts' units pass on their own)."""
        names = ", ".join(self.lacking[layer])
        row = result_type(layer=layer, passed=False, max_abs_diff=None, max_rel_diff=None, mean_abs_diff=None,
                          max_at=None, noise_floor=None, tolerance=None, ratio_to_noise=None, preactivation_range=None,
                          weights=self.a.side.checkpoint.weights,
                          diagnosis=diagnosis(MistakeId.TENSOR_MISSING, None, None, f"B's MoE block of layer {layer} "
                                              f"lacks {names}, which A's holds: it cannot route tokens as A's does"))
        row.unit = BLOCK_UNIT
        row.conversion = {"kind": "missing in B", "tolerance_rule": None, "conversion_deviation": None,
                          "ratio_to_conversion": None, "identical": False, "tensors": []}
        return row

    def expected(self, own_a: dict, own_b: dict, order: list[int] | None) -> dict[str, torch.Tensor]:
        """What B's block should hold: B's own tensors where another unit judges them (its experts, put in A's order
        where B permutes them with the router's rows; its shared experts), A's cast to B's dtypes elsewhere."""
        inverse = None if order is None else torch.empty(len(order), dtype=torch.long)
        if inverse is not None:
            inverse[torch.tensor(order)] = torch.arange(len(order))
        expected = {}
        for name, tensor in own_a.items():
            if name.startswith(self.site.experts + "."):
                expected[name] = own_b[name] if inverse is None else own_b[name][inverse]
            elif name.startswith(self.judged):
                expected[name] = own_b[name]
            else:
                expected[name] = self.as_b_stores(name, tensor, own_b[name])
        return expected

    def as_b_stores(self, name: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """A's tensor ``name`` as B's storage would hold it (float64): cast to B's dtype, or re-quantized to B's
        type where B's file quantizes it (a GGUF file's router), the way ``parity compare`` converts FFN tensors."""
        from parity.engine.compare.conversion import reference_conversion, storage_of  # the compare's own rules

        key = self.b.keys[name]
        stored = b.to(self.b.stored.get(name, b.dtype))  # as read: B's dtype, or a GGUF tensor dequantized
        storage = storage_of(self.b.side.checkpoint, key, stored, TensorRoute(name, key))
        return reference_conversion(a, storage)[0].double()

def _agreeing(outs: list[torch.Tensor], tied: torch.Tensor, tolerance: float) -> int:
    """Set-aside tokens on which B's block (``outs[2]``) computes what A's does, in float64 or as B stores it."""
    flat = [o.reshape(-1, o.shape[-1])[tied] for o in outs]
    best = torch.minimum((flat[2] - flat[0]).abs().amax(-1), (flat[2] - flat[1]).abs().amax(-1))
    return int((best <= tolerance).sum())


def expert_order(a_router: torch.Tensor, b_router: torch.Tensor) -> list[int] | None:
    """B's expert e -> the expert of A whose router row B's row e equals (within the rows' own rounding), where
    that is a permutation other than the identity; None otherwise."""
    if a_router.shape != b_router.shape or a_router.dim() != 2:
        return None
    distance = torch.cdist(b_router.double(), a_router.double())
    order = [int(i) for i in distance.argmin(1)]
    # each of B's rows far nearer one of A's than any other: B's own rounding or quantization of that row (a Q8_0
    # router moves a row by ~1% of the distance between rows) and no other row
    nearest = distance.topk(min(2, distance.shape[1]), dim=1, largest=False).values
    close = nearest.shape[1] == 2 and bool((nearest[:, 0] <= 0.1 * nearest[:, 1]).all())
    if not close or sorted(order) != list(range(len(order))) or order == list(range(len(order))):
        return None
    return order
