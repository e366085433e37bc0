"""The oracle: transformers' own MLP class for a checkpoint's config.

The model is built once from the config on the meta device (no memory, no init), and
each layer's MLP is copied out of it and filled with that layer's tensors under their
HF names.  Nothing here re-implements an FFN.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from parity.definitions.families import config_dff, with_dff
from parity.engine import sliced
from parity.engine.sliced import SlicedMLP, SlicePlan, plan_slices
from parity.engine.upcast import upcast_on_call, works_on_call
from parity.errors import CheckpointError, MappingError, ShapeMismatchError
from parity.sources.skeleton import InlineFFN, ModelSkeleton

_ACTIVATION_CHILD_NAMES = ("act", "act_fn", "activation_fn", "activation")


class ReferenceModel(ModelSkeleton):
    """The skeleton, from which each layer's MLP is cut and filled with that layer's tensors."""

    def __init__(self, config: Any, slice_bytes: int | None = None):
        super().__init__(config)
        self._on_call_ok: dict[tuple[type, torch.dtype], bool] = {}
        # float64 bytes beyond which a layer's reference is computed in slices (read when built: tests lower it)
        self.slice_bytes = sliced.SLICE_BYTES if slice_bytes is None else slice_bytes
        self._narrow: dict[int, ModelSkeleton | None] = {}  # slice width -> the skeleton of MLPs that wide

    def build(self, path: str, tensors: dict[str, torch.Tensor], hidden_size: int | None = None,
              on_call: bool = True, dtype: torch.dtype = torch.float32) -> nn.Module:
        """A real, eval-mode copy of the layer's MLP holding ``tensors`` as stored, computing in float32.

        Weights stay in their stored dtype and are upcast per submodule as it runs
        (``parity.engine.upcast``); ``upcast.compute_in(module, torch.float64)`` switches to float64.
        Where that cannot work, or with ``on_call=False`` (a plain module, for replays that
        convert it themselves), the module is converted to float32 as a whole.  Another ``dtype``
        (bfloat16, float16: the reference's own low-precision run) converts it to that dtype
        straight from the stored tensors, with no float32 copy on the way.
        """
        hidden_size = hidden_size or getattr(self.config, "hidden_size", None)
        meta = self.meta_module(path)
        module = copy.deepcopy(meta)
        expected = {name: tuple(p.shape) for name, p in module.named_parameters()}
        for name, tensor in tensors.items():
            if name in expected and tuple(tensor.shape) != expected[name]:
                raise ShapeMismatchError(
                    f"checkpoint tensor for {type(module).__name__}.{name} has shape {list(tensor.shape)}, but the "
                    f"checkpoint's config (config.json, or a GGUF file's metadata) implies {list(expected[name])} "
                    f"({_sizes(self.config)}): the config and the weights disagree "
                    "(a config for other weights; with your own mapping file, check its [reference.tensors] routes)"
                )
        stored = next((t.dtype for t in tensors.values() if t.is_floating_point()), torch.float32)
        key = (type(meta), stored)
        if key not in self._on_call_ok:
            self._on_call_ok[key] = bool(hidden_size) and works_on_call(meta, stored, int(hidden_size))
        plan = self.slice_plan(path, tensors, hidden_size) if dtype == torch.float32 else None
        if plan is not None:
            return SlicedMLP(tensors, plan, lambda width, act: self.narrow_module(path, width, act),
                             copy.deepcopy(activation_module(meta)), on_call and self._on_call_ok[key]).eval()
        module.load_state_dict(tensors, strict=True, assign=True)
        if dtype != torch.float32:
            module.to(dtype)
        elif on_call and self._on_call_ok[key]:
            upcast_on_call(module, torch.float32)
        else:
            module.float()
        return module.eval()


    def narrow_module(self, path: str, width: int, act: nn.Module) -> nn.Module:
        """transformers' MLP of the layer ``width`` units wide (meta device), running ``act``."""
        module = copy.deepcopy(self._narrow[width].meta_module(path))
        replace_activation(module, act)
        return module

    def slice_plan(self, path: str, tensors: dict[str, torch.Tensor], hidden_size: int | None) -> SlicePlan | None:
        """How to compute this layer in slices along d_ff (parity.engine.sliced), or None: small enough whole,
        or transformers' MLP of the slice width does not hold the slices these tensors cut into."""
        d_ff = config_dff(self.config) or (4 * hidden_size if hidden_size else None)
        shapes = {name: tuple(t.shape) for name, t in tensors.items()}
        plan = plan_slices(shapes, d_ff, hidden_size, self.slice_bytes)
        if plan is None or activation_module(self.meta_module(path)) is None:
            return None
        for width in {stop - start for start, stop in plan.bounds}:
            if width not in self._narrow:
                narrow_config = with_dff(self.config, width)
                self._narrow[width] = None if narrow_config is None else ModelSkeleton(narrow_config)
            skeleton = self._narrow[width]
            expected = {name: tuple(width if axis == plan.axes[name] else size for axis, size in enumerate(shape))
                        for name, shape in shapes.items()}
            try:
                fits = skeleton is not None and skeleton.tensor_shapes(path) == expected
            except (CheckpointError, MappingError):
                fits = False
            if not fits:
                self._narrow[width] = None
                return None
        return plan


def _sizes(config: Any) -> str:
    d, d_ff = getattr(config, "hidden_size", None), config_dff(config)
    return f"d={d}, d_ff={d_ff}" if d_ff else f"d={d}, d_ff=4d"


def activation_module(module: nn.Module) -> nn.Module | None:
    """The activation inside a transformers MLP (GPT2MLP.act, LlamaMLP.act_fn, ...; an inline FFN's step, which may
    sit in a child of the layer: BERT's intermediate.intermediate_act_fn); else the MLP's one child without
    parameters or buffers, no dropout, that acts elementwise (BloomMLP's gelu_impl, a class of Bloom's own)."""
    from transformers.activations import ACT2CLS

    classes = tuple({v[0] if isinstance(v, tuple) else v for v in ACT2CLS.values()})
    children = module.step_modules() if isinstance(module, InlineFFN) else list(module.named_children())
    for name, child in children:
        if name in _ACTIVATION_CHILD_NAMES or isinstance(child, classes):
            return child
    bare = [child for _, child in children if not isinstance(child, nn.Dropout)
            and next(iter(child.parameters()), None) is None and next(iter(child.buffers()), None) is None]
    return bare[0] if len(bare) == 1 and _elementwise(bare[0]) else None


def _elementwise(child: nn.Module) -> bool:
    """Whether a module maps a vector to one of its shape, each value from its own input alone (an activation)."""
    x = torch.linspace(-4.0, 4.0, 9, dtype=torch.float64)
    try:
        with torch.no_grad():
            whole, part = child(x), child(x[3:6])
    except Exception:  # anything that cannot run on a plain vector is no activation
        return False
    return isinstance(whole, torch.Tensor) and whole.shape == x.shape and bool(torch.equal(whole[3:6], part)) \
        and not torch.equal(whole, x)


def replace_activation(module: nn.Module, new: nn.Module) -> None:
    """Put ``new`` wherever ``module``'s activation is registered (an MoE wrapper holds it twice)."""
    act = activation_module(module)
    for parent in list(module.modules()):
        for child_name, child in list(parent.named_children()):
            if child is act:
                setattr(parent, child_name, new)


def activation_name(module: nn.Module, configured: str | None) -> str:
    """The ACT2FN name of the activation the reference really runs (prefers the configured name); for a class of
    the family's own, the ACT2FN name of the function it is measured to compute (``measured_function``)."""
    from transformers.activations import ACT2CLS

    act = activation_module(module)
    if act is None:  # an experts module whose activation sits one level down (DbrxExperts.mlp.activation_fn)
        inner = [activation_module(child) for child in module.children() if next(child.parameters(), None) is not None]
        act = inner[0] if len(inner) == 1 else None
    if act is None:
        return "unknown"
    names = [k for k, v in ACT2CLS.items() if (v[0] if isinstance(v, tuple) else v) is type(act)]
    if configured in names:
        return configured
    if names:
        return names[0]
    measured = measured_function(act)  # a class of the family's own (BloomGelu): the function it computes
    return MEASURED_NAMES[measured] if measured else type(act).__name__


_FUNCTIONS = {"relu": torch.relu, "gelu": nn.functional.gelu, "silu": nn.functional.silu,
              "gelu_tanh": lambda x: nn.functional.gelu(x, approximate="tanh")}
MEASURED_NAMES = {"relu": "relu", "gelu": "gelu", "silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}  # ACT2FN's
# an activation of its own class computes one of those where it agrees with it 10x closer than float32 resolves
SAME_WITHIN = torch.finfo(torch.float32).eps / 10


def measured_function(act: nn.Module) -> str | None:
    """The function ('relu', 'gelu', 'silu', 'gelu_tanh': parity.ffn's names) an activation of its own class
    computes (Bloom's tanh GELU, written with rounded constants): the one it agrees with in float64 over [-12, 12]
    within a tenth of float32's resolution, relative to the value; None where none does, or it holds parameters
    (then it is no fixed function)."""
    if next(iter(act.parameters()), None) is not None:
        return None
    x = torch.linspace(-12.0, 12.0, 4801, dtype=torch.float64)
    try:
        with torch.no_grad():
            got = copy.deepcopy(act).eval()(x)
    except Exception:  # an activation that cannot run alone on a vector is not measured
        return None
    for name, function in _FUNCTIONS.items():
        want = function(x)
        if got.shape == want.shape and bool(((got - want).abs() <= SAME_WITHIN * (want.abs() + 1e-3)).all()):
            return name
    return None
