"""Where a model's dense FFN is, read off transformers' own modules (for parity.engine.layout.derive).

The decoder layers: the ModuleList whose items hold projections, ``num_hidden_layers`` long where the config says
so (a seq2seq family's ForCausalLM is its decoder alone, ``decoder_layers`` long: there the one such list).  A
layer's FFN: the child whose projections (nn.Linear, transformers' Conv1D) map d -> d_ff (one, or two: gate and up,
or one fused [gate; up]) and then d_ff -> d, holding an activation; else the layer's own modules applied in order
(``sources.skeleton.InlineFFN``): a projection d -> d_ff, the activation beside it, the next projection d_ff -> d,
on the layer (OPT's fc1/fc2) or over two children (BERT's intermediate.dense, output.dense).  An FFN whose forward
also takes the residual is used with a zero one, where the module is seen (on random values) to add it at the end.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from parity.definitions.aliases import load_aliases
from parity.engine.layout.experts import find_experts
from parity.engine.layout.flat_experts import holds_flat_experts
from parity.engine.reference import activation_module, measured_function
from parity.errors import MappingError
from parity.sources.skeleton import InlineFFN

# parity.ffn's activations, by transformers' ACT2CLS names of the same function
_SAME_FUNCTION = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_python": "gelu", "relu": "relu",
                  "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_python_tanh": "gelu_tanh"}


def refused(model_type: str | None, why: str, mapping_with: str = "") -> MappingError:
    """Why a layout cannot be derived, in one line: it comes up only where no mapping file serves the type."""
    import transformers

    return MappingError(f"no mapping serves model_type {model_type!r} (config.json), and its layout cannot be derived "
                        f"from transformers {transformers.__version__}: {why}; write a mapping file {mapping_with}and "
                        "pass it with --mapping FILE.toml (docs/own-module.md)")


@dataclass(frozen=True)
class Projection:
    """One projection of an FFN: its name (relative to the FFN module), widths, storage layout and bias."""

    name: str
    d_in: int
    d_out: int
    layout: str  # "out_in" (nn.Linear) | "in_out" (transformers' Conv1D)
    bias: bool


@dataclass(frozen=True)
class FFN:
    """A layer's FFN as transformers builds it: ``path`` relative to the layer ("" + ``inline``: the layer's own
    modules at those paths, ``module`` an InlineFFN of them); ``residual``: its forward takes (x, residual)."""

    path: str
    module: nn.Module
    ins: tuple[Projection, ...]
    out: Projection
    width: int
    inline: tuple[str, ...] = ()
    residual: bool = False
    prenorm: str | None = None  # a norm the FFN's first child applies before its projection (not the FFN's own)

    @property
    def fused(self) -> bool:
        return len(self.ins) == 1 and self.ins[0].d_out == 2 * self.width


def decoder_layers(model: nn.Module, config: Any) -> tuple[str, nn.ModuleList]:
    """The decoder layers: the ModuleList whose items all hold projections.  Where several do, the first
    ``num_hidden_layers`` long (the config's count) whose items each hold an FFN, else the first of that length;
    where none is that long, the one such list outside any other (a seq2seq family's ForCausalLM holds its decoder
    alone, counted by ``decoder_layers``; num_hidden_layers counts the encoder's).  Several, none of the config's
    count: refused, naming them."""
    count = getattr(config, "num_hidden_layers", None)
    lists = layer_lists(model)
    counted = [(path, module) for path, module in lists if len(module) == count  # not a list inside a layer of
               and not any(path.startswith(f"{p}.") for p, _ in lists)]  # another (LongCat-Flash's 2 attentions)
    if len(counted) > 1:  # XLM keeps its attentions and its FFNs in lists of their own: the FFNs' is the one
        d = getattr(config.get_text_config() if hasattr(config, "get_text_config") else config, "hidden_size", None)
        counted = [c for c in counted if isinstance(d, int) and all(find_ffn(item, d) for item in c[1])] or counted
    if counted:
        return counted[0]
    outer = [(path, module) for path, module in lists if not any(path.startswith(f"{p}.") for p, _ in lists)]
    if len(outer) == 1:
        return outer[0]
    found = ", ".join(f"{path} ({len(module)})" for path, module in outer) or "none"
    raise refused(getattr(config, "model_type", None), f"transformers' {type(model).__name__} has no list of {count} "
                  f"decoder layers (config num_hidden_layers = {count}) to find the FFN in, and not one other list "
                  f"of layers holding projections (found: {found})")


def layer_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """Every ModuleList of the model whose items all hold projections (decoder layers, attentions, FFNs, ...)."""
    return [(path, module) for path, module in model.named_modules() if isinstance(module, nn.ModuleList)
            and len(module) and all(projections(layer) for layer in module)]


def decoder_stacks(model: nn.Module, config: Any) -> list[tuple[str, nn.ModuleList]]:
    """The decoder layers (``decoder_layers``); or, where the model keeps them in several lists outside any other,
    each of the same layer class and length and none ``num_hidden_layers`` long (HRM's H and L levels: two stacks
    of the same decoder layer, run in cycles), every such list, each layer of each a layer of its own."""
    try:
        return [decoder_layers(model, config)]
    except MappingError:
        lists = layer_lists(model)
        outer = [(path, module) for path, module in lists if not any(path.startswith(f"{p}.") for p, _ in lists)]
        if len(outer) > 1 and len({(type(module[0]), len(module)) for _, module in outer}) == 1 \
                and all(len({type(layer) for layer in module}) == 1 for _, module in outer):
            return outer
        raise


def projections(module: nn.Module, direct: bool = False) -> list[Projection]:
    """The module's projections (nn.Linear, transformers' Conv1D: by class, through the MRO), in the order they are
    registered; ``direct``: only its own children."""
    aliases = load_aliases()
    found = []
    members = module.named_children() if direct else module.named_modules()
    for name, child in members:
        weight = getattr(child, "weight", None)
        layout = aliases.layout_of([cls.__name__ for cls in type(child).__mro__])
        if layout is None or not isinstance(weight, nn.Parameter) or weight.dim() != 2:
            continue
        d_out, d_in = weight.shape if layout == "out_in" else weight.shape[::-1]
        found.append(Projection(name, int(d_in), int(d_out), layout, getattr(child, "bias", None) is not None))
    return found


def ffn_of(projs: list[Projection], d: int) -> tuple[tuple[Projection, ...], Projection, int] | None:
    """(in projections, out projection, d_ff) when ``projs`` read d -> d_ff (one; two alike; one fused [gate; up])
    and then d_ff -> d, the last registered writing; None for anything else (attention's q/k/v/o)."""
    if len(projs) not in (2, 3):
        return None
    *ins, out = projs
    width = out.d_in
    if out.d_out != d or any(p.d_in != d for p in ins):
        return None
    if len(ins) == 2 and all(p.d_out == width for p in ins) or len(ins) == 1 and ins[0].d_out in (width, 2 * width):
        return tuple(ins), out, width
    return None


def find_ffn(layer: nn.Module, d: int) -> FFN | None:
    """The layer's FFN: the child that is one (holding an activation, when two children read alike), else the
    layer's own modules that form one (``inline_ffn``)."""
    found = []
    for name, child in layer.named_children():
        shape = ffn_of(projections(child), d)
        fused_without_activation = shape is not None and len(shape[0]) == 1 and shape[0][0].d_out == 2 * shape[2] \
            and activation_module(child) is None  # attention's fused qkv then its output (DBRX's Wqkv, out_proj)
        if shape is not None and not fused_without_activation:
            found.append(FFN(name, child, *shape))
    if len(found) > 1:
        found = [f for f in found if activation_module(f.module) is not None]
    if len(found) > 1:  # an FFN is its projections and an activation: a recurrent block holds more (a conv, gates)
        found = [f for f in found if not own_parameters(f)]
    if len(found) == 1:
        return found[0]
    return None if found else inline_ffn(layer, d)


def own_parameters(ffn: FFN) -> list[str]:
    """The FFN module's parameters that are none of its projections' (xIELU's alpha_p; a recurrent block's conv)."""
    projected = {f"{p.name}.{leaf}" for p in (*ffn.ins, ffn.out) for leaf in ("weight", "bias")}
    return [name for name, _ in ffn.module.named_parameters() if name not in projected]


def inline_ffn(layer: nn.Module, d: int) -> FFN | None:
    """An FFN no one child holds: a projection d -> d_ff whose parent (the layer, or a child of it) holds the
    activation, and the projection registered next, d_ff -> d (OPT: fc1, activation_fn, fc2 on the layer; BERT:
    intermediate.dense, intermediate.intermediate_act_fn, then output.dense, whose module goes on to add the
    residual and normalise: not the FFN; the child holding the first two is seen to compute just them).
    Attention's projections have no activation beside them; a second projection d -> d_ff beside the first is a
    gate, and a gated FFN is no such cut."""
    projs = projections(layer)
    for first, second in zip(projs, projs[1:], strict=False):
        if first.d_in != d or second.d_out != d or first.d_out != second.d_in:
            continue
        parent_path = first.name.rpartition(".")[0]
        parent = layer.get_submodule(parent_path)
        act = activation_module(parent)
        if act is None:
            continue
        act_name = next(name for name, child in parent.named_children() if child is act)
        twins = [q for q in projections(parent, direct=True) if (q.d_in, q.d_out) == (d, first.d_out)]
        if len(twins) > 1:  # a gate beside it (gate, up, down on the layer): a gated FFN, not this cut
            continue
        alone = runs_alone(parent, (first.name[len(parent_path) + 1:], act_name), d, first.d_out) \
            if parent_path else True
        if alone is False:
            continue
        steps = (first.name, ".".join(p for p in (parent_path, act_name) if p), second.name)
        prenorm = f"{parent_path}.{alone}" if isinstance(alone, str) else None
        return FFN("", InlineFFN(layer, list(steps)), (first,), second, first.d_out, inline=steps, prenorm=prenorm)
    return None


def usable_alone(ffn: FFN, model_type: str | None) -> FFN:
    """The FFN as the reference can run it on x alone: a forward of (x, residual) that adds the residual at the
    end is run with a zero one (Bloom); other forwards beyond x, and buffers the checkpoint cannot hold (not
    saved with the parameters), are refused in one line."""
    name = type(ffn.module).__name__
    takes = [n for n, p in inspect.signature(ffn.module.forward).parameters.items()
             if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    own = [*ffn.module.parameters(recurse=False), *ffn.module.buffers(recurse=False)]  # ZeroResidual holds children
    if not ffn.inline and len(takes) == 2 and not own and adds_second_input(ffn.module, ffn.out.d_out, ffn.width):
        ffn = dataclasses.replace(ffn, residual=True)
    elif not ffn.inline and len(takes) != 1:
        raise refused(model_type, f"transformers' {name}.forward takes ({', '.join(takes)}), not the FFN's input "
                      "alone, and it does not just add its second input to the FFN's output (checked on the module "
                      "with random values), so what the FFN computes cannot be cut out of it")
    saved = set(ffn.module.state_dict())
    unsaved = [n for n, _ in ffn.module.named_buffers() if n not in saved]
    if unsaved:
        raise refused(model_type, f"transformers' {name} holds buffers it does not save ({', '.join(unsaved)}: "
                      "values neither its parameters nor the checkpoint carry), and reading them into the reference "
                      "is not built yet")
    return ffn


def adds_second_input(module: nn.Module, d: int, width: int) -> bool:
    """Whether ``module(x, r) - module(x, 0) == r``: the module's forward adds its second input at the end (BloomMLP
    adds the residual), checked in float64 on random parameters and inputs, never assumed from a name."""
    probe, generator, d = random_probe(module, d, width)
    x, r = (torch.randn(2, 3, d, generator=generator, dtype=torch.float64) for _ in range(2))
    try:
        with torch.no_grad():
            gap = probe(x, r) - probe(x, torch.zeros_like(r)) - r
    except Exception:  # a forward that cannot run on these inputs does not read as adding them
        return False
    return bool(gap.abs().max() <= 1e-12 * r.abs().max())


def runs_alone(parent: nn.Module, steps: tuple[str, str], d: int, width: int) -> bool | str:
    """Whether a child of the layer holding an FFN's first projection and activation computes just those two
    (BertIntermediate: act(dense(x))), checked as ``adds_second_input`` is; one whose forward does more (or
    takes more than x) is not cut into an FFN.  A child that normalises first, with a norm of its own (a module
    holding only vectors: RoBERTa-PreLayerNorm's intermediate.LayerNorm), computes the FFN on the normed input:
    that norm is the FFN's pre-norm, outside the FFN as every layer's norms are; its name is returned."""
    probe, generator, d = random_probe(parent, d, width)
    x = torch.randn(2, 3, d, generator=generator, dtype=torch.float64)
    norms = [name for name, child in probe.named_children() if name not in steps
             and next(child.parameters(), None) is not None and all(p.dim() == 1 for p in child.parameters())]
    for norm in [None, *norms[:1]] if len(norms) == 1 else [None]:
        try:
            with torch.no_grad():
                normed = x if norm is None else probe.get_submodule(norm)(x)
                want = probe.get_submodule(steps[1])(probe.get_submodule(steps[0])(normed))
                gap = probe(x) - want
        except Exception:  # a forward that cannot run on x alone
            return False
        if gap.abs().max() <= 1e-12 * want.abs().max():
            return norm or True
    return False


PROBE_ELEMENTS = 1 << 20  # a module with more parameters is probed at a small d and d_ff (a real Bloom's: 1.6e9 B)


def random_probe(module: nn.Module, d: int, width: int) -> tuple[nn.Module, torch.Generator, int]:
    """A float64 CPU copy of a (meta-device) module holding random values, in eval mode, the generator on, and the
    d its input has.  A large module's parameters are made d = 8, d_ff = 24 wide along those axes (a forward that
    reads its widths from elsewhere then fails, and the module reads as doing something else: refused, never
    passed)."""
    probe = copy.deepcopy(module)
    if sum(p.numel() for p in probe.parameters()) > PROBE_ELEMENTS and d != width:
        sizes = {d: 8, width: 24}
        for owner in probe.modules():
            for name, param in list(owner.named_parameters(recurse=False)):
                shape = [sizes.get(size, size) for size in param.shape]
                setattr(owner, name, nn.Parameter(torch.empty(shape, device="meta", dtype=param.dtype)))
        d = sizes[d]
    generator = torch.Generator().manual_seed(0)
    probe = probe.to_empty(device="cpu").double().eval()
    with torch.no_grad():
        for tensor in (*probe.parameters(), *probe.buffers()):
            if tensor.is_floating_point():
                tensor.copy_(torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype) * 0.3)
    return probe, generator, d


def activation_of(module: nn.Module) -> str | None:
    """The function of the FFN's activation as parity.ffn names it ('silu', 'gelu', 'gelu_tanh', 'relu'), read off
    its class through transformers' ACT2CLS (torch's nn.GELU by its ``approximate``), else measured
    (``measured_function``); None: none of those."""
    from transformers.activations import ACT2CLS

    act = activation_module(module)
    if act is None:
        return None
    if type(act) is nn.GELU:
        return "gelu_tanh" if act.approximate == "tanh" else "gelu"
    names = {name for name, entry in ACT2CLS.items() if (entry[0] if isinstance(entry, tuple) else entry) is type(act)}
    kinds = {_SAME_FUNCTION[name] for name in names if name in _SAME_FUNCTION}
    if len(kinds) == 1:
        return kinds.pop()
    return None if names else measured_function(act)


def activation_label(module: nn.Module) -> str:
    act = activation_module(module)
    return type(act).__name__ if act is not None else "no activation module"


def has_experts(layer: nn.Module, d: int) -> bool:
    """Whether the layer holds a mixture of experts: a ModuleList of FFNs, or parameters stacked over E experts
    (3-D, not a convolution's) beside a router that scores them (a 2-D weight [E, d] or [d, E]).  A 3-D parameter
    alone is no expert stack (RWKV's [1, 1, d] mixes, RecurrentGemma's block-diagonal gates).  Matrices holding
    every expert's rows one after another (DBRX's [E·ff, d]) are a stack too (layout.flat_experts)."""
    if holds_flat_experts(layer, d) or find_experts(layer, d) is not None:  # a fused experts module (transformers'
        return True  # gate_up_proj and down_proj stacked over experts), whatever its router scores besides them
    matrices = {tuple(p.shape) for p in layer.parameters() if p.dim() == 2}
    for module in layer.modules():
        if isinstance(module, nn.ModuleList) and any(ffn_of(projections(m), _width_in(m)) for m in module):
            return True
        if isinstance(module, nn.modules.conv._ConvNd):
            continue
        stacks = {p.shape[0] for p in module.parameters(recurse=False) if p.dim() == 3}
        if any((count, d) in matrices or (d, count) in matrices for count in stacks):
            return True
    return False


def _width_in(module: nn.Module) -> int:
    projs = projections(module)
    return projs[-1].d_out if projs else -1
