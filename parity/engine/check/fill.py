"""Filling the module under test: each routed checkpoint tensor (chunked, transposed) into the parameter the
route names, with a message naming both shapes and the likely cause when they disagree.  The same routing
fills the reference (``engine.layer.route_tensor``); ``routes.py`` beside it decides the routes a user's module
gets.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from parity.definitions.aliases import load_aliases
from parity.definitions.families import config_dff
from parity.definitions.mapping import Mapping, TensorRoute, unknown_route_names
from parity.definitions.mistakes import MistakeId
from parity.engine.layer import route_tensor
from parity.errors import MappingError, MissingTensorError, ShapeMismatchError


def fill_target(module: nn.Module, mapping: Mapping, tensors: dict[str, torch.Tensor], config: Any = None) -> list[str]:
    """Copy routed checkpoint tensors (names relative to the layer) into the target's parameters.

    Biases are the one thing a module may legitimately lack or leave unloaded: a bias route
    to a module built without that bias is skipped and an unrouted projection bias is zeroed, both noted,
    so the comparison itself shows whether that matters (diagnosis ``bias_dropped``).  Any other
    route to a name the target lacks is a mapping error (it would route nothing), and so is any
    other unrouted parameter (it would hold arbitrary values).
    """
    params = dict(module.named_parameters())
    skipped = check_target_routes(module, mapping, params)
    routed, notes = set(), []
    for route in mapping.tensors:
        if route in skipped:
            if not route.optional:
                notes.append(f"the target has no parameter '{route.target}': "
                             f"checkpoint tensor '{route.source}' is not used")
            continue
        param = params[route.target]
        if route.zeros:  # declared in the mapping: the checkpoint has no tensor for it
            with torch.no_grad():
                param.zero_()
            notes.append(f"target parameter '{route.target}' set to zero: the checkpoint has no tensor for it "
                         "(a route { zeros = true }, written or inferred)")
            routed.add(route.target)
            continue
        if route.source not in tensors:  # an optional route whose tensor the checkpoint lacks
            raise MissingTensorError(
                f"the target {type(module).__name__} has parameter '{route.target}', but the checkpoint has no "
                f"tensor '{route.source}' for it (mapping {mapping.path.name}); build the target without it "
                "(e.g. bias=False) or use a checkpoint that has it"
            )
        value = route_tensor(route, tensors[route.source])
        if tuple(value.shape) != tuple(param.shape):
            message, mistake = shape_message(route, tuple(value.shape), tuple(param.shape), config)
            error = ShapeMismatchError(message)
            error.mistake_id = mistake
            raise error
        with torch.no_grad():
            param.copy_(value)
        routed.add(route.target)
    unrouted = [name for name in params if name not in routed]
    for name in [n for n in unrouted if is_projection_bias(n, params, routed)]:
        with torch.no_grad():
            params[name].zero_()
        notes.append(f"target parameter '{name}' gets no checkpoint tensor: set to zero")
    unrouted = [n for n in unrouted if not is_projection_bias(n, params, routed)]
    if unrouted:
        raise MappingError(
            f"{mapping.where('tensors')}: the target's parameters {', '.join(unrouted)} get no checkpoint tensor; "
            "route each in [tensors] (they would keep arbitrary initial values)"
        )
    return notes


def is_projection_bias(name: str, params: dict[str, Any], routed: set[str]) -> bool:
    """A projection's bias: the ``bias`` of a submodule whose ``weight`` the routes fill (an nn.Linear built with
    bias=True on a bias-free checkpoint).  The only parameter parity may set to zero unasked: anything else
    without a tensor (a ``gain_bias`` of a (1 + g) scale, a bias of an unrouted module) is a route error."""
    aliases = load_aliases()
    owner, _, leaf = name.rpartition(".")
    weights = [f"{owner}.{w}" for w, kind in aliases.leaves.items() if kind == "weight"]
    return (aliases.leaf_kind(leaf) == "bias" and bool(owner)
            and any(w in routed and w in params for w in weights))


def check_target_routes(module: nn.Module, mapping: Mapping, params: dict[str, nn.Parameter]) -> list[TensorRoute]:
    """Every key of [tensors] must name a parameter of the target; returns the routes to skip.

    Skipped (not an error): an optional route, or a route to a ``bias``, whose owning submodule
    exists but has no such parameter: a module built with bias=False.  A route whose owner does
    not exist either is a misspelt or foreign name, and routing nothing would go unnoticed.
    """
    owners = dict(module.named_modules())
    skipped, missing = [], []
    for route in mapping.tensors:
        if route.target in params:
            continue
        owner, _, leaf = route.target.rpartition(".")
        if (route.optional or leaf == "bias") and owner in owners:
            skipped.append(route)
        else:
            missing.append(route.target)
    if missing:
        raise MappingError(
            unknown_route_names(mapping, "tensors", missing, list(params), f"the target {type(module).__name__}")
            + ". Write the target's parameter names on the left of [tensors] and the checkpoint's tensor names "
              "on the right (a --target with other names than the mapping's needs its own --mapping FILE.toml)."
        )
    return skipped


def width_field(config: Any, width: int) -> str | None:
    """The config field a module built ``width`` wide likely read: one that states a d_ff (aliases.toml
    [config_fields.facts] ffn_width, or any ``*intermediate_size``: moe_, shared_expert_) and holds ``width``."""
    widths = {k for k, v in load_aliases().config_fields.facts.items() if v == "ffn_width"}
    to_dict = getattr(config, "to_dict", None)
    fields = to_dict() if callable(to_dict) else {}
    return next((k for k, v in fields.items() if (k in widths or k.endswith("intermediate_size"))
                 and v == width and not isinstance(v, bool)), None)


def shape_message(route: TensorRoute, found: tuple[int, ...], expected: tuple[int, ...],
                  config: Any) -> tuple[str, str]:
    """Say which tensor, both shapes, and the likely cause; and the diagnosis id of that cause."""
    message = (f"checkpoint tensor '{route.source}' has shape {list(found)} after the mapping's transform, "
               f"but target parameter '{route.target}' has shape {list(expected)}")
    hints = []
    mistake = MistakeId.SHAPE_MISMATCH
    if len(found) == 2 and found[::-1] == expected:
        mistake = MistakeId.MISSING_TRANSPOSE
        hints.append("the shapes are transposed: the mapping's transform for this tensor is probably wrong "
                     "(Conv1D weights are stored [in, out] and need transform = \"transpose\")")
    d_ff = config_dff(config)
    d = getattr(config, "hidden_size", None)
    if d and len(found) == len(expected) and found != expected and found[::-1] != expected:
        # the sizes that differ, position by position: the checkpoint's says which one it is (d, or d_ff)
        differing = [(t, c) for t, c in zip(expected, found, strict=True) if t != c]
        if any(c == d != d_ff for _, c in differing):
            t = next(t for t, c in differing if c == d)
            hints.append(f"the target's d is {t} but the checkpoint's is {d} (its hidden size): the module is "
                         "built for another model's width")
        elif differing:
            t, c = differing[0]
            mistake = MistakeId.INTERMEDIATE_SIZE_MISMATCH
            cause = f"the target's d_ff is {t} but the checkpoint's is {c}"
            if t == 4 * d:
                cause += " (the target uses the 4*d default: pass hidden_dim = config.intermediate_size)"
            elif t == 2 * c:
                cause += " (the target doubles d_ff: Gemma's published size sums gate and up)"
            elif (field := width_field(config, t)) is not None:
                cause += (f" ({t} is the config's {field}, but transformers does not build this unit from it: build "
                          f"the module {c} wide)")
            elif c - t < c / 8:  # a rounding to multiple_of moves d_ff by less than one multiple, a few percent
                cause += " (rounded down instead of up to multiple_of, as llama_intermediate_size must?)"
            hints.append(cause)
    if d_ff and not hints:
        hints.append(f"the checkpoint's config says d={d}, d_ff={d_ff}")
    return message + (": " + "; ".join(hints) if hints else ""), mistake
