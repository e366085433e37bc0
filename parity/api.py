"""The Python API: ``parity.check``, ``parity.load_ffn`` and ``parity.render`` (``parity.testing`` holds
``assert_parity``).

A front door like the CLI: it resolves, runs the engine and returns the report; every
rule about what passes lives in the engine, so the API and the CLI cannot disagree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

from parity.engine.logits import logits_impact
from parity.engine.results import LayerResult, Report
from parity.engine.session import run_session
from parity.engine.suite import open_session
from parity.engine.target import cwd_importable
from parity.errors import LayerRangeError
from parity.outputs.render import render, render_html  # importing it makes str(report) the text table
from parity.spec.selection import parse_selection

__all__ = ["check", "load_ffn", "render", "render_html"]


def check(model: str, *, layers: str | int | Iterable[int] | None = None, target: str | Any | None = None,
          checkpoint: str | None = None, mapping: str | None = None, revision: str | None = None, seed: int = 0,
          atol: float | None = None, on_layer: Callable[[Report, LayerResult], None] | None = None,
          logits: bool = False, allow_pickle: bool = False, experts: str | int | Iterable[int] | None = None,
          require_real: bool = False, device: str | Any = "cpu", dtype: str | Any = "float32") -> Report:
    """Check the selected layers (default: all), one at a time; returns the report the CLI prints
    (``print(report)`` shows its table).

    ``target``: a class, a factory (``lambda config: MLP(...)``), an ``nn.Module`` instance (each layer
    is loaded into a deep copy of it; the instance itself is never modified) or a "module:Name" string,
    imported with the working directory importable as the `parity` command does.  Without a mapping,
    a target whose parameters have other names than the built-in mapping's gets routes read off its
    parameter names (``report.routes``).
    ``logits=True`` also substitutes the target into the full model and compares its logits;
    ``allow_pickle`` opts in to pickle-based files (torch.load(weights_only=True)); ``experts``
    selects the experts of an MoE model (default: all), each checked on its own; ``require_real``
    refuses the synthetic stand-in (SyntheticWeightsError) instead of checking random weights; ``device``
    (cpu, cuda, cuda:N, mps) and ``dtype`` (float32, bfloat16, float16) say where and in what the target
    computes: a low precision is held to the reference's own error in that dtype."""
    device, dtype = compute_names(device, dtype)
    with cwd_importable():
        session = open_session(model, checkpoint, mapping, revision, target, seed, atol, allow_pickle,
                               require_real, device, dtype)
        report = run_session(session, layers, on_layer, experts)
        if logits:
            report.logits = logits_impact(session, sorted({r.layer for r in report.layers}))
    return report


def compute_names(device: Any, dtype: Any) -> tuple[str, str]:
    """``torch.device("cuda", 0)`` and ``torch.bfloat16`` as the names the CLI takes ('cuda:0', 'bfloat16')."""
    import torch

    if isinstance(device, torch.device):
        device = str(device)
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    return device, dtype


def load_ffn(model: str, *, layer: int = 0, target: str | Any | None = None, checkpoint: str | None = None,
             mapping: str | None = None, revision: str | None = None, allow_pickle: bool = False,
             expert: int | None = None) -> nn.Module:
    """The target module (default: the mapping's, e.g. FeedForward for gpt2) holding ``layer``'s weights
    (of ``expert``, for MoE models), in eval mode.  ``target`` as for ``check`` (an instance: a filled deep
    copy is returned)."""
    with cwd_importable():
        session = open_session(model, checkpoint, mapping, revision, target, allow_pickle=allow_pickle)
        (layer,) = parse_selection(int(layer), session.num_layers)
        if session.num_experts is not None and expert is None:
            raise LayerRangeError(f"'{model}' is a mixture of experts ({session.num_experts} per layer): "
                                  "pass expert=N")
        (expert,) = session.expert_indices(None if expert is None else [int(expert)])
        module, _ = session.build_target(session.read_layer(layer, expert))
    return module
