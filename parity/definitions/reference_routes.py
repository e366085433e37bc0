"""The oracle is transformers' MLP filled under transformers' own names: what a mapping's [reference.tensors]
may do, and may not.

A checkpoint in a format parity converts (GGUF's ``ffn_gate``, Meta's ``w1``) names its tensors otherwise, and
its built-in format mapping routes them into the MLP's ``gate_proj`` and the like.  A user's mapping may add
routes for a format of its own, but never send a tensor of one role into another role of the MLP: a
[reference.tensors] that swaps ``up_proj`` and ``gate_proj`` makes the reference itself swapped, and a module
with the same mistake would then pass.  Roles are read with the alias table, as for targets.  No torch here.
"""

from __future__ import annotations

from collections.abc import Iterable

from parity.definitions.aliases import load_aliases
from parity.definitions.mapping import Mapping, TensorRoute, route_spelling
from parity.errors import MappingError


def builtin_reference_routes(mapping: Mapping, builtins: Iterable[Mapping]) -> list[TensorRoute]:
    """The [reference.tensors] routes of the built-in mappings serving the same model types (format mappings)."""
    types = set(mapping.model_types)
    return [route for m in builtins if types & set(m.model_types) for route in m.reference_tensors]


def check_reference_roles(mapping: Mapping, reference_names: Iterable[str], builtins: Iterable[Mapping]) -> None:
    """Refuse a user mapping's [reference.tensors] route that fills one role of transformers' MLP with a
    checkpoint tensor of another role (by the alias table), or that moves one of the MLP's own names elsewhere.
    ``builtins``: parity's own mappings (the format mappings, the only ones that may route the reference freely);
    ``mapping`` being one of them, or derived (its routes are transformers' and gguf's own names), is not checked."""
    builtins = list(builtins)
    if mapping.derived or any(mapping is m for m in builtins) or not mapping.reference_tensors:
        return
    have, aliases = set(reference_names), load_aliases()
    allowed = builtin_reference_routes(mapping, builtins)
    for route in mapping.reference_tensors:
        if route.source == route.target or route in allowed:
            continue
        source_roles = {role for role, _ in aliases.roles_of(route.source)}
        target_roles = {role for role, _ in aliases.roles_of(route.target)}
        foreign = route.source in have  # a transformers name: it belongs to the parameter of that name
        if foreign or (source_roles and target_roles and not source_roles & target_roles):
            said = (f"'{route.source}' is transformers' own '{route.source}'" if foreign else
                    f"'{route.source}' plays {'/'.join(sorted(source_roles))}, '{route.target}' "
                    f"{'/'.join(sorted(target_roles))}")
            raise MappingError(
                f"{mapping.where('reference.tensors')}: [reference.tensors] fills transformers' '{route.target}' "
                f"with checkpoint tensor '{route.source}' ({said}): that bends the reference itself, and a module "
                "with the same mistake would pass. The reference is transformers' MLP filled under transformers' "
                "own names; route your module's parameters in [tensors] instead and delete this line")


def reference_routes(routes: Iterable[TensorRoute]) -> dict[str, str | dict]:
    """The reference's routes as a mapping file spells them (the report's ``reference_routes``)."""
    return {route.target: route_spelling(route) for route in routes}
