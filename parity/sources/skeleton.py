"""transformers' own model for a config, built on the meta device: which tensors a layer's MLP
has and their shapes, without memory or initialisation.  The synthetic checkpoint writes
these shapes; the engine cuts its reference MLPs out of the same skeleton."""

from __future__ import annotations

import logging
from functools import cached_property
from typing import Any

import torch
from torch import nn

from parity.errors import CheckpointError, MappingError


def quiet_transformers() -> None:
    """transformers logs advice meant for training code; parity reports what matters itself."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)


class ModelSkeleton:
    """A meta-device skeleton of the full transformers model: every tensor's name and shape, no memory."""

    def __init__(self, config: Any):
        self.config = config

    @cached_property
    def skeleton(self) -> nn.Module:
        from transformers import AutoModelForCausalLM

        quiet_transformers()
        try:
            with torch.device("meta"):
                return AutoModelForCausalLM.from_config(self.config)
        except Exception as exc:  # transformers raises many types for unusable configs
            raise CheckpointError(
                f"transformers {_transformers_version()} cannot build a model for model_type "
                f"{getattr(self.config, 'model_type', '?')!r} from this config.json: {exc}"
            ) from None

    def meta_module(self, path: str) -> nn.Module:
        path, _, inline = path.partition(INLINE)
        path, residual, _ = path.partition(ZERO_RESIDUAL)
        try:
            module = self.skeleton.get_submodule(path)
            if residual:
                return ZeroResidual(module)
            return InlineFFN(module, inline.split("+")) if inline else module
        except AttributeError:
            raise MappingError(
                f"the reference module path '{path}' does not exist in {type(self.skeleton).__name__} "
                "(mapping key 'reference.module')"
            ) from None

    def tensor_shapes(self, path: str) -> dict[str, tuple[int, ...]]:
        """HF names (relative to the MLP) and shapes of a layer's reference tensors: its parameters and the
        buffers it saves with them (a checkpoint holds those too: Apertus's xIELU beta and eps)."""
        return {name: tuple(t.shape) for name, t in self.meta_module(path).state_dict().items()}


INLINE = ":"  # 'model.decoder.layers.0:fc1+activation_fn+fc2': a layer's own modules that form its FFN (OPT)
ZERO_RESIDUAL = "(x, residual=0)"  # 'transformer.h.0.mlp(x, residual=0)': an MLP that adds the residual (Bloom)


class InlineFFN(nn.Module):
    """A decoder layer's FFN written inline in the layer's forward: the layer's own modules, under their own paths,
    applied in the order given (OPT's fc1, activation_fn, fc2 on the layer; BERT's intermediate.dense,
    intermediate.intermediate_act_fn, output.dense over two children, whose forwards do more than the FFN).  No
    transformers class holds them alone, so this is the reference's module; each step is transformers' own."""

    def __init__(self, layer: nn.Module, steps: list[str]):
        super().__init__()
        self.steps, self.layer_class = list(steps), type(layer).__name__
        for path in self.steps:
            parent = self
            *parents, name = path.split(".")
            for part in parents:  # a plain container per level, so names stay the layer's ('output.dense.weight')
                if not isinstance(getattr(parent, part, None), nn.Module):
                    parent.add_module(part, nn.Module())
                parent = getattr(parent, part)
            parent.add_module(name, layer.get_submodule(path))

    def step_modules(self) -> list[tuple[str, nn.Module]]:
        """(name, module) of each step, in order: the name its parent registers it under."""
        return [(path.rpartition(".")[2], self.get_submodule(path)) for path in self.steps]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for path in self.steps:
            x = self.get_submodule(path)(x)
        return x


class ZeroResidual(nn.Module):
    """An MLP whose forward takes ``(x, residual)`` and adds the residual at the end (BloomMLP), called with a zero
    residual: the FFN's own function, by transformers' own forward.  It holds the MLP's children under their own
    names (the checkpoint's), and runs the MLP's forward, which reads them; engine/structure.py checks on the
    module that the residual is only added, and that the MLP holds no tensor of its own, before choosing this."""

    def __init__(self, module: nn.Module):
        super().__init__()
        object.__setattr__(self, "inner", module)  # not a child: its children are this module's own
        for name, child in module.named_children():
            self.add_module(name, child)

    def train(self, mode: bool = True) -> ZeroResidual:
        self.inner.training = mode  # its forward reads its own flag (dropout on the sum)
        return super().train(mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name, child in self.named_children():  # a child replaced here (a replayed activation) runs there too
            if getattr(self.inner, name) is not child:
                setattr(self.inner, name, child)
        return self.inner(x, torch.zeros_like(x))


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def reference_label(module: nn.Module) -> str:
    """transformers' class a reference module is, as reports name it: the MLP a ZeroResidual runs, the layer an
    InlineFFN takes its modules from ('OPTDecoderLayer's fc1+activation_fn+fc2'); else the module's own class."""
    if isinstance(module, ZeroResidual):
        inner = module.inner
        return f"{type(inner).__module__}.{type(inner).__name__} (residual = 0)"
    if isinstance(module, InlineFFN):
        return f"{module.layer_class}'s {'+'.join(module.steps)}"
    return f"{type(module).__module__}.{type(module).__name__}"

