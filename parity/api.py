"""The Python API: ``parity.check`` and ``parity.load_ffn`` (``parity.testing`` holds ``assert_parity``).

A front door like the CLI: it resolves, runs the engine and returns the report; every
rule about what passes lives in the engine, so the API and the CLI cannot disagree.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from torch import nn

from parity.engine.logits import logits_impact
from parity.engine.results import LayerResult, Report
from parity.engine.session import run_session
from parity.engine.suite import open_session
from parity.errors import LayerRangeError
from parity.spec.selection import parse_selection


def check(model: str, layers: str | int | Iterable[int] | None = None, target: str | Any | None = None,
          checkpoint: str | None = None, mapping: str | None = None, revision: str | None = None, seed: int = 0,
          atol: float | None = None, on_layer: Callable[[Report, LayerResult], None] | None = None,
          logits: bool = False, allow_pickle: bool = False, experts: str | int | Iterable[int] | None = None,
          require_real: bool = False) -> Report:
    """Check the selected layers (default: all), one at a time; returns the report the CLI prints.

    ``logits=True`` also substitutes the target into the full model and compares its logits;
    ``allow_pickle`` opts in to pickle-based files (torch.load(weights_only=True)); ``experts``
    selects the experts of an MoE model (default: all), each checked on its own; ``require_real``
    refuses the synthetic stand-in (SyntheticWeightsError) instead of checking random weights."""
    session = open_session(model, checkpoint, mapping, revision, target, seed, atol, allow_pickle, require_real)
    report = run_session(session, layers, on_layer, experts)
    if logits:
        report.logits = logits_impact(session, sorted({r.layer for r in report.layers}))
    return report


def load_ffn(model: str, layer: int = 0, target: str | Any | None = None, checkpoint: str | None = None,
             mapping: str | None = None, revision: str | None = None, allow_pickle: bool = False,
             expert: int | None = None) -> nn.Module:
    """The target module (default: the mapping's, e.g. FeedForward for gpt2) holding ``layer``'s weights
    (of ``expert``, for MoE models), in eval mode."""
    session = open_session(model, checkpoint, mapping, revision, target, allow_pickle=allow_pickle)
    (layer,) = parse_selection(int(layer), session.num_layers)
    if session.num_experts is not None and expert is None:
        raise LayerRangeError(f"'{model}' is a mixture of experts ({session.num_experts} per layer): pass expert=N")
    (expert,) = session.expert_indices(None if expert is None else [int(expert)])
    module, _ = session.build_target(session.read_layer(layer, expert))
    return module
