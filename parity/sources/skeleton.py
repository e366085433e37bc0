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
        try:
            module = self.skeleton.get_submodule(path)
            return InlineFFN(module, inline.split("+")) if inline else module
        except AttributeError:
            raise MappingError(
                f"the reference module path '{path}' does not exist in {type(self.skeleton).__name__} "
                "(mapping key 'reference.module')"
            ) from None

    def tensor_shapes(self, path: str) -> dict[str, tuple[int, ...]]:
        """HF names (relative to the MLP) and shapes of a layer's reference parameters."""
        return {name: tuple(p.shape) for name, p in self.meta_module(path).named_parameters()}


INLINE = ":"  # 'model.decoder.layers.0:fc1+activation_fn+fc2': a layer's own children that form its FFN (OPT)


class InlineFFN(nn.Module):
    """A decoder layer's FFN written inline in the layer's forward (OPT's fc1, activation_fn, fc2): the layer's
    own modules, under their own names, applied in the order given.  No transformers class holds them alone, so
    this is the reference's module; each step is transformers' own."""

    def __init__(self, layer: nn.Module, steps: list[str]):
        super().__init__()
        self.steps = list(steps)
        for name in self.steps:
            self.add_module(name, getattr(layer, name))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name in self.steps:
            x = getattr(self, name)(x)
        return x


def _transformers_version() -> str:
    import transformers

    return transformers.__version__
