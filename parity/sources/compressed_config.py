"""compressed-tensors' quantization_config as its own ``QuantizationConfig`` reads it, for each reader of its formats
(``fp8_blocks``: float-quantized; ``int_groups``: pack-quantized; ``fp4_packed``: nvfp4/mxfp4-pack-quantized): one
validation and one rule (a single weight scheme across the config groups), each reader then judging the scheme's
arguments against its own format."""

from __future__ import annotations

from parity.errors import CheckpointError


def one_weight_scheme(config_class, config: dict, where: str):
    """(the parsed config, its one QuantizationScheme with weights) of ``config``, validated by ``config_class``
    (compressed-tensors' QuantizationConfig); a config it refuses, or several weight schemes, is a CheckpointError
    in compressed-tensors' words."""
    try:
        parsed = config_class.model_validate(config)
    except Exception as exc:  # pydantic's ValidationError: the field and what was wrong
        raise CheckpointError(f"{where}: config.json's quantization_config is not one compressed-tensors reads: "
                              f"{'; '.join(str(exc).splitlines()[:3])}") from None
    schemes = {g.weights.model_dump_json(): g for g in parsed.config_groups.values() if g.weights is not None}
    if len(schemes) != 1:
        raise CheckpointError(f"{where}: config.json's quantization_config (compressed-tensors) has {len(schemes)} "
                              "weight schemes across its config_groups; parity reads checkpoints with one so far")
    return parsed, next(iter(schemes.values()))
