"""A derived layout written as a mapping file (``--save-mapping`` of a run with no mapping file).

A layout derived from transformers (``engine.layout.derive``) is an in-memory ``Mapping``: written out in full, every
value literal (the layer count, d, the experts' count and d_ff as this checkpoint's config gave them), it is a
mapping file that ``--mapping FILE`` reads back to the same routes, so the run can be repeated, edited, or pinned
against a later transformers whose derivation might differ.  Parts of a derived layout the mapping format has no
key for (several units per layer, a unit serving only some layers, experts flattened over their rows, experts
without a gate) are named, and nothing is written.
"""

from __future__ import annotations

from typing import Any

from parity.definitions.mapping import Mapping, route_spelling
from parity.definitions.toml_text import toml_key, toml_value


def unsaid_part(mapping: Mapping) -> str | None:
    """The first part of a derived layout a mapping file cannot express (None: a file expresses all of it)."""
    units = [mapping, *mapping.parts]
    if len(units) > 1:
        named = ", ".join(unit.unit or "routed experts" for unit in units)
        return (f"its layers hold {len(units)} kinds of unit ({named}), and a mapping file describes one FFN "
                "(or one set of experts) per layer")
    if mapping.layers is not None:
        return (f"its FFN is in layers {', '.join(map(str, mapping.layers))} only, and a mapping file's layout "
                "serves every layer")
    experts = mapping.experts
    if experts is not None and experts.flat:
        return ("its experts are matrices flattened over experts ([E·ff, d]), and [experts] reads an expert along "
                "a dimension of its own")
    if experts is not None and experts.gate is None:
        return "its experts have no gate (down(act(up(x)))), and [experts] needs gate, up and down"
    return None


def layout_text(mapping: Mapping, target_class: str, args: dict[str, Any] | None, tensors: dict[str, Any],
                *, header: str = "") -> str:
    """The mapping file of a derived layout (``unsaid_part`` None), with the target and routes the run used.  The
    layer count, d and the experts' count are literal: the config may say them under other names."""
    model_type = mapping.model_types[0] if mapping.model_types else "model"
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    lines += [f"name = {toml_value(f'{model_type}-saved')}", f"description = {toml_value(mapping.description)}",
              f"model_types = {toml_value(list(mapping.model_types))}",
              f"num_layers = {toml_value(mapping.num_layers)}", f"hidden_size = {toml_value(mapping.hidden_size)}"]
    if mapping.notes:
        lines.append(f"notes = {toml_value(list(mapping.notes))}")
    lines += ["", "[checkpoint]", f"layer_key = {toml_value(mapping.layer_key)}"]
    if mapping.key_prefixes != [""]:
        lines.append(f"key_prefixes = {toml_value(list(mapping.key_prefixes))}")
    lines += ["", "[reference]", f"module = {toml_value(mapping.reference_module)}"]
    if mapping.reference_tensors:
        lines.append(f"tensors = {toml_value({r.target: route_spelling(r) for r in mapping.reference_tensors})}")
    if mapping.experts is not None:
        lines += ["", "[experts]", *_experts_lines(mapping)]
    lines += ["", "[target]", f"class = {toml_value(target_class)}"]
    if args is not None:
        lines.append(f"args = {toml_value(args)}")
    lines += ["", "[tensors]   # target parameter = checkpoint tensor (names relative to the layer)"]
    lines += [f"{toml_value(key)} = {toml_value(spelled)}" for key, spelled in tensors.items()]
    return "\n".join(lines) + "\n"


def _experts_lines(mapping: Mapping) -> list[str]:
    experts = mapping.experts
    lines = [f"count = {toml_value(experts.count)}"]
    if experts.stacked:
        lines.append(f"stacked = {toml_value(list(experts.stacked))}")
    if experts.transposed:
        lines.append("transposed = true")
    roles = [("gate", experts.gate), ("up", experts.up), ("down", experts.down)]
    roles += [(route.target, route) for route in experts.biases]  # gate_bias, up_bias, down_bias
    return lines + [f"{toml_key(role)} = {toml_value(route_spelling(route))}" for role, route in roles]
