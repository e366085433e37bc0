"""`parity inspect`: what a check would compare, without computing anything.

It resolves the model like a check does, then reports the config values that decide the
FFN (d, d_ff against the family's rule, the activation named and the one transformers
runs, biases) and one layer's tensors as the safetensors headers describe them.  No
tensor is loaded and no forward pass runs; the reference model exists on the meta device.
"""

from __future__ import annotations

import json
from typing import Any

from parity.definitions.families import dff_rule
from parity.definitions.mapping import route_arrows
from parity.engine.layout.resolve import activation_override_notes
from parity.engine.results import SCHEMA_VERSION


def tensor_info(checkpoint, session, layer: int, names: list[str]) -> list[dict[str, Any]]:
    """Shape, dtype and file of each tensor, from headers only, validated as a check would validate them.

    A file already on disk (local folder, hub cache, written synthetic shard) is described by its
    header, checked as a read would check it (a regular file, a sound header, each tensor where the
    index says); a file of a local checkpoint that is missing is an error, as in a check.  A hub file
    not yet downloaded is described by its remote header; a synthetic shard not yet written, by the
    shapes it will be written with.
    """
    rows = []
    by_file: dict[str, list[str]] = {}
    for name in names:
        by_file.setdefault(checkpoint.weight_map[name], []).append(name)
    for file_name, members in by_file.items():
        rows.extend(_file_rows(checkpoint, session, layer, file_name, members))
    order = {name: i for i, name in enumerate(names)}
    return sorted(rows, key=lambda row: order[row["name"]])


def _file_rows(checkpoint, session, layer: int, file_name: str, members: list[str]) -> list[dict[str, Any]]:
    from parity.sources.safetensors_files import describe_local

    described = checkpoint.describe(members)
    if described is not None:
        return [_row(name, *described[name], file_name, "index") for name in members]
    local = checkpoint.config_dir / file_name if checkpoint.config_dir is not None else None
    on_disk = local is not None and (local.exists() or local.is_symlink())
    if checkpoint.weights == "synthetic" and not on_disk:
        shapes = session.reference.tensor_shapes(session.mapping.reference_path(layer))
        dtype = str(checkpoint.raw_config.get("torch_dtype", "float32"))
        prefix = session.reader.layer_prefix(layer)
        return [_row(name, shapes.get(name[len(prefix):]), dtype, file_name, "synthetic, not written yet")
                for name in members]
    if checkpoint.repo_id is not None and not on_disk:
        return _remote_rows(checkpoint, file_name, members)
    path = local if on_disk else checkpoint.fetch(file_name)  # a local checkpoint's missing file raises here
    if path.suffix != ".safetensors":  # pickle-based: described by what torch.load (weights only) maps
        tensors = checkpoint.read(members)
        return [_row(n, list(tensors[n].shape), str(tensors[n].dtype).removeprefix("torch."), file_name, "loaded")
                for n in members]
    described = describe_local(path, members)
    return [_row(name, *described[name], file_name, "header") for name in members]


def _remote_rows(checkpoint, file_name: str, members: list[str]) -> list[dict[str, Any]]:
    from parity.sources.hub import hub_reachable

    repo_id, _, revision = checkpoint.location.partition("@")
    if hub_reachable():
        from huggingface_hub import get_safetensors_metadata

        try:
            meta = get_safetensors_metadata(repo_id, revision=revision or None).files_metadata[file_name]
            return [_row(n, meta.tensors[n].shape, meta.tensors[n].dtype, file_name, "remote header") for n in members]
        except Exception:  # any hub failure: say so below rather than abort an inspection
            pass
    return [_row(n, None, None, file_name, "not downloaded") for n in members]


def _row(name: str, shape, dtype, file_name: str, source: str) -> dict[str, Any]:
    return {"name": name, "shape": list(shape) if shape is not None else None, "dtype": dtype, "file": file_name,
            "source": source}


def inspect_model(model: str, checkpoint: str | None = None, mapping: str | None = None, revision: str | None = None,
                  target: str | None = None, layer: int = 0, allow_pickle: bool = False) -> dict[str, Any]:
    """What a check of ``layer`` would compare.  ``allow_pickle``: as for a check, pickle-based weights
    (pytorch_model*.bin, consolidated.*.pth) are opened, with torch.load(weights_only=True), only when asked."""
    from parity.definitions.families import ACTIVATION_ATTRS, config_dff, configured_activation
    from parity.definitions.mapping import ConfigValue
    from parity.definitions.selection import parse_selection
    from parity.engine.check.arguments import unit_width
    from parity.engine.check.session import Session
    from parity.engine.layout.resolve import resolve
    from parity.engine.reference import activation_module, activation_name

    session = Session(resolve(model, checkpoint, mapping, revision, allow_pickle=allow_pickle), target=target)
    (layer,) = parse_selection(int(layer), session.num_layers)
    session = next(unit for unit in (session, *session.parts) if unit.mapping.serves(layer))  # its first unit
    config, ckpt, fam = session.config, session.checkpoint, session.mapping
    probe = session.reference.meta_module(fam.reference_path(layer))
    d = session.hidden_size
    d_ff = unit_width(fam) or config_dff(config)  # an expert's own, in a derived MoE layout
    shapes = session.reference.tensor_shapes(fam.reference_path(layer))
    if d_ff is None:  # GPT configs leave n_inner empty: the model uses 4d; read it off the built MLP
        d_ff = next((max(s) for n, s in shapes.items() if n.endswith("weight") and len(s) == 2), None)
    named = {attr: ckpt.raw_config[attr] for attr in ACTIVATION_ATTRS if isinstance(ckpt.raw_config.get(attr), str)}
    act = activation_module(probe)
    prefix = session.reader.layer_prefix(layer)
    routes = [*session.reader.reference_routes(layer), *fam.tensors]
    names = list(dict.fromkeys(prefix + r.source for r in routes
                               if r.reads and (not r.optional or ckpt.has(prefix + r.source))))
    tensors = tensor_info(ckpt, session, layer, names)
    built = target_routes(session, prefix, tensors)
    args = ConfigValue(config, fam.path)
    target_args = {k: _plain(args(v, f"target.args.{k}")) for k, v in (built["args"] or {}).items()}
    return {
        "model": session.resolved.model,
        "checkpoint": ckpt.location,
        "weights": ckpt.weights,
        "weights_note": ckpt.weights_note,
        "family": fam.name,
        "mapping_file": str(fam.path),
        "model_type": ckpt.raw_config.get("model_type"),
        "num_layers": session.num_layers,
        "layer": layer,
        "hidden_size": d,
        "intermediate_size": d_ff,
        "intermediate_rule": dff_rule(ckpt.raw_config.get("model_type"), d, d_ff),
        "activation": {
            "config": named,
            "transformers_runs": activation_name(probe, configured_activation(config)),
            "module": (f"{type(probe).__name__}.{_child_name(probe, act)}: {type(act).__name__}"
                       if act is not None else None),
            "overrides": activation_override_notes(ckpt.raw_config, config),
        },
        "biases": sorted(n for n in shapes if n.endswith("bias")),
        "target": session.target_name(),
        "target_args": target_args,
        **{f"target_{key}": value for key, value in built.items() if key != "args"},
        "reference": f"{type(probe).__module__}.{type(probe).__name__}",
        "notes": list(session.resolved.notes),
        "tensors": tensors,
    }


def target_routes(session, prefix: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The target built as a check builds it and the routes a check would fill it through: read off its parameter
    names for a --target with a built-in mapping (engine.check.routes), else the mapping's.  Only the constructor runs,
    on the meta device (no memory for weights; on the CPU if it cannot run there); the routes are chosen and
    checked (fill_target) against stand-ins with the shapes the headers give: no tensor is read, nothing runs
    forward.  Returns args (as a mapping spells them), routes (the report's ``routes``), notes, and error (a check
    would stop: exit 2), error_details (the parameters, tensors and a mapping to edit) or problem (a check would
    fail the layer, or routes that cannot be shown)."""
    import torch

    from parity.engine.check.fill import fill_target
    from parity.errors import MappingError, ParityError, ShapeMismatchError, TargetError

    built: dict[str, Any] = {"args": None, "routes": None, "notes": [], "error": None, "error_details": None,
                             "problem": None}
    try:
        module, built["args"], built_notes = _build_on_meta(session)
    except (TargetError, MappingError) as exc:  # MappingError: a derived layout's default target no module expresses
        built["error"] = f"cannot be built: {exc}"
        return built
    if session.num_experts is not None:
        built["problem"] = "mixture-of-experts: a check chooses the routes of each expert; not shown here"
        return built
    shapes = {row["name"][len(prefix):]: row["shape"] for row in rows if row["name"].startswith(prefix)}
    unknown = sorted(name for name, shape in shapes.items() if shape is None)
    if unknown:
        built["problem"] = f"routes not shown: the shapes of {', '.join(unknown)} are unknown until downloaded"
        return built
    stand_ins = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}
    try:
        used = session.routes.choose(module, stand_ins, session.hidden_size, built["args"])
        built["routes"] = session.routes.describe()
        notes = [*session.routes.notes, *fill_target(module, used, stand_ins, session.config)]
    except ShapeMismatchError as exc:
        built["problem"] = f"a check would fail this layer: {exc}"
        notes = list(session.routes.notes)
    except ParityError as exc:  # routes that cannot be read off the names, a route to no parameter, ...
        built["error"] = f"cannot be filled: {getattr(exc, 'headline', None) or exc}"
        built["error_details"] = getattr(exc, "details", None)
        return built
    built["notes"] = list(dict.fromkeys([*built_notes, *notes]))
    return built


def _build_on_meta(session):
    """``build_target`` as a check calls it (random init skipped, the user's exceptions a TargetError), on the meta
    device; a constructor that cannot run there is built on the CPU and moved to it."""
    import torch

    from parity.engine.check.build import build_target
    from parity.engine.check.run import skip_init, user_code
    from parity.errors import TargetError

    with skip_init(), user_code(f"target {session.target_name()} could not be built"):
        try:
            with torch.device("meta"):
                module, _, args, notes = build_target(session.mapping, session.config, session.target_spec)
        except TargetError:
            module, _, args, notes = build_target(session.mapping, session.config, session.target_spec)
            module.to("meta")
    return module, args, notes


def _child_name(module, child) -> str:
    """The path of ``child`` in ``module`` (an inline FFN's activation may sit a level down:
    intermediate.intermediate_act_fn)."""
    return next((name for name, c in module.named_modules() if c is child and name), "?")


def _plain(value: Any) -> Any:
    return value if isinstance(value, (int, float, str, bool, type(None))) else type(value).__name__


def render_inspection(info: dict[str, Any]) -> str:
    rule = info["intermediate_rule"]
    if rule["rule"] is None:
        follows = f"d_ff/d = {rule['ratio']}; no fixed rule for this family (read from the config)"
    elif rule["follows"]:
        follows = f"follows {rule['rule']} = {rule['expected']}"
    else:
        follows = f"does NOT follow {rule['rule']} = {rule['expected']} (d_ff/d = {rule['ratio']}); the config decides"
    act = info["activation"]
    said = ", ".join(f"{k}={v!r}" for k, v in act["config"].items()) or "none named"
    lines = [
        f"parity inspect: {info['model']} — family '{info['family']}'"
        + (f" ({info['mapping_file']})" if info["mapping_file"] != info["family"] else ""),
        f"  checkpoint   {info['checkpoint']} ({info['weights']} weights)",
    ]
    if info["weights_note"]:
        lines.append(f"  !! {info['weights_note']}")
    lines += [
        f"  model_type   {info['model_type']}; {info['num_layers']} layers",
        f"  d            {info['hidden_size']}",
        f"  d_ff         {info['intermediate_size']}: {follows}",
        f"  activation   config.json: {said}; transformers runs {act['transformers_runs']} ({act['module']})",
        f"  biases       {', '.join(info['biases']) if info['biases'] else 'none'}",
        *target_lines(info),
        f"  reference    {info['reference']}",
    ]
    lines.extend(f"  note: {note}" for note in [*info["notes"], *info["target_notes"]])
    lines += ["", f"layer {info['layer']} FFN tensors (from safetensors headers; nothing loaded):"]
    rows = [(t["name"], "?" if t["shape"] is None else str(t["shape"]), t["dtype"] or "?", t["file"],
             "" if t["source"] == "header" else f"({t['source']})") for t in info["tensors"]]
    widths = [max(len(r[i]) for r in rows) for i in range(4)] if rows else [0] * 4
    for row in rows:
        lines.append("  " + "  ".join(f"{row[i]:<{widths[i]}}" for i in range(4)) + (f"  {row[4]}" if row[4] else ""))
    return "\n".join(line.rstrip() for line in lines)


def target_lines(info: dict[str, Any]) -> list[str]:
    """The target, how a check would build it, and the routes it would fill it through ('.T': transposed)."""
    if info["target_error"] is not None and info["target_routes"] is None and not info["target_args"]:
        lines = [f"  target       {info['target']}", f"  !! target {info['target']} {info['target_error']}"]
    else:
        lines = [f"  target       {info['target']}({', '.join(f'{k}={v!r}' for k, v in info['target_args'].items())})"]
        if info["target_error"] is not None:
            lines.append(f"  !! target {info['target']} {info['target_error']}")
    if info["target_error_details"]:
        lines += ["     " + line for line in info["target_error_details"].splitlines()]
    routes = info["target_routes"]
    if routes is not None:
        origin = "inferred from parameter names" if routes["inferred"] else f"mapping {info['family']}"
        lines.append(f"  routes       {route_arrows(routes['tensors'])} ({origin})")
    if info["target_problem"] is not None:
        lines.append(f"  !! {info['target_problem']}")
    return lines


def inspection_json(info: dict[str, Any]) -> str:
    """`parity inspect --json`: the inspection, versioned like every report parity writes."""
    return json.dumps({"schema_version": SCHEMA_VERSION, "kind": "inspection", **info}, indent=2, default=str)

