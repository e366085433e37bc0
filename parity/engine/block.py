"""A mixture-of-experts layer's whole sparse block, as transformers computes it: the oracle of a block check.

A per-expert check forces every token to one expert, so it is blind to what happens around the experts: the
router's scoring (softmax or sigmoid), the top-k, renormalisation, a selection bias, a scaling factor, where the
routing weight is applied, the shared experts and their gate.  Here the oracle is transformers' own block for the
layer (``MixtralSparseMoeBlock``, ``DeepseekV3MoE``, ``GptOssMLP``, ``Llama4TextMoe``, ...), taken from the model's
module tree, filled with the layer's tensors and run with its experts' eager loop (the grouped kernels do not all run
in float64).  Nothing of its routing is re-implemented: which experts each token chose is read where the block hands
the tokens to its experts module.

The inputs make the routing visible: every expert is aimed at by some token, and tokens whose choice of experts is
decided by less than float32 noise (near-ties) are found by re-running the router on the float32 copy and on inputs
moved by a few float32 steps; they are judged apart (``BlockInputs.tied``).

``BlockReader`` reads a checkpoint's blocks one layer at a time, for a block check and a compare's block units alike.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Mapping as MappingABC
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from parity.engine.experts import one_expert_tensors
from parity.engine.layer import route_tensor
from parity.errors import CheckpointError, MappingError, ParityError

BLOCK_UNIT = "block"  # the unit name reports give a whole sparse block
ROW_TARGETS = (1.0, 3.0, 8.0)  # largest gate pre-activation over chosen experts aimed at by each batch row
MIN_TOKENS = 16  # tokens per row, at least; more where many experts must each be chosen by some token
NUDGE = 2.0 ** -21  # relative size of the input moves that find near-ties: a few float32 steps
NUDGES = 3  # how many such moves are tried (besides the float32 copy of the block)
AIM_ATTEMPTS = 8  # rounds of tokens aimed at the experts no token chose yet


@dataclass(frozen=True)
class BlockSite:
    """Where a layer's sparse block sits: its module path and its experts child (relative to it)."""

    path: str
    experts: str

    @classmethod
    def of(cls, experts_path: str) -> BlockSite:
        """The block holding the fused experts module at ``experts_path`` (its parent)."""
        path, _, experts = experts_path.rpartition(".")
        if not path:
            raise MappingError(f"the experts module '{experts_path}' has no parent block")
        return cls(path, experts)

    def at(self, layer: int) -> BlockSite:
        """This site in layer ``layer`` ('model.layers.{layer}.mlp' -> 'model.layers.3.mlp')."""
        return BlockSite(self.path.format(layer=layer), self.experts)


def block_tensors(checkpoint: Any, skeleton: nn.Module, site: BlockSite, layer: int) -> dict[str, str]:
    """The block's own tensors beside its experts (router, selection bias, shared experts and their gate):
    the block's parameter name -> the checkpoint key that transformers' load-time conversion renames to it (a GGUF
    file: the key gguf's name map gives it)."""
    from parity.engine.layout.renaming import renamed_keys
    from parity.sources.gguf import GGUFCheckpoint

    if isinstance(checkpoint, GGUFCheckpoint):
        from parity.engine.layout.gguf_names import gguf_keys

        where = site.path + "."
        own = [f"{where}{name}" for name in skeleton.get_submodule(site.path).state_dict()
               if not name.startswith(site.experts + ".")]
        return {name.removeprefix(where): key for name, key in gguf_keys(checkpoint, own, layer).items()}
    keys = [key for key in checkpoint.weight_map if f".{layer}." in key]
    found = {}
    for key, (name, merged) in renamed_keys(skeleton, keys).keys.items():
        relative = name.removeprefix(site.path + ".")
        if relative != name and merged is None and not relative.startswith(site.experts + "."):
            found[relative] = key
    return found


def fused_experts(meta_experts: nn.Module, experts: Iterable[dict[str, torch.Tensor]], where: str
                  ) -> dict[str, torch.Tensor]:
    """Every expert's tensors (gate, up, down, biases as [out, in]) stacked into the experts module's own layout."""
    parts = [one_expert_tensors(meta_experts, routed, where) for routed in experts]
    stacked = {name: torch.cat([part[name] for part in parts]) for name in parts[0]}
    for name, tensor in stacked.items():  # slices past the experts' count: experts the module computes as the
        held = getattr(meta_experts, name, None)  # identity (LongCat-Flash's zero-computation experts), never read
        if isinstance(held, nn.Parameter) and held.shape[1:] == tensor.shape[1:] and held.shape[0] > len(parts) \
                and held.shape[0] > meta_experts.down_proj.shape[0] == len(parts):
            stacked[name] = torch.cat([tensor, tensor.new_zeros((held.shape[0] - len(parts), *tensor.shape[1:]))])
    return stacked


def filled_block(meta_block: nn.Module, site: BlockSite, tensors: dict[str, torch.Tensor],
                 dtype: torch.dtype, *, experts: nn.Module | None = None) -> nn.Module:
    """A copy of transformers' block holding ``tensors`` (its own names) in ``dtype``, experts run by the eager loop;
    ``experts``: a stand-in for its experts module (``Precomputed``: a block too large to hold every expert)."""
    block = copy.deepcopy(meta_block)
    if experts is not None:
        block.set_submodule(site.experts, experts)
    experts = block.get_submodule(site.experts)
    if hasattr(experts, "config"):  # transformers' experts decorator dispatches on the config's implementation
        experts.config = copy.deepcopy(experts.config)
        experts.config._experts_implementation = "eager"
    expected = block.state_dict()
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise MappingError(f"{type(block).__name__} at {site.path} needs {', '.join(missing)}, which the checkpoint "
                           "does not hold under any name transformers' conversion gives it")
    given = {name: tensors[name] for name in expected}  # only what the block holds (a stand-in's experts: none)
    for name, tensor in given.items():
        if tensor.numel() == expected[name].numel() and tensor.squeeze().shape == expected[name].squeeze().shape:
            given[name] = tensor = tensor.reshape(expected[name].shape)  # GGUF's [d] for a [1, d] gate: same values
        if tuple(tensor.shape) != tuple(expected[name].shape):
            from parity.errors import ShapeMismatchError

            raise ShapeMismatchError(f"{site.path}.{name}: the checkpoint gives {list(tensor.shape)}, transformers "
                                     f"expects {list(expected[name].shape)} (does config.json fit this checkpoint?)")
    block.load_state_dict({n: t.to(dtype) for n, t in given.items()}, strict=True, assign=True)
    still = [n for n, t in [*block.named_parameters(), *block.named_buffers()] if t.is_meta]
    if still:
        raise MappingError(f"{type(block).__name__} at {site.path}: {', '.join(still)} has no value after filling")
    return block.eval()


def block_output(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The block's hidden output shaped like ``x``: a tuple's first element ((hidden, router_logits)), and Llama 4's
    [batch·tokens, d] put back as [batch, tokens, d]."""
    with torch.no_grad():
        out = block(x)
    if isinstance(out, tuple):
        out = out[0]
    return out.reshape(x.shape)


@contextlib.contextmanager
def reference_block(name: str, layer: int) -> Iterator[None]:
    """transformers' own block failing on the checkpoint's config (DeepSeek's n_group larger than its experts) is the
    checkpoint's problem, said in one line (exit 2), never an internal error."""
    try:
        yield
    except ParityError:
        raise
    except Exception as exc:
        raise CheckpointError(f"transformers' {name} cannot run layer {layer}'s whole block with this config.json "
                              f"({type(exc).__name__}: {exc}); check one expert at a time (--experts all)") from None


class _Stop(Exception):
    """Raised where the block hands its tokens to the experts: the choice is known, the rest is not needed."""


def chosen_experts(block: nn.Module, site: BlockSite, x: torch.Tensor, count: int) -> torch.Tensor:
    """[tokens, count] bool: which experts the block routes each token of ``x`` to, read off the call into its
    experts module (an index per token, or Llama 4's tokens repeated per expert, zero where not routed)."""
    return chosen_in(experts_call(block, site, x), count)


def chosen_in(call: tuple[torch.Tensor, ...], count: int) -> torch.Tensor:
    """[tokens, count] bool from what a block handed its experts (``experts_call``): each token's index of chosen
    experts, or Llama 4's tokens once per expert, scaled by the routing weight (zero where not chosen)."""
    index = next((a for a in call[1:] if not a.is_floating_point()), None)
    if index is None:
        return call[0].reshape(count, call[0].shape[0] // count, -1).ne(0).any(-1).t()
    tokens = call[0].shape[0]
    chosen = torch.zeros(tokens, count, dtype=torch.bool)
    chosen[torch.arange(tokens).unsqueeze(1).expand_as(index), index.long()] = True
    return chosen


@dataclass
class BlockInputs:
    """What a block is checked on, and how much of its routing that exercises."""

    x: torch.Tensor  # [rows, tokens, d] float32
    chosen: torch.Tensor  # [rows·tokens, E] bool: each token's experts, as the float64 block chose them
    tied: torch.Tensor  # [rows·tokens] bool: tokens whose choice moves within float32 noise (judged apart)

    def coverage(self) -> dict[str, Any]:
        """Tokens per expert (over the tokens judged), the experts no token chose, and the near-ties set aside."""
        kept = self.chosen[~self.tied]
        per_expert = [int(n) for n in kept.sum(0)]
        return {"tokens": int(self.chosen.shape[0]), "tokens_per_expert": per_expert,
                "never_chosen": [e for e, n in enumerate(per_expert) if n == 0], "set_aside": int(self.tied.sum())}


Reach = Callable[[torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def block_inputs(block64: nn.Module, block32: nn.Module, site: BlockSite, reach: Reach, *, count: int, d: int,
                 seed: int, layer: int) -> BlockInputs:
    """Seeded inputs [3, tokens, d]: unit-RMS tokens, each row scaled so the largest gate pre-activation of its
    tokens' experts reaches ROW_TARGETS (``reach(x, chosen)``: per row, ``gate_reach``); experts no token chose are
    then aimed at with tokens along their router row; near-ties found."""
    top_k = int(chosen_experts(block64, site, torch.zeros(1, 1, d, dtype=torch.float64), count).sum())
    per_row = max(MIN_TOKENS, -(-2 * count // max(top_k, 1)))
    generator = torch.Generator().manual_seed(seed * 100_003 + layer + 104_729)
    x = torch.randn(len(ROW_TARGETS), per_row, d, generator=generator, dtype=torch.float64)
    x = x / x.pow(2).mean(-1, keepdim=True).sqrt()
    x = _scaled(x, reach(x, None))
    router = _router_rows(block64, site, count, d)
    for attempt in range(AIM_ATTEMPTS + 1):
        for _ in range(2):  # the reach that matters is on the experts each token is routed to (GPT-OSS's clamp)
            x = _scaled(x, reach(x, chosen_experts(block64, site, x, count)))
        chosen = chosen_experts(block64, site, x, count)  # scaling moves a sigmoid router's choice: aimed after it
        missing = [e for e in range(count) if not bool(chosen[:, e].any())]
        if not missing or router is None or attempt == AIM_ATTEMPTS:
            break
        x = _aim(x, router, missing, generator, attempt)
    x = x.float()
    chosen = chosen_experts(block64, site, x.double(), count)
    tied = (chosen != chosen_experts(block32, site, x, count)).any(-1)
    for _ in range(NUDGES):
        moved = x.double() * (1 + NUDGE * torch.randn(x.shape, generator=generator, dtype=torch.float64))
        tied |= (chosen != chosen_experts(block64, site, moved, count)).any(-1)
    return BlockInputs(x, chosen, tied)


def first_projection(expert: dict[str, torch.Tensor]) -> torch.Tensor:
    """The projection whose pre-activation the inputs are scaled on: the gate, or up where experts have no gate."""
    return expert["gate"] if "gate" in expert else expert["up"]


def gate_reach(gates: Callable[[], Iterable[tuple[int, torch.Tensor]]]) -> Reach:
    """``reach`` for ``block_inputs`` from experts' gate weights ([ff, d] each, with the expert's index; ``gates()``
    may load them one at a time): per row, the largest positive gate pre-activation over each token's chosen experts
    (every expert where ``chosen`` is None); positive, where GPT-OSS clamps (above, at swiglu_limit)."""
    def reach(x: torch.Tensor, chosen: torch.Tensor | None) -> torch.Tensor:
        best = torch.zeros(x.shape[0], dtype=x.dtype)
        for expert, gate in gates():
            pre = (x @ gate.to(x.dtype).t()).clamp(min=0).amax(-1)  # [rows, tokens]
            if chosen is not None:
                pre = pre * chosen[:, expert].reshape(pre.shape)
            best = torch.maximum(best, pre.amax(-1))
        return best
    return reach


def _scaled(x: torch.Tensor, reach: torch.Tensor) -> torch.Tensor:
    return x * (torch.tensor(ROW_TARGETS, dtype=x.dtype) / reach.clamp_min(1e-12)).view(-1, 1, 1)


def _router_rows(block: nn.Module, site: BlockSite, count: int, d: int) -> torch.Tensor | None:
    """[E, d]: the router's weight, None where the block holds not exactly one such matrix (``router_name``)."""
    name = router_name(block, site, count, d)
    return None if name is None else block.get_parameter(name).detach().double()


def router_name(block: nn.Module, site: BlockSite, count: int, d: int) -> str | None:
    """The router's weight in a block (the meta one will do): its one [E, d] matrix outside the experts and outside
    any FFN (a module with an activation: a shared expert of width E); None if not one."""
    from parity.engine.reference import activation_module

    found = []
    for name, tensor in block.named_parameters():
        parts = name.split(".")[:-1]
        owners = [block.get_submodule(".".join(parts[:i])) for i in range(1, len(parts) + 1)]
        if (tuple(tensor.shape) == (count, d) and not name.startswith(site.experts + ".")
                and all(activation_module(owner) is None for owner in owners)):
            found.append(name)
    return found[0] if len(found) == 1 else None


def _aim(x: torch.Tensor, router: torch.Tensor, missing: list[int], generator: torch.Generator,
         attempt: int) -> torch.Tensor:
    """``x`` with tokens appended to its rows, aimed at each missing expert: along its router row less the rows' mean
    (its logit above the others'), stronger at each attempt, plus some noise, at the row's own scale (a row short of
    aimed tokens gets an unaimed one)."""
    rows, _, d = x.shape
    scale = x.pow(2).mean(-1).sqrt().mean(-1)  # each row's RMS
    contrast = router - router.mean(0, keepdim=True)
    added = torch.randn(rows, -(-len(missing) // rows), d, generator=generator, dtype=x.dtype)
    added = added / added.pow(2).mean(-1, keepdim=True).sqrt()
    for i, expert in enumerate(missing):
        direction = contrast[expert] / contrast[expert].pow(2).mean().sqrt().clamp_min(1e-12)
        noise = torch.randn(d, generator=generator, dtype=x.dtype) * (0.5 / (attempt + 1))
        added[i % rows, i // rows] = direction * (1 + attempt) + noise
    return torch.cat([x, added * scale.view(-1, 1, 1)], dim=1)


class Precomputed(nn.Module):
    """Stands where a block's experts module is: returns, call by call, outputs computed beforehand (``streamed``),
    so that transformers' block runs its own routing and shared experts around experts it never holds at once."""

    def __init__(self, outputs: list[torch.Tensor] | None = None):
        super().__init__()
        self.outputs = list(outputs or [])

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not self.outputs:
            raise RuntimeError("the block called its experts more often than it did when its calls were read")
        return self.outputs.pop(0)


def experts_call(block: nn.Module, site: BlockSite, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What the block hands its experts module for ``x``: (tokens, chosen experts, weights), or Llama 4's (tokens
    repeated per expert and scaled,); the block stops there (what follows is not needed)."""
    seen: list[tuple] = []

    def grab(_module, args, kwargs):
        seen.append(tuple(a.detach().clone() for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)))
        raise _Stop

    handle = block.get_submodule(site.experts).register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            block(x)
    except _Stop:
        pass
    finally:
        handle.remove()
    if not seen:
        raise MappingError(f"{type(block).__name__} at {site.path} never called its experts module {site.experts}")
    return seen[0]


def streamed(calls: list[tuple[torch.Tensor, ...]], count: int, one: Callable[[int, torch.dtype, bool], nn.Module]
             ) -> list[torch.Tensor]:
    """Each call's experts output, every expert built (``one(e, dtype, last)``: transformers' experts module holding
    expert e alone, in the call's dtype; ``last``: e's last use) and applied to each call's tokens routed to it; then
    dropped."""
    outs = [torch.zeros_like(call[0]) for call in calls]
    chosen = [chosen_in(call, count) for call in calls]
    for expert in range(count):
        using = [i for i in range(len(calls)) if bool(chosen[i][:, expert].any())]
        for i in using:
            hidden, *routing = calls[i]
            part = one(expert, hidden.dtype, i == using[-1])
            with torch.no_grad():
                if routing:
                    token, slot = (routing[0] == expert).nonzero(as_tuple=True)
                    zero = torch.zeros(len(token), 1, dtype=torch.long)
                    outs[i].index_add_(0, token, part(hidden[token], zero, routing[1][token, slot, None]))
                else:
                    rows = hidden.shape[0] // count
                    outs[i][expert * rows:(expert + 1) * rows] = part(hidden[expert * rows:(expert + 1) * rows])
            del part
    return outs


class BlockReader:
    """A side's sparse blocks (its layout has routed experts: ``side.mapping.experts``), read one layer at a time:
    the block's own tensors under transformers' names and the checkpoint's, and each expert's.  What a block check
    (``engine.check.block_check``) and a compare's block units (``engine.compare.blocks``) both read."""

    def __init__(self, side: Any):
        self.side = side
        self.mapping = side.mapping
        self.site = BlockSite.of(side.mapping.reference_module)
        self.stored: dict[str, torch.dtype] = {}  # the last layer read: each tensor's dtype as stored
        self.keys: dict[str, str] = {}  # the last layer read: the block's own names -> the checkpoint's keys
        self._last: tuple = (None, {})  # the last expert read, as stored

    def layer_tensors(self, layer: int, *, wanted: bool = True) -> tuple[MappingABC, MappingABC, list[dict]]:
        """(transformers' names -> tensor, the checkpoint's names relative to the block -> tensor, each expert's
        gate/up/down/biases [out, in] float64 (``wanted``; else [] and each expert read only when asked for));
        ``self.stored`` then holds each of transformers' names' stored dtype (the fused experts': an expert's)."""
        side = self.side
        keys = block_tensors(side.checkpoint, side.reference.skeleton, self.site.at(layer), layer)
        stored = side.checkpoint.read(list(keys.values()))
        self.keys = keys
        self.stored = {name: stored[key].dtype for name, key in keys.items()}
        own = {name: stored[key].double() for name, key in keys.items()}
        stacked = self.stacked_keys(layer)
        prefix = _disk_prefix(keys, stacked)
        disk: dict[str, Callable[[], torch.Tensor]] = {key.removeprefix(prefix): _given(own[name])
                                                       for name, key in keys.items()}
        disk |= {key.removeprefix(prefix): functools.partial(self.stored_stack, key) for key in stacked}
        if not side.mapping.experts.stacked and prefix:  # a port may use the checkpoint's own per-expert names
            for expert in range(side.num_experts):
                base = side.mapping.layer_prefix(layer, expert).removeprefix(prefix)
                for source in self.stored_expert(layer, 0):
                    disk[f"{base}.{source}"] = functools.partial(self.stored_tensor, layer, expert, source)
        meta = self.meta_experts(layer)
        where = self.site.path.format(layer=layer)
        experts = [self.expert(layer, e) for e in range(side.num_experts)] if wanted else []
        fused = {f"{self.site.experts}.{n}" for n in meta.state_dict()}
        self.stored |= dict.fromkeys(fused, next(iter(self.stored_expert(layer, 0).values())).dtype)
        if experts:
            own |= {f"{self.site.experts}.{n}": t for n, t in fused_experts(meta, experts, where).items()}
            return own, Lazy(disk), experts
        every = functools.cache(functools.partial(self.fused, layer, meta, where))  # too large: only if asked for
        return Lazy({**{n: _given(t) for n, t in own.items()},
                     **{n: functools.partial(lambda n: every()[n.split(".")[-1]], n) for n in fused}}), Lazy(disk), []

    def stacked_keys(self, layer: int) -> list[str]:
        """The checkpoint keys of the layer's experts stacked as stored ([E, ...] each), for a port holding them under
        the checkpoint's names; [] where each expert is stored apart."""
        stacked = self.side.mapping.experts.stacked or ()
        keys = [f"{self.side.mapping.layer_prefix(layer)}.{source}" for source in stacked]
        return [key for key in keys if key in self.side.checkpoint.weight_map]

    def stored_stack(self, key: str) -> torch.Tensor:
        """Every expert's tensor as the checkpoint stacks them, float64 (read only when a port asks for it)."""
        return self.side.checkpoint.read([key])[key].double()

    def stored_expert(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """One expert's tensors as stored, under the checkpoint's names (the last one read is kept)."""
        if self._last[0] != (layer, expert):
            self._last = ((layer, expert), self.side.read_layer(layer, expert, dtype=None))
        return self._last[1]

    def stored_tensor(self, layer: int, expert: int, source: str) -> torch.Tensor:
        return self.stored_expert(layer, expert)[source].double()

    def expert(self, layer: int, expert: int, *, dtype: torch.dtype | None = torch.float64) -> dict[str, torch.Tensor]:
        """One expert's gate, up, down (and biases) [out, in], in ``dtype`` (``routed``)."""
        return self.routed(layer, self.stored_expert(layer, expert), dtype)

    def routed(self, layer: int, stored: dict[str, torch.Tensor], dtype: torch.dtype | None
               ) -> dict[str, torch.Tensor]:
        """An expert's tensors as stored -> its gate, up, down (and biases) [out, in] in ``dtype`` (None: as stored,
        for a copy made in the dtype wanted straight from the stored values: one pass, no float64 copy on the way
        to float32; exact either way, every stored float dtype converting exactly into float64)."""
        return {r.target: route_tensor(r, stored[r.source]) if dtype is None else
                route_tensor(r, stored[r.source]).to(dtype) for r in self.side.reader.reference_routes(layer)}

    def fused(self, layer: int, meta: nn.Module, where: str) -> dict[str, torch.Tensor]:
        """Every expert stacked in transformers' fused layout (for a port holding them so)."""
        return fused_experts(meta, (self.expert(layer, e) for e in range(self.side.num_experts)), where)

    def meta_experts(self, layer: int) -> nn.Module:
        """transformers' experts module of the layer's block, on the meta device."""
        return self.side.reference.meta_module(f"{self.site.path}.{self.site.experts}".format(layer=layer))


def _disk_prefix(keys: dict[str, str], stacked: list[str]) -> str:
    """The checkpoint's prefix of the block ('model.layers.1.block_sparse_moe.'), read off a tensor whose stored
    name ends in its name in transformers' block; where none does (a checkpoint storing 'input_linear.weight' for
    'experts.gate_up_proj' and 'router.layer.weight' for 'router.weight'), the dotted prefix all the block's stored
    names share (its own tensors' and its ``stacked`` experts'), so a port named as the checkpoint is still filled;
    '' where there is none."""
    for name, key in keys.items():
        if key.endswith("." + name):
            return key[: -len(name)]
    parts = [key.split(".") for key in [*keys.values(), *stacked]]
    if len(parts) < 2:
        return ""
    common = next((at for at, words in enumerate(zip(*parts, strict=False)) if len(set(words)) > 1),
                  min(map(len, parts)) - 1)
    return ".".join(parts[0][:common]) + "." if common else ""


class Lazy(MappingABC):
    """Tensors by name, each read only when asked for (a large block's experts)."""

    def __init__(self, loaders: dict[str, Callable[[], torch.Tensor]]):
        self.loaders = loaders

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.loaders[name]()

    def __iter__(self):
        return iter(self.loaders)

    def __len__(self) -> int:
        return len(self.loaders)


def _given(tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: tensor
