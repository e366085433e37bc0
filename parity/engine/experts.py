"""Mixture-of-experts layers: each expert's FFN checked on its own against transformers.

transformers 5 keeps a layer's experts fused in one module (MixtralExperts: ``gate_up_proj``
[E, 2*ff, d], ``down_proj`` [E, d, ff]) that is called with the router's choice of experts and
weights.  The oracle for expert e is that very module, holding only expert e's weights and
called with every token routed to it at weight 1: transformers' own expert computation with
the routing forced, not a re-implementation.  How the fused tensors are laid out ([gate; up]
concatenated or not, transposed or not) is read from the attributes transformers' experts
decorator sets on the module.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from parity.engine.gate_up_layout import interleave_rows
from parity.errors import MappingError


class GateInput(nn.Identity):
    """Stands where an activation module would be, for experts that compute their activation in their own code
    (GPT-OSS clamps the gate above and up on both sides at swiglu_limit): called only while parity's input probe
    listens (engine.inputs.preactivation), on what each token drives both branches to: the smaller of the gate's
    largest positive pre-activation and up's largest magnitude.  Inputs scaled to reach 8 on it drive the gate
    past 8 and up past ±8 on some token of the last row, past any limit below that on either branch."""

    @staticmethod
    def reach(tokens: torch.Tensor, branches: dict[str, torch.Tensor]) -> torch.Tensor:
        """[tokens, 1]: min(max over units of the gate's positive part, max over units of |up|)."""
        def pre(role: str) -> torch.Tensor:
            bias = branches.get(f"{role}_bias")
            return nn.functional.linear(tokens, branches[role].to(tokens.dtype),
                                        None if bias is None else bias.to(tokens.dtype))
        gate, up = pre("gate"), pre("up")
        return torch.minimum(gate.clamp(min=0).amax(-1, keepdim=True), up.abs().amax(-1, keepdim=True))


class ExpertReference(nn.Module):
    """One expert of a transformers experts module, as a plain [batch, tokens, d] -> same module."""

    def __init__(self, experts: nn.Module, branches: dict[str, torch.Tensor], act: nn.Module | None = None):
        super().__init__()
        self.experts = experts
        # the activation, where parity's input probe looks for it (``act``: one deeper in the module, DBRX's);
        # experts computing theirs in their own code (GPT-OSS's clamped one) get a stand-in that sees both
        # branches' pre-activations (GateInput)
        act = act if act is not None else getattr(experts, "act_fn", None)
        self.act_fn = act if act is not None else GateInput()
        self.branches = None if act is not None else branches
        # Llama 4's experts take the tokens already sorted by expert (and scaled); the others take the choice
        self.routed = len(inspect.signature(experts.forward).parameters) > 1
        self.slots = 1  # routing slots per token; 2 for a module whose loop cannot take one (LongCat-Flash's)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        if self.branches is not None and self.act_fn._forward_pre_hooks:  # the input probe asks what they see
            self.act_fn(GateInput.reach(tokens, self.branches))
        if not self.routed:
            return self.experts(tokens).reshape(x.shape)
        if self.slots == 1:
            try:
                return self.chosen(tokens, 1).reshape(x.shape)
            except ValueError:  # LongCat-Flash's loop squeezes the slot dim away when there is one: unpacking fails
                self.slots = 2
        return self.chosen(tokens, self.slots).reshape(x.shape)

    def chosen(self, tokens: torch.Tensor, slots: int) -> torch.Tensor:
        """Every token sent to expert 0 in each of ``slots`` slots, with routing weight 1 in all (one slot), or
        1/2 in each of two (their sum, y/2 + y/2, is y exactly: halving is exact in binary floating point)."""
        index = torch.zeros(tokens.shape[0], slots, dtype=torch.long, device=tokens.device)
        weights = torch.full((tokens.shape[0], slots), 1.0 / slots, dtype=tokens.dtype, device=tokens.device)
        return self.experts(tokens, index, weights)


def _one_expert_config(config: Any, count: int, extra: int = 0) -> Any:
    """The config with one expert: every attribute that counts the module's ``count`` experts set to 1 (its name
    says experts and does not say per token: num_local_experts, num_experts, n_routed_experts, ...).  ``extra``:
    the slices the module stacks in gate_up_proj beyond down_proj's, experts it computes as the identity
    (LongCat-Flash's zero_expert_num): the attribute counting them set to 0, so the module holds the one expert."""
    single = copy.deepcopy(config)
    for attr, value in vars(config).items():
        if isinstance(value, bool) or "expert" not in attr or "per_tok" in attr:
            continue
        if value == count:
            setattr(single, attr, 1)
        elif extra and value == extra:
            setattr(single, attr, 0)
    # The eager path is transformers' reference loop; grouped kernels do not all run in float64.
    single._experts_implementation = "eager"
    return single


def expert_reference(meta_experts: nn.Module, config: Any, routed: dict[str, torch.Tensor], where: str) -> nn.Module:
    """transformers' experts module holding one expert's weights, in eval mode.  ``routed``: the expert's gate, up
    and down ([out, in] each) and, where the module has them, gate_bias, up_bias and down_bias; they are put back
    into the module's own layout as transformers' decorator describes it (gate and up concatenated or interleaved,
    each matrix [out, in] or transposed; experts without a gate: up_proj and down_proj)."""
    if not hasattr(meta_experts, "gate_up_proj") and not hasattr(meta_experts, "down_proj"):
        from parity.engine.layout.block_experts import takes_x_alone

        if takes_x_alone(meta_experts):  # a block routing x itself (JetMoE's)
            return block_expert_reference(meta_experts, config, routed, where)
        return flat_expert_reference(meta_experts, routed, where)
    gated = hasattr(meta_experts, "gate_up_proj")
    ungated_ok = hasattr(meta_experts, "up_proj") and "gate" not in routed  # no gate: its routes say none either
    if not hasattr(meta_experts, "down_proj") or not gated and not ungated_ok:
        raise MappingError(f"reference.module '{where}' is {type(meta_experts).__name__}, not a fused experts module "
                           "with gate_up_proj / down_proj (mapping key 'reference.module')")
    biased = hasattr(meta_experts, "gate_up_proj_bias")
    if biased and not {"gate_bias", "up_bias", "down_bias"} <= set(routed):
        raise MappingError(f"{type(meta_experts).__name__} holds biases (gate_up_proj_bias, down_proj_bias): the "
                           "mapping's [experts] must route gate_bias, up_bias and down_bias")
    with torch.device("meta"):
        count = meta_experts.down_proj.shape[0]
        extra = meta_experts.gate_up_proj.shape[0] - count if gated else 0
        module = type(meta_experts)(_one_expert_config(config, count, extra))
    given = {name: tensor.unsqueeze(0) for name, tensor in own_layout(meta_experts, routed, biased).items()}
    expected = {n: tuple(p.shape) for n, p in module.named_parameters()}
    for name, tensor in given.items():
        if tuple(tensor.shape) != expected.get(name):
            from parity.errors import ShapeMismatchError

            raise ShapeMismatchError(f"expert tensors give {where}.{name} the shape {list(tensor.shape)}, but "
                                     f"transformers expects {list(expected.get(name, ()))} for one expert "
                                     "(is the config's intermediate_size right for this checkpoint?)")
    module.load_state_dict(given, strict=True, assign=True)
    return ExpertReference(module, {role: routed[role] for role in ("gate", "up", "gate_bias", "up_bias")
                                    if role in routed}).eval()


def one_expert_tensors(meta_experts: nn.Module, routed: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """One expert's tensors in a fused experts module's own layout, each [1, ...] (stacked over experts by
    engine.block.fused_experts for a whole block)."""
    if not hasattr(meta_experts, "down_proj"):
        raise MappingError(f"reference.module '{where}' is {type(meta_experts).__name__}: a whole block needs a fused "
                           "experts module (gate_up_proj or up_proj, and down_proj)")
    biased = hasattr(meta_experts, "gate_up_proj_bias")
    return {name: tensor.unsqueeze(0) for name, tensor in own_layout(meta_experts, routed, biased).items()}


def own_layout(meta_experts: nn.Module, routed: dict[str, torch.Tensor], biased: bool) -> dict[str, torch.Tensor]:
    """One expert's tensors as the experts module holds them (without the experts dim)."""
    from parity.engine.layout.experts import experts_transposed

    transposed = experts_transposed(meta_experts, routed["up"].shape[1])
    if not hasattr(meta_experts, "gate_up_proj"):  # no gate: down(act(up(x)))
        up, down = routed["up"], routed["down"]
        return {"up_proj": up.t() if transposed else up, "down_proj": down.t() if transposed else down}
    interleaved = getattr(meta_experts, "is_concatenated", True) is False

    def joined(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:  # [gate; up], or their rows alternating
        return interleave_rows(gate, up) if interleaved else torch.cat([gate, up], dim=0)

    gate_up, down_proj = joined(routed["gate"], routed["up"]), routed["down"]
    if transposed:
        gate_up, down_proj = gate_up.t(), down_proj.t()
    given = {"gate_up_proj": gate_up, "down_proj": down_proj}
    if biased:
        given |= {"gate_up_proj_bias": joined(routed["gate_bias"], routed["up_bias"]),
                  "down_proj_bias": routed["down_bias"]}
    return given


def flat_expert_reference(meta_experts: nn.Module, routed: dict[str, torch.Tensor], where: str) -> nn.Module:
    """transformers' experts module that keeps its matrices flattened over experts (DBRX's [E·ff, d] w1, v1, w2),
    holding one expert's: each matrix is given the role and orientation measured on the module itself
    (parity.engine.layout.flat_experts)."""
    from parity.engine.layout.flat_experts import one_expert, reference_roles
    from parity.engine.reference import activation_module

    width, d = routed["gate"].shape
    holder, roles = reference_roles(meta_experts, d, width, activation_module)
    if isinstance(roles, str):
        raise MappingError(f"reference.module '{where}' is {type(meta_experts).__name__}, neither a fused experts "
                           f"module with gate_up_proj / down_proj nor one parity reads flattened: {roles} (mapping "
                           "key 'reference.module')")
    module = one_expert(meta_experts, holder, {name: routed[role].t() if transposed else routed[role]
                                               for name, role, transposed in roles})
    return ExpertReference(module, {}, act=activation_module(module.get_submodule(holder))).eval()


def block_expert_reference(meta_block: nn.Module, config: Any, routed: dict[str, torch.Tensor], where: str
                           ) -> nn.Module:
    """transformers' mixture-of-experts block built with one expert out of one, holding this expert's tensors where
    the measured reading of its stacks says, everything else of the block zero (its router: one expert gets weight
    1 whatever its score; its own bias: the whole block's, not an expert's) (parity.engine.layout.block_experts)."""
    from parity.engine.layout.block_experts import (
        OneExpertBlock,
        fill,
        one_expert_block,
        reference_reading,
        stacks_of,
    )
    from parity.engine.reference import activation_module

    width, d = routed["gate"].shape
    reading = reference_reading(meta_block, config, d, width, activation_module)
    if isinstance(reading, str):
        raise MappingError(f"reference.module '{where}' is {type(meta_block).__name__}, which parity cannot hold one "
                           f"expert of: {reading} (mapping key 'reference.module')")
    count = next(iter(stacks_of(meta_block).values())).shape[0]
    block = one_expert_block(meta_block, config, int(count))
    fill(block, reading, routed["gate"].float(), routed["up"].float(), routed["down"].float())
    return ExpertReference(OneExpertBlock(block), {}, act=activation_module(block)).eval()


SLICE_BYTES = 6 * 2**20  # a streamed expert is computed this many bytes of its float64 matrices at a time


class SlicedExpert(nn.Module):
    """transformers' experts module holding one expert, run on a slice of the expert's intermediate units at a time
    and the slices' outputs summed: each unit's gate and up rows and its down column are converted from the stored
    values into a small buffer that stays in cache, instead of whole float64 and float32 copies of the expert (the
    memory traffic, not the flops, is what a streamed block's reference costs on a few tokens).  The units are
    independent until down_proj sums over them, so the sum of the slices' outputs is the expert's output, its sum over
    units taken in SLICE_BYTES parts (a float64 sum of the same float64 products; ``slices_agree`` checks that on the
    module itself); down_proj's bias is added by the first slice only.  engine.sliced.SlicedMLP does the same for a
    dense layer too large to hold in float64, in slices sized for memory (512 MiB), not for the cache."""

    def __init__(self, module: nn.Module, meta_experts: nn.Module, routed: dict[str, torch.Tensor],
                 dtype: torch.dtype, width: int):
        super().__init__()
        self.module, self.meta, self.routed, self.dtype, self.width = module, meta_experts, routed, dtype, width
        self.biased = hasattr(meta_experts, "gate_up_proj_bias")
        self.units = routed["up"].shape[0]
        self.routed_call = True  # called with (tokens, index, weights); False: with the tokens alone (Llama 4's)
        self.change: Callable[[nn.Module], contextlib.AbstractContextManager] | None = None  # ``under``

    def part(self, start: int) -> dict[str, torch.Tensor]:
        """Units start..start+width of the expert as stored, in parity's [out, in] roles."""
        end = start + self.width
        part = {role: self.routed[role][start:end] for role in ("gate", "up", "gate_bias", "up_bias")
                if role in self.routed}
        part["down"] = self.routed["down"][:, start:end]
        if "down_bias" in self.routed:
            bias = self.routed["down_bias"]
            part["down_bias"] = bias if start == 0 else torch.zeros_like(bias)
        return part

    def load(self, start: int) -> None:
        """The module's parameters hold units start..start+width in ``dtype`` (buffers reused where shapes agree)."""
        for name, tensor in own_layout(self.meta, self.part(start), self.biased).items():
            held = getattr(self.module, name)
            if held.is_meta or held.shape[1:] != tensor.shape:
                held = nn.Parameter(torch.empty((1, *tensor.shape), dtype=self.dtype), requires_grad=False)
                self.module.register_parameter(name, held)
            held[0].copy_(tensor)

    @contextlib.contextmanager
    def under(self, change: Callable[[nn.Module], contextlib.AbstractContextManager]) -> Iterator[None]:
        """Each slice computed with ``change`` applied to the module once the slice is loaded (a replay inside an
        expert that acts on each intermediate unit alone, as the clamp, alpha, (up + 1) and gate/up exchanged do:
        the same mistake as on the whole expert)."""
        self.change = change
        try:
            yield
        finally:
            self.change = None

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        out = None
        with torch.no_grad():
            for start in range(0, self.units, self.width):
                self.load(start)
                with self.change(self.module) if self.change is not None else contextlib.nullcontext():
                    part = self.module(*args)
                out = part if out is None else out.add_(part)
        return out


def sliced_expert(meta_experts: nn.Module, config: Any, routed: dict[str, torch.Tensor], where: str,
                  dtype: torch.dtype, *, slice_bytes: int | None = None) -> SlicedExpert | None:
    """``routed`` (one expert's tensors as stored, [out, in]) in transformers' experts module, computed in ``dtype`` a
    slice at a time (``SlicedExpert``); None where the module is not a fused one (gate_up_proj or up_proj, and
    down_proj) or the expert fits one slice."""
    if not hasattr(meta_experts, "down_proj"):
        return None
    units, d = routed["up"].shape
    width = max(1, (slice_bytes or SLICE_BYTES) // (8 * d * (3 if "gate" in routed else 2)))
    return None if width >= units else _in_slices(meta_experts, config, routed, where, dtype, width)


def _in_slices(meta_experts: nn.Module, config: Any, routed: dict[str, torch.Tensor], where: str, dtype: torch.dtype,
               width: int) -> SlicedExpert | None:
    shapes = {role: torch.empty(tensor.shape, dtype=tensor.dtype, device="meta") for role, tensor in routed.items()}
    module = expert_reference(meta_experts, config, shapes, where)
    if not isinstance(module, ExpertReference):
        return None
    sliced = SlicedExpert(module.experts, meta_experts, routed, dtype, width).eval()
    sliced.routed_call = module.routed
    return sliced


def slices_agree(meta_experts: nn.Module, config: Any, routed: dict[str, torch.Tensor], where: str, *,
                 slice_bytes: int | None = None) -> bool:
    """Whether transformers' experts module computes one expert (``routed``) sliced as it does whole, in float64 to
    1e-12 of the output's size, on seeded tokens: a module whose units are not independent until down_proj (any
    that is not measured so) is run whole.  The whole expert is one slice of all its units: one float64 copy made
    from the stored values, no intermediate ones (the streamed block's peak)."""
    sliced = sliced_expert(meta_experts, config, routed, where, torch.float64, slice_bytes=slice_bytes)
    if sliced is None:
        return False
    x = torch.randn(4, routed["up"].shape[1], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    args = (x, torch.zeros(4, 1, dtype=torch.long), torch.ones(4, 1, dtype=torch.float64)) \
        if sliced.routed_call else (x,)
    try:
        got = sliced(*args)
    except Exception:  # a module whose code needs its whole width
        return False
    want = _in_slices(meta_experts, config, routed, where, torch.float64, routed["up"].shape[0])(*args)
    return got.shape == want.shape and bool((got - want).abs().max() <= 1e-12 * want.abs().max().clamp_min(1e-300))
