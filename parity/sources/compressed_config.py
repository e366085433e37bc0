"""compressed-tensors' quantization_config as its own ``QuantizationConfig`` reads it, for each reader of its formats
(``fp8_blocks``: float-quantized; ``int_groups``: pack-quantized; ``fp4_packed``: nvfp4/mxfp4-pack-quantized): one
validation, its groups' schemes and the one it gives each module (compressed-tensors' own ``match_targets``),
each reader then judging its groups' arguments against its own format."""

from __future__ import annotations

from parity.definitions.patterns import regex_value
from parity.errors import CheckpointError, QuantizedLayoutError, UnstatedModuleError

MIXED = "mixed-precision"  # compressed-tensors' format of a config whose groups each state their own
FP4_FORMATS = ("nvfp4-pack-quantized", "mxfp4-pack-quantized")  # read by fp4_packed


def group_format(parsed, group) -> str:
    """The format a config group is stored in: its own where the config is mixed-precision, else the config's."""
    return str((getattr(group, "format", None) or parsed.format) if parsed.format == MIXED else parsed.format)


def parsed_config(config_class, config: dict, where: str):
    """``config`` validated by ``config_class`` (compressed-tensors' QuantizationConfig); one it refuses is a
    CheckpointError in compressed-tensors' words."""
    try:
        parsed = config_class.model_validate(config)
    except Exception as exc:  # pydantic's ValidationError: the field and what was wrong
        raise CheckpointError(f"{where}: config.json's quantization_config is not one compressed-tensors reads: "
                              f"{'; '.join(str(exc).splitlines()[:3])}") from None
    named = [(f"config_groups.{key}.targets", t) for key, g in parsed.config_groups.items() for t in g.targets]
    for field, entry in [*named, *(("ignore", i) for i in parsed.ignore or [])]:
        if entry.startswith("re:"):  # compressed-tensors' match_targets: re.match of what follows "re:"
            try:
                regex_value(entry.removeprefix("re:"))
            except ValueError as exc:
                raise CheckpointError(f"{where}: config.json's quantization_config.{field} {exc}") from None
    return parsed


def weight_schemes(parsed) -> dict[str, object]:
    """Each distinct weight scheme of a parsed config, keyed by its weights' JSON (groups stating one scheme count
    once), in the config's order."""
    return {g.weights.model_dump_json(): g for g in parsed.config_groups.values() if g.weights is not None}


def targets_of(parsed) -> dict[str, object]:
    """Each target of the config's groups -> its group's QuantizationScheme, in the config's order (as compressed-
    tensors' ``apply_quantization_config`` builds it: a later group stating a target again takes it)."""
    return {target: group for group in parsed.config_groups.values() if group.weights is not None
            for target in group.targets}


def linear_matches(module: str, patterns) -> list[str]:
    """The patterns (targets, or ignore entries) compressed-tensors' own ``match_targets`` finds for the linear
    module named ``module``, best first (exact name, then regex, then class name: every module here is a Linear)."""
    import torch
    from compressed_tensors.utils.match import match_targets

    with torch.device("meta"):
        linear = torch.nn.Linear(1, 1)
    return match_targets(module, linear, list(patterns or ()))


def check_plain(targets, ignore, name: str, value, where: str) -> None:
    """A QuantizedLayoutError (quantized_module_stored_plain) where B stores a linear weight ``name`` unquantized
    that its config quantizes (a group targets it, ``ignore`` does not name it): compressed-tensors would look for
    its codes and scales and find none.  Only a 2-D ``X.weight`` is a linear's (a norm's weight is 1-D)."""
    if value.dim() != 2 or not name.endswith(".weight"):
        return
    module = name.removesuffix(".weight")
    matched = linear_matches(module, targets)
    if matched and not linear_matches(module, ignore):
        raise QuantizedLayoutError(f"{where}: {module} is stored unquantized "
                                   f"({str(value.dtype).removeprefix('torch.')}), but config.json's "
                                   f"quantization_config quantizes it (target {matched[0]!r}, not in ignore): "
                                   "compressed-tensors would look for its codes and scales and find none",
                                   "quantized_module_stored_plain", kind="config: quantized")


def module_scheme(targets: dict[str, object], ignore, module: str, where: str):
    """The scheme compressed-tensors gives the linear module named ``module``, which B stores quantized: its own
    ``match_targets`` ranks the targets that match it (exact name, then regex, then class name: every module here
    is a Linear, the only class these formats quantize) and the first is taken, as ``apply_quantization_config``
    does.  A module no group targets, or one ``ignore`` names, is a QuantizedLayoutError naming it (reported on
    the layer that holds it): compressed-tensors would not quantize it, so a model loading B would take its codes
    for its weight."""
    ignored = linear_matches(module, ignore)
    matched = linear_matches(module, targets)
    if ignored or not matched:
        why = (f"quantization_config.ignore names it ({ignored[0]!r})" if ignored
               else f"no group of quantization_config.config_groups targets it (targets: {', '.join(targets)})")
        raise UnstatedModuleError(where, module, why, "compressed-tensors would not quantize it, so a model "
                                  "loading B would take its codes for its weight")
    return targets[matched[0]]
