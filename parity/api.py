"""The Python API: ``parity.check``, ``parity.load_ffn`` and ``parity.render`` (``parity.testing`` holds
``assert_parity``).

A front door like the CLI: it resolves, runs the engine and returns the report; every
rule about what passes lives in the engine, so the API and the CLI cannot disagree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

from parity.definitions.policy import synthetic_action
from parity.definitions.project import CheckSpec
from parity.definitions.selection import parse_selection
from parity.engine.check.build import cwd_importable
from parity.engine.check.logits import logits_impact
from parity.engine.check.session import run_session
from parity.engine.results import LayerResult, Report
from parity.engine.suite import open_session
from parity.errors import LayerRangeError
from parity.outputs.render import render, render_html  # importing it makes str(report) the text table

__all__ = ["check", "compare", "load_ffn", "render", "render_html"]


def check(model: str, *, layers: str | int | Iterable[int] | None = None, target: str | Any | None = None,
          checkpoint: str | None = None, mapping: str | None = None, revision: str | None = None, seed: int = 0,
          atol: float | None = None, on_layer: Callable[[Report, LayerResult], None] | None = None,
          logits: bool = False, allow_pickle: bool = False, experts: str | int | Iterable[int] | None = None,
          require_real: bool = False, device: str | Any = "cpu", dtype: str | Any = "float32",
          block: bool | None = None) -> Report:
    """Check the selected layers, one at a time, against transformers' own MLP.

    The options build the same CheckSpec as ``parity MODEL`` and a project file's ``[[checks]]`` entry; every
    rule about what passes lives in the engine, so the API and the CLI cannot disagree.

    Args:
        model: a mapping name (``"gpt2"``), a hub id, a local folder or file (``.safetensors``, ``.gguf``).
        layers: ``None`` (all; first, middle and last of a large synthetic stand-in), an int, ``"0,3"``, ``"2-7"``.
        target: a class, a factory (``lambda config: MLP(...)``), an ``nn.Module`` instance (each layer is loaded
            into a deep copy; the instance is never modified) or ``"module:Name"``; default: the mapping's.
            Without a mapping, routes are read off the target's parameter names (``report.routes``).
        checkpoint, mapping, revision: weights instead of the mapping's default, a mapping file, a hub revision.
        seed, atol: the inputs' seed; an absolute tolerance instead of the noise-floor-derived one (the report
            then lists the mistakes it can no longer tell apart).
        on_layer: called with (report, layer result) as each layer finishes.
        logits: also substitute the target into the full model and compare its final logits.
        allow_pickle: open pickle-based files, with ``torch.load(weights_only=True)``.
        experts: MoE models: which experts of each layer (default all).
        block: MoE models: each layer's whole sparse block (router, top-k, weights, experts, shared experts) is one
            unit, checked against transformers' own block; default: so when ``target`` holds more than one
            expert's tensors and ``experts`` is not given.
        require_real: refuse the synthetic stand-in (SyntheticWeightsError) instead of checking random weights.
        device, dtype: where and in what the target computes (``"cuda:0"`` or ``torch.device``; ``"bfloat16"`` or
            ``torch.bfloat16``): a low precision is held to the reference's own error in that dtype.

    Returns:
        The Report (``print(report)`` shows the CLI's table; ``report.passed``, ``report.to_json()``).

    Raises:
        ParityError: bad input (exit code 2's), e.g. SyntheticWeightsError, TargetError, MappingError.

    Example::

        report = parity.check("gpt2", target="mymodel:MLP", layers=[0, 11])
        assert report.passed, report
    """
    device, dtype = compute_names(device, dtype)
    spec = CheckSpec(model=model, checkpoint=checkpoint, layers=layers, target=target, mapping=mapping,
                     revision=revision, seed=seed, atol=atol, logits=logits, allow_pickle=allow_pickle,
                     experts=experts, block=block, require_real=require_real, device=device, dtype=dtype)
    with cwd_importable():
        session = open_session(spec)
        report = run_session(session, spec.layers, on_layer, spec.experts, spec.block_choice)
        if spec.logits:
            report.logits = logits_impact(session, sorted({r.layer for r in report.layers}))
    return report


def compare(a: str, b: str, *, layers: str | int | Iterable[int] | None = None, revision: str | None = None,
            revision_b: str | None = None, allow_pickle: bool = False, seed: int = 0,
            experts: str | int | Iterable[int] | None = None, require_real: bool = False,
            on_layer: Callable[[Report, LayerResult], None] | None = None) -> Report:
    """Judge checkpoint B (a re-save, a cast, a GGUF export, a quantization of A) against checkpoint A, layer by
    layer, as functions: transformers' MLP built from A's config holding A's layer is the truth, the same class
    holding B's layer (read through B's own format and names) the candidate.  B passes where it deviates no more
    than its storage can honestly explain (float32 noise, its dtype's rounding, its quantization's step);
    a failing layer names the conversion mistake it reproduces (``gate_up_exchanged``, ``layer_shifted``, ...).

    Args:
        a, b: any source a check reads: a local folder, a ``.gguf`` file, a hub id, a Meta ``.pth`` folder
            (with ``allow_pickle``); A is the reference, B the candidate.
        layers: as for ``check`` (default all layers both hold).
        revision, revision_b: hub revisions of A and of B.
        allow_pickle: open pickle-based files of either side (``torch.load(weights_only=True)``).
        seed: the inputs' seed.
        experts: MoE: the experts to judge, each its own unit (default all).
        require_real: raise ``SyntheticWeightsError`` when either side has only the synthetic stand-in; by
            default it is compared and ``report.synthetic`` is true (``parity.definitions.policy``).
        on_layer: called with (report, layer result) as each layer finishes.

    Returns:
        The Report (the same type ``check`` returns; ``target`` names B, ``report.comparison`` holds both sides
        and the inventory outside the FFN, each layer's ``conversion`` what the conversion may change).

    Raises:
        ParityError: bad input (exit code 2's); a revision given with a local path, too.
        SyntheticWeightsError: with ``require_real``, a side that has only the synthetic stand-in.

    Example::

        report = parity.compare("llama-hf/", "llama-Q8_0.gguf")
        assert report.passed, report.to_json()
    """
    from parity.definitions.project import CompareSpec
    from parity.engine.compare.comparison import open_comparison, run_comparison
    from parity.outputs import compare_text  # noqa: F401  (importing it makes str(report) the compare table)

    refuse = synthetic_action("parity.compare", require_real or None) == "refuse"
    spec = CompareSpec(a=a, b=b, revision=revision, revision_b=revision_b, allow_pickle=allow_pickle, seed=seed,
                       experts=experts, require_real=refuse)
    return run_comparison(open_comparison(spec), layers, on_layer)


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
             expert: int | None = None, unit: str | None = None) -> nn.Module:
    """The target module (default: the mapping's, e.g. ``FeedForward`` for gpt2) holding one layer's weights.

    Args:
        model: as for ``check``.
        layer: the layer whose FFN tensors fill the module.
        target, checkpoint, mapping, revision, allow_pickle: as for ``check`` (an instance target: a filled deep
            copy is returned, the instance is not modified).
        expert: MoE models: which expert of the layer (required for them).
        unit: where a layer holds several kinds of unit (a derived layout: ``"shared_experts"``, or a dense
            ``"mlp"`` before the MoE layers), which one; a layer's one dense FFN needs none.

    Returns:
        The filled module, in eval mode.

    Raises:
        ParityError: bad input; LayerRangeError for a layer (or expert) outside the model.

    Example::

        ffn = parity.load_ffn("gpt2", layer=3)  # a parity.ffn.FeedForward with GPT-2's layer-3 weights
    """
    with cwd_importable():
        session = open_session(model, checkpoint=checkpoint, mapping=mapping, revision=revision, target=target,
                               allow_pickle=allow_pickle)
        (layer,) = parse_selection(int(layer), session.num_layers)
        session = unit_session(session, model, layer, expert, unit)
        if session.num_experts is not None and expert is None:
            raise LayerRangeError(f"'{model}' is a mixture of experts ({session.num_experts} per layer): "
                                  "pass expert=N")
        (expert,) = session.expert_indices(None if expert is None else [int(expert)])
        module, _ = session.build_target(session.read_layer(layer, expert))
    return module


def unit_session(session: Any, model: str, layer: int, expert: int | None, unit: str | None) -> Any:
    """The layout (the session, or one of its parts) of the unit of ``layer`` asked for: the named ``unit``, else
    the routed experts when an expert is given, else the layer's dense FFN (or its experts, if it has no other)."""
    units = [s for s in (session, *session.parts) if s.mapping.serves(layer)]
    names = ", ".join(s.mapping.unit or "routed experts (expert=N)" for s in units)
    if unit is None and expert is None and len(units) > 1:
        raise LayerRangeError(f"layer {layer} of '{model}' holds {names}: pass expert=N or unit=NAME")
    if unit is not None:
        chosen = [s for s in units if s.mapping.unit == unit]
    else:
        chosen = [s for s in units if (s.num_experts is not None) == (expert is not None)] or units
    if not chosen:
        raise LayerRangeError(f"layer {layer} of '{model}' has no unit {unit!r}; its units: {names}")
    return chosen[0]

