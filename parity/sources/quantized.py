"""The one place a checkpoint's quantized weights find their reader, for a local folder and a hub repository alike:
each format's ``wrap`` takes the checkpoint when its config states that format, and a quantization_config whose
quant_method none of them reads is refused, since its stored tensors read as plain weights are not the weights the
model loads (an FP8 ``weight`` beside its ``weight_scale`` under fbgemm_fp8, say)."""

from __future__ import annotations

import difflib
from pathlib import Path

from parity.definitions.files import shown
from parity.errors import CheckpointError
from parity.sources import bnb_4bit, fp4_packed, fp8_blocks, int_groups, mlx_quantized, mxfp4_experts
from parity.sources.checkpoint import Checkpoint

# the quant_method values some reader here takes (MLX states none: mlx_quantized reads config.json's "quantization")
READ_METHODS = (*fp8_blocks.TRANSFORMERS_METHODS, fp8_blocks.FBGEMM, fp8_blocks.COMPRESSED, *int_groups.READERS,
                mxfp4_experts.QUANT_METHOD, bnb_4bit.QUANT_METHOD)


def dequantizing(checkpoint: Checkpoint, where: Path | str) -> Checkpoint:
    """``checkpoint`` read through the reader of the quantization its config states (unchanged where it states
    none): bitsandbytes, MLX and GPT-OSS's MXFP4 first, then integer groups (GPTQ, AWQ, compressed-tensors' integer
    formats), compressed-tensors' FP4, else FP8."""
    plain = checkpoint
    checkpoint = bnb_4bit.wrap(checkpoint, where)
    checkpoint = mlx_quantized.wrap(checkpoint, where)
    checkpoint = mxfp4_experts.wrap(checkpoint, where)
    checkpoint = (int_groups.wrap(checkpoint, where, rest=fp8_blocks.wrap)
                  or fp4_packed.wrap(checkpoint, where, rest=fp8_blocks.wrap)
                  or fp8_blocks.wrap(checkpoint, where))
    if checkpoint is plain:
        refuse_unread_method(plain.raw_config, shown(where))
    return checkpoint


def refuse_unread_method(raw_config: dict, where: str) -> None:
    """A CheckpointError where config.json states a quant_method no reader here took, naming it and whether
    transformers knows it (its own quantizer registry says)."""
    config = raw_config.get("quantization_config")
    method = config.get("quant_method") if isinstance(config, dict) else None
    if method is None:
        return
    from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING

    if isinstance(method, str) and method in AUTO_QUANTIZER_MAPPING:
        known = f", which transformers loads with its {AUTO_QUANTIZER_MAPPING[method].__name__}"
    else:
        close = difflib.get_close_matches(str(method), [*AUTO_QUANTIZER_MAPPING, *READ_METHODS], n=1)
        known = ", which transformers' quantizers do not know either" + (f" (did you mean {close[0]!r}?)"
                                                                          if close else "")
    raise CheckpointError(f"{where}: config.json's quantization_config.quant_method is {method!r}{known}; parity "
                          f"reads {', '.join(READ_METHODS)} and MLX's quantization: its tensors read as plain weights "
                          "would judge other weights than the model loads, so parity cannot judge this checkpoint yet")
