"""Which checkpoint tensor fills which parameter of the target.

The mapping's [tensors] do, unless a user's ``--target`` is checked with a built-in mapping whose
[tensors] name other parameters (``parity MODEL --target mymodel:MLP``, no mapping file): then the
routes are read off the target's parameter names with the alias table (``mappings/aliases.toml``).
The built-in mapping still says where each role's tensor is in the checkpoint (its own routes name
parity's modules, whose parameters are in the table too); the names say which parameter plays it.

Assignment is by name only.  parity never tries assignments until the module passes: that would
hide a gate/up swap in the user's own loading code.  A weight's orientation follows the shapes where
they tell ([d_ff, d] or [d, d_ff]); for a square weight, the family's stored layout and the class of
the module that owns the parameter (nn.Linear [out, in], transformers' Conv1D [in, out]).  A name
in no table, or two parameters claiming one role, stops the run (exit 2) with a mapping to edit.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from parity.definitions.aliases import Aliases, Group, load_aliases
from parity.definitions.mapping import Mapping, TensorRoute, is_builtin, route_spelling
from parity.definitions.toml_text import mapping_text
from parity.engine.check.build import target_label
from parity.engine.check.fill import check_target_routes, is_projection_bias
from parity.errors import MappingError

Role = tuple[str, str]  # (role name, "weight" | "bias")


class TargetRoutes:
    """The routes a session fills its target through, decided on the first layer (the same for every layer)."""

    def __init__(self, mapping: Mapping, target: Any, infer: bool):
        self.mapping = mapping
        self.label = target_label(target if target is not None else mapping.target_class)
        self.infer = infer  # a user's target with a built-in mapping
        self.used: Mapping | None = None
        self.inferred = False
        self.args: dict | None = None
        self.notes: list[str] = []

    def choose(self, module: nn.Module, tensors: dict[str, torch.Tensor], hidden_size: int,
               args: dict | None) -> Mapping:
        """The mapping whose [tensors] fill ``module``: the session's own, or one with routes inferred from names."""
        self.args = args
        if self.used is None:
            if self.infer and not mapping_fits(module, self.mapping):
                routes, self.notes = infer_routes(module, self.mapping, tensors, hidden_size, self.label, args)
                self.used = dataclasses.replace(self.mapping, tensors=routes, text="")
                self.inferred = True
            elif self.infer:  # the built-in names fit a user's module: its owners' classes say each weight's layout
                self.used = reoriented(module, self.mapping, tensors, hidden_size)
            else:
                self.used = self.mapping
        return self.used

    def describe(self) -> dict[str, Any] | None:
        """The report's ``routes``: how the target was filled, as a mapping file writes it (``--save-mapping``)."""
        if self.used is None:
            return None
        return {"inferred": self.inferred, "extends": mapping_reference(self.mapping), "args": self.args,
                "tensors": {route.target: route_spelling(route) for route in self.used.tensors}}


def owner_layout(module: nn.Module, name: str, aliases: Aliases) -> str | None:
    """'out_in' | 'in_out' as the class of the module owning parameter ``name`` stores its weight (nn.Linear,
    transformers' Conv1D; by MRO), else None."""
    owner = owner_of(module, name)
    declared = getattr(owner, "parity_layout", None)  # a foreign framework's layer says it (parity.targets)
    return declared or aliases.layout_of([cls.__name__ for cls in type(owner).__mro__])


def owner_of(module: nn.Module, name: str) -> nn.Module:
    """The submodule holding parameter ``name`` (by named_modules: a TorchScript module has no get_submodule)."""
    return dict(module.named_modules())[name.rpartition(".")[0]]


def reoriented(module: nn.Module, family: Mapping, tensors: dict[str, torch.Tensor], hidden_size: int) -> Mapping:
    """A built-in mapping's routes for a user's module whose parameters carry the mapping's names: each weight's
    transform follows the class of the module that owns it.  The built-in routes are written for parity's own
    modules (nn.Linear); a module that keeps transformers' Conv1D under those names stores the weight as the
    checkpoint does, and transposing it would accuse a correct module of missing_transpose."""
    aliases = load_aliases()
    routes = []
    for route in family.tensors:
        roles = aliases.roles_of(route.target)
        kind = route.target.rpartition(".")[2]
        if kind != "weight" or len(roles) != 1 or route.source not in tensors:
            routes.append(route)
            continue
        (role, _), = roles
        param = dict(module.named_parameters())[route.target]
        transform = orientation(route, stored_shape(route, tensors), tuple(param.shape), aliases.roles[role].side,
                                hidden_size, owner_layout(module, route.target, aliases))
        keep = transform in (None, route.transform)
        routes.append(route if keep else dataclasses.replace(route, transform=transform))
    return family if routes == list(family.tensors) else dataclasses.replace(family, tensors=routes, text="")


def mapping_reference(mapping: Mapping) -> str:
    """How ``extends`` names a mapping: a built-in's name, else its file."""
    return mapping.name if is_builtin(mapping) else str(mapping.path.resolve())


def mapping_fits(module: nn.Module, mapping: Mapping) -> bool:
    """Whether the mapping's [tensors] name this module's parameters (and route every weight)."""
    params = dict(module.named_parameters())
    try:
        check_target_routes(module, mapping, params)
    except MappingError:
        return False
    routed = {route.target for route in mapping.tensors}
    return all(name in routed or is_projection_bias(name, params, routed) for name in params)


def family_roles(family: Mapping, aliases: Aliases) -> dict[Role, TensorRoute]:
    """(role, weight|bias) -> the family's route for it (its target named as parity's own modules name it)."""
    canon: dict[Role, TensorRoute] = {}
    for route in family.tensors:
        roles = aliases.roles_of(route.target)
        if len(roles) != 1:
            raise MappingError(f"{family.path}: [tensors] key '{route.target}' plays no single role in "
                               f"{aliases.path}; routes cannot be inferred with this mapping: give --mapping FILE")
        canon[roles.pop()] = route
    for kind in ("weight", "bias"):  # stored fused: a fused parameter takes it whole, as transformers lays it out
        gate, up = canon.get(("gate", kind)), canon.get(("up", kind))
        if gate is not None and up is not None and gate.source == up.source \
                and (gate.chunk, up.chunk) == ((0, 2), (1, 2)) and gate.interleaved == up.interleaved:
            canon[("gate_up", kind)] = TensorRoute("", gate.source, gate.transform if kind == "weight" else "none")
    return canon


def member_of(name: str) -> str:
    """The group member a parameter belongs to: its submodule ("fc1" for "fc1.weight"), or itself when bare."""
    owner, _, leaf = name.rpartition(".")
    return owner if owner and load_aliases().leaf_kind(leaf) else name


def group_assignment(group: Group, params: dict[str, tuple[int, ...]]) -> dict[str, Role]:
    """The role the group gives each of the module's parameters that belongs to one of its members: a submodule
    member's .weight/.bias, or a bare member parameter as the group spells it ("up.bias")."""
    assigned: dict[str, Role] = {}
    for name in params:
        member = member_of(name)
        if member in group.members:
            role, kind = group.role_of(member)
            assigned[name] = (role, name.rpartition(".")[2] if member != name else kind)
    return assigned


def group_roles(params: dict[str, tuple[int, ...]], canon: dict[Role, TensorRoute], aliases: Aliases,
                stored: dict[Role, tuple[int, ...]]) -> tuple[Group, dict[str, Role]] | None:
    """The first convention group (aliases.toml [[groups]]) whose members are exactly the module's projections,
    whose roles the checkpoint has, and whose every weight's shape fits its role's stored tensor (as stored or
    transposed); with each parameter's role.  None when no group applies."""
    members = {member_of(name) for name in params}
    for group in aliases.groups:
        weights = {m for m in group.members if group.role_of(m)[1] == "weight"}
        if not weights <= members or not members <= set(group.members):
            continue
        assigned = group_assignment(group, params)
        fits = all(role in stored and params[name] in (stored[role], stored[role][::-1])
                   for name, role in assigned.items() if role[1] == "weight")
        if fits:
            return group, assigned
    return None


def near_group(params: dict[str, tuple[int, ...]], aliases: Aliases) -> tuple[dict[str, Role], list[str]] | None:
    """A module whose projections are a convention group's plus parameters of its own (a ``gain_bias``): the group's
    roles, and the one problem that stands in the way, said first, instead of the per-name reading of names the
    group gives other roles."""
    members = {member_of(name) for name in params}
    for group in aliases.groups:
        weights = {m for m in group.members if group.role_of(m)[1] == "weight"}
        extra = sorted(members - set(group.members))
        if not weights <= members or not extra:
            continue
        assigned = group_assignment(group, params)
        others = [n for n in params if member_of(n) in extra]
        verb = "belongs" if len(others) == 1 else "belong"
        return assigned, [f"{', '.join(repr(n) for n in others)} {verb} to no projection (the other parameters "
                          f"follow the {'/'.join(sorted(weights))} layout): route each in a mapping, or write "
                          "{ zeros = true } for one the checkpoint has no tensor for"]
    return None


def assign_roles(params: dict[str, tuple[int, ...]], canon: dict[Role, TensorRoute], aliases: Aliases,
                 stored: dict[Role, tuple[int, ...]] | None = None) -> tuple[dict[str, Role], list[str]]:
    """Each parameter's role read off its name among the roles the checkpoint has (after ``group_roles`` found no
    convention group), and what stands in the way."""
    near = near_group(params, aliases)
    if near is not None:
        return near
    available = {role for role, _ in canon}
    assigned: dict[str, Role] = {}
    problems: list[str] = []
    for name in params:
        known = aliases.roles_of(name)
        fitting = {r for r in known if r[0] in available}
        if len(fitting) == 1:
            assigned[name] = fitting.pop()
        elif fitting:
            problems.append(f"'{name}' reads as {' or '.join(sorted(r for r, _ in fitting))} alike")
        elif known:
            problems.append(f"'{name}' reads as {' or '.join(sorted(r for r, _ in known))}, which this checkpoint "
                            f"does not store as such")
        else:
            problems.append(f"'{name}' is no name in {aliases.path.name}")
    claims: dict[Role, list[str]] = {}
    for name, role in assigned.items():
        claims.setdefault(role, []).append(name)
    problems += [f"{' and '.join(repr(n) for n in names)} all read as the {role} {kind}"
                 for (role, kind), names in claims.items() if len(names) > 1]
    covered = {role for role, kind in assigned.values() if kind == "weight"}
    covered |= {part for role in covered for part in aliases.roles[role].fuses}
    if "gate_up" in covered and {"gate", "up"} & {r for r, k in assigned.values() if k == "weight"}:
        problems.append("the target has a fused gate_up weight and a separate gate or up weight")
    needed = sorted({role for role, kind in canon if kind == "weight" and role != "gate_up"} - covered)
    problems += [f"no parameter reads as the {role} projection (checkpoint tensor "
                 f"'{canon[(role, 'weight')].source}')" for role in needed]
    return assigned, [*kind_mismatch(params, canon, aliases, stored), *problems]


def kind_mismatch(params: dict[str, tuple[int, ...]], canon: dict[Role, TensorRoute], aliases: Aliases,
                  stored: dict[Role, tuple[int, ...]] | None = None) -> list[str]:
    """A classic two-matrix FFN pointed at a gated checkpoint (or the reverse) cannot compute its layers: said first,
    before the roles it lacks.  Judged by the shapes, not the names: a module whose weight matrices fit the
    checkpoint's (as stored or transposed, one each) can compute it whatever its names say."""
    theirs = {aliases.roles[role].kind for name in params for role, _ in aliases.roles_of(name)}
    ours = {aliases.roles[role].kind for role, _ in canon}
    if not theirs or theirs & ours or shapes_fit(params, stored or {}):
        return []
    shown = {"gated": "a gated FFN (gate, up, down: SwiGLU/GeGLU)", "classic": "a classic FFN (fc_in, fc_out)"}
    return [f"the target's parameter names make it {' or '.join(shown[k] for k in sorted(theirs))}, but this "
            f"checkpoint's layers are {' or '.join(shown[k] for k in sorted(ours))}: it cannot compute them (check "
            "the model family, or the module)"]


def shapes_fit(params: dict[str, tuple[int, ...]], stored: dict[Role, tuple[int, ...]]) -> bool:
    """Whether the module's 2-D weights match the checkpoint's weight tensors one to one (as stored or transposed)."""
    mine = sorted(tuple(sorted(shape)) for shape in params.values() if len(shape) == 2)
    theirs = sorted(tuple(sorted(shape)) for (role, kind), shape in stored.items()
                    if kind == "weight" and role != "gate_up" and len(shape) == 2)
    return bool(mine) and mine == theirs


def infer_routes(module: nn.Module, family: Mapping, tensors: dict[str, torch.Tensor], hidden_size: int,
                 label: str, args: dict | None) -> tuple[list[TensorRoute], list[str]]:
    """Routes for ``module`` read off its parameter names; MappingError (exit 2) with a mapping to edit when
    the names do not say."""
    aliases = load_aliases()
    canon = family_roles(family, aliases)
    params = {name: tuple(p.shape) for name, p in module.named_parameters()}
    stored = {role: stored_shape(route, tensors) for role, route in canon.items() if route.source in tensors}
    group = group_roles(params, canon, aliases, stored)  # a convention group first, else the names one by one
    assigned, problems = (group[1], []) if group is not None else assign_roles(params, canon, aliases, stored)
    bare = {name: group[0].layout for name in params if group is not None and member_of(name) == name}
    if problems:
        headline = (f"cannot tell which checkpoint tensor goes into which parameter of {label} from their names: "
                    f"{'; '.join(problems)}. parity reads roles off parameter names ({aliases.path}) and never "
                    "tries assignments until one passes (that would hide a gate/up swap in your own loading "
                    "code): write the routes in a mapping file (one to edit is printed with this error) and "
                    "pass it with --mapping FILE.toml")
        layouts = {name: owner_layout(module, name, aliases) for name in params}
        details, template = unroutable(label, family, params, assigned, canon, tensors, args, layouts)
        error = MappingError(f"{headline}\n{details}")
        error.headline, error.details = headline, details  # the CLI prints the details, then the one-line error
        error.template = template  # --save-mapping writes it, so the user edits a file instead of a terminal
        raise error
    routes, notes = [], []
    for name, (role, kind) in assigned.items():
        base = canon.get((role, kind))
        if base is not None and base.optional and base.source not in tensors:
            base = None  # an optional bias (LLaMA's mlp_bias) this checkpoint does not have
        if base is None:  # a bias the checkpoint has no tensor for
            if kind == "bias" and member_of(name) == name:  # a bare one (TransformerLens' b_in): declared zero
                routes.append(TensorRoute(name, "", zeros=True))
            continue  # a submodule's: fill_target zeroes it as a projection's bias and says so
        if kind == "bias":
            routes.append(dataclasses.replace(base, target=name, transform="none"))
            continue
        transform = orientation(base, stored_shape(base, tensors), params[name], aliases.roles[role].side,
                                hidden_size, bare.get(name) or owner_layout(module, name, aliases)
                                or experts_own_layout(family, name))
        if transform is None:
            transform = base.transform
            owner = type(owner_of(module, name)).__name__
            notes.append(f"target parameter '{name}' is square and its owner {owner} is neither "
                         "nn.Linear nor Conv1D: its layout was taken as nn.Linear's [out, in]")
        routes.append(dataclasses.replace(base, target=name, transform=transform))
    return routes, notes


def experts_own_layout(family: Mapping, name: str) -> str | None:
    """How transformers' experts module stores its parameter ``name`` ('in_out' where it computes x @ W: its
    is_transposed, read into [experts] transposed; or a flattened matrix read transposed, DBRX's w2), for a port's
    bare parameter of that very name (GPT-OSS's gate_up_proj [d, 2·ff]); None for any other name."""
    experts = family.experts
    route = next((r for r in experts.routes if r.source == name), None) if experts is not None else None
    if route is None:
        return None
    return "in_out" if experts.transposed != (route.transform == "transpose") else "out_in"


def proposals(shape: tuple[int, ...], shapes: dict[str, tuple[int, ...]], stored_layouts: dict[str, str],
              layout: str | None) -> list[str]:
    """How each checkpoint tensor could fill a parameter of ``shape``, spelled as a [tensors] line's value: as
    stored, or transposed where the parameter's owner stores the other layout (its class says: nn.Linear [out, in],
    Conv1D [in, out]; a bare parameter: by shape alone)."""
    found = []
    for source, stored in shapes.items():
        if len(shape) != len(stored):
            continue
        if len(shape) == 2 and layout is not None:
            flip = layout != stored_layouts.get(source, "out_in")
            options = [("transpose" if flip else "none", stored[::-1] if flip else stored)]
        else:
            options = [("none", stored)] + ([("transpose", stored[::-1])] if len(shape) == 2 else [])
        for transform, after in options:
            if after == shape:
                found.append(f'"{source}"' if transform == "none" else
                             f'{{ from = "{source}", transform = "transpose" }} ({source}, transposed)')
    return list(dict.fromkeys(found))


def stored_shape(route: TensorRoute, tensors: dict[str, torch.Tensor]) -> tuple[int, ...]:
    """The shape of a route's checkpoint tensor as stored, after its chunk (before any transform)."""
    shape = list(tensors[route.source].shape)
    if route.chunk is not None and shape:
        shape[0] //= route.chunk[1]
    return tuple(shape)


def layout(shape: tuple[int, ...], side: str, d: int) -> str | None:
    """'out_in' (nn.Linear) or 'in_out' (Conv1D) for a non-square 2-D weight of a projection that reads
    (side "in") or writes ("out") the model width d; None when its shape cannot tell."""
    if len(shape) != 2 or shape[0] == shape[1]:
        return None
    first, second = shape[0] == d, shape[1] == d
    if side == "in":
        return "out_in" if second else "in_out" if first else None
    return "out_in" if first else "in_out" if second else None


def orientation(base: TensorRoute, stored: tuple[int, ...], target: tuple[int, ...], side: str, d: int,
                owner_layout: str | None) -> str | None:
    """The transform ("none" | "transpose") from the stored tensor to the target's weight.  A square stored
    tensor is in the family's layout (its built-in route transposes into nn.Linear iff it is stored [in, out]);
    a target weight in its owner's class's layout (nn.Linear, Conv1D) first, else as its shape says (None: a
    square weight whose owner's class does not say)."""
    square = len(stored) == 2 and stored[0] == stored[1]
    stored_layout = ("in_out" if base.transform == "transpose" else "out_in") if square else layout(stored, side, d)
    if owner_layout is not None and len(target) == 2:  # the owner's class says, square or not
        target_layout = owner_layout
    elif len(target) == 2 and target[0] == target[1]:
        return None
    else:
        target_layout = layout(target, side, d)
    if stored_layout is None or target_layout is None:
        return base.transform  # the shapes do not fit at all: fill_target names both and the likely cause
    return "transpose" if stored_layout != target_layout else "none"


def unroutable(label: str, family: Mapping, params: dict[str, tuple[int, ...]], assigned: dict[str, Role],
               canon: dict[Role, TensorRoute], tensors: dict[str, torch.Tensor], args: dict | None,
               layouts: dict[str, str | None] | None = None) -> tuple[str, str]:
    """Both sides with shapes and roles, and (returned beside them) a mapping file to edit whose comments propose,
    for each "?", the tensor that fits after the storage orientation (a Conv1D checkpoint stores [in, out]; an
    nn.Linear parameter is [out, in]), spelled as the line should read."""
    layouts = layouts or {}
    sources = {route.source: role for role, route in canon.items() if route.source in tensors}
    shapes = {name: tuple(tensors[name].shape) for name in sources}
    stored_layouts = {route.source: "in_out" if route.transform == "transpose" else "out_in"
                      for route in canon.values()}
    width = max(map(len, [*params, *sources]), default=0)
    lines = [f"target {label}, its parameters and the roles their names say:"]
    lines += [f"    {name:<{width}}  {list(shape)!s:<14}  {' '.join(assigned.get(name, ('?',)))}"
              for name, shape in params.items()]
    lines.append(f"checkpoint tensors of a layer (under {family.layer_key}) and their roles:")
    lines += [f"    {name:<{width}}  {list(shapes[name])!s:<14}  {' '.join(sources[name])}" for name in sources]
    tensors_table, comments = {}, {}
    for name, shape in params.items():
        role = assigned.get(name)
        base = canon.get(role) if role else None
        if base is not None and sum(r == role for r in assigned.values()) == 1:
            tensors_table[name] = route_spelling(dataclasses.replace(base, target=name))
            comments[name] = f"{list(shape)}: read as {role[0]} {role[1]}"
            continue
        tensors_table[name] = "?"
        fits = proposals(shape, shapes, stored_layouts, layouts.get(name))
        if len(fits) == 1:
            comments[name] = f"{list(shape)}: {fits[0]}"
        elif fits:
            comments[name] = f"{list(shape)}: UNCERTAIN, {len(fits)} tensors fit: " + "; or ".join(fits)
        elif name.rpartition(".")[2].lower().startswith(("b", "bias")) and len(shape) == 1:
            comments[name] = f"{list(shape)}: no checkpoint tensor has this shape; write {{ zeros = true }} if it is " \
                             "a bias this checkpoint does not have"
        else:
            comments[name] = f"{list(shape)}: no checkpoint tensor has this shape"
    lines += ["a mapping to edit: replace each \"?\" with the checkpoint tensor for that parameter (written "
              "{ from = \"...\", transform = \"transpose\" } where your weight is the stored one transposed), "
              "save it as FILE.toml and run `parity MODEL --mapping FILE.toml`:", ""]
    template = mapping_text(mapping_reference(family), label, args, tensors_table, comments)
    lines.append(template.rstrip("\n"))
    return "\n".join(lines), template
