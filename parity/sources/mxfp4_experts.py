"""MXFP4 expert weights as GPT-OSS's release stores them in safetensors: config.json says
``quantization_config = {quant_method: "mxfp4", modules_to_not_convert: [...]}``, and each quantized expert tensor X
(``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``) is stored as ``X_blocks`` (uint8 [E, out, in / 32, 16]: two
FP4 e2m1 codes a byte, the value of even index in the low nibble) and ``X_scales`` (uint8 [E, out, in / 32]: one e8m0
exponent per 32 input values, bias 127).  The true weight is 2^(scale - 127) x the code's value; transformers'
parameter holds it as [E, in, out] (its experts compute x @ W).

``read`` returns X dequantized by transformers itself (``transformers.integrations.mxfp4.convert_moe_packed_tensors``,
the converter its Mxfp4 quantizer runs on CPU when it dequantizes), in float32, under X's own name and layout
([E, in, out]), so that the derived routes of GPT-OSS's experts read it as they read an unquantized release (they
slice each expert and turn it to [out, in]).  The stored codes and exponents
are kept for the grid (``fp4_held``, judged by ``engine.compare.fp4_grid``); the blocks and scales must have the
shapes the format calls for (a CheckpointError naming both otherwise).  No extra is needed: the converter is
transformers'.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from parity.definitions.files import shown
from parity.errors import CheckpointError
from parity.sources.checkpoint import Checkpoint, check_converted, dequantized_on_read, split_companions
from parity.sources.config_check import stated_modules
from parity.sources.fp4 import Fp4Held, e2m1_values, norm_dtype

QUANT_METHOD = "mxfp4"  # transformers' Mxfp4Config.quant_method
BLOCKS, SCALES = "_blocks", "_scales"
BLOCK = 32  # values per e8m0 scale (OCP MX): each block's 16 bytes hold 32 codes


@dataclass(frozen=True)
class Mxfp4Scheme:
    """What config.json's quantization_config states: the modules left unquantized."""

    not_converted: tuple[str, ...] = ()

    def describe(self) -> str:
        return "MXFP4 experts (GPT-OSS's blocks and e8m0 scales, groups of 32)"


def scheme_of(raw_config: dict, where: str) -> Mxfp4Scheme | None:
    """The scheme config.json states, None for a checkpoint not MXFP4-quantized this way."""
    config = raw_config.get("quantization_config")
    if not isinstance(config, dict) or config.get("quant_method") != QUANT_METHOD:
        return None
    return Mxfp4Scheme(stated_modules(config, "modules_to_not_convert", where))


def check_layout(location: str, name: str, blocks, scales) -> None:
    """Blocks [E, out, G, 16] uint8 beside scales [E, out, G] uint8, else a CheckpointError saying what they are."""
    import torch

    said = (f"{location}: {name}{BLOCKS} is {str(blocks.dtype).removeprefix('torch.')} {list(blocks.shape)} with "
            f"{name}{SCALES} {str(scales.dtype).removeprefix('torch.')} {list(scales.shape)}")
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise CheckpointError(f"{said}; MXFP4 stores both as uint8 (two e2m1 codes a byte, one e8m0 exponent a block)")
    if blocks.dim() != 4 or blocks.shape[-1] != BLOCK // 2 or blocks.numel() == 0:
        raise CheckpointError(f"{said}: GPT-OSS's MXFP4 experts are [experts, out, in / 32, 16] (32 codes in 16 "
                              "bytes, stacked over experts)")
    if tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise CheckpointError(f"{said}: one scale per block calls for {name}{SCALES} {list(blocks.shape[:-1])}")


class Mxfp4Checkpoint(Checkpoint):
    """An HF folder whose experts are MXFP4 blocks and scales: X read under its own name, dequantized by transformers
    (float32); X_blocks and X_scales kept apart from ``weight_map`` (X's storage)."""

    scheme: Mxfp4Scheme
    companions: dict[str, str]
    as_stored: dict[str, str]
    mxfp4_names: set[str]  # the tensors stored as blocks and scales

    def stored_parts(self, name: str):
        """(blocks, scales) of a quantized ``name`` as read and checked, else None."""
        if name not in self.mxfp4_names:
            return None
        check_converted(name.rsplit(".", 1)[0], self.scheme.not_converted, self.location)
        parts = [name + BLOCKS, name + SCALES]
        read = {n: self.reader(self.companions[n], [n])[n] for n in parts}
        check_layout(self.location, name, read[parts[0]], read[parts[1]])
        return read[parts[0]], read[parts[1]]

    def fp4_held(self, name: str, *, expert: int | None = None):
        """How ``name`` is stored when it is MXFP4 (``expert``: that expert's slice alone), in the file's layout
        (``Fp4Held``): each value's e2m1 level and each block's scale, 2^(exponent - 127); None for a tensor
        stored unquantized."""
        import torch

        found = self.stored_parts(name)
        if found is None:
            return None
        blocks, scales = found
        if expert is not None and blocks.dim() == 4:
            blocks, scales = blocks[expert], scales[expert]
        codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(*blocks.shape[:-2], -1).long()
        exponents = scales.to(torch.int32) - 127
        return Fp4Held(e2m1_values()[codes], torch.ldexp(torch.ones(exponents.shape), exponents), BLOCK,
                       self.model_dtype, "mxfp4 (GPT-OSS blocks)")

    @cached_property
    def model_dtype(self) -> str:
        """The dtype of the tensors left unquantized (a norm's weight; float32 where the header cannot say): what the
        experts were most likely quantized from."""
        return norm_dtype(self)

    def stored_dtype(self, name: str) -> str | None:
        """The dtype tensor ``name`` had in its file when last read (a quantized one: ``mxfp4``)."""
        return self.as_stored.get(name)

    def read(self, names: list[str]):
        import torch
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors

        plain = [n for n in names if n not in self.mxfp4_names]
        out = super().read(plain) if plain else {}
        self.as_stored = {name: str(out[name].dtype).removeprefix("torch.") for name in plain}
        for name in names:
            found = self.stored_parts(name)
            if found is not None:
                out[name] = convert_moe_packed_tensors(*found, dtype=torch.float32)
                self.as_stored[name] = "mxfp4"
        return out


def wrap(checkpoint: Checkpoint, folder: Path | str) -> Checkpoint:
    """``checkpoint`` as an Mxfp4Checkpoint when its config states GPT-OSS's MXFP4, else unchanged."""
    scheme = scheme_of(checkpoint.raw_config, shown(folder))
    if scheme is None:
        return checkpoint
    weights, companions = split_companions(checkpoint, (BLOCKS, SCALES))
    quantized = {n.removesuffix(BLOCKS) for n in companions if n.endswith(BLOCKS)}
    for name in sorted(quantized):
        if name + SCALES not in companions:
            raise CheckpointError(f"{shown(folder)}: {name}{BLOCKS} has no {name}{SCALES} beside it; MXFP4 stores "
                                  "one e8m0 exponent per block of 32 values")
        weights[name] = companions[name + BLOCKS]
    wrapped = dequantized_on_read(checkpoint, Mxfp4Checkpoint, scheme, weights, companions, matrices=len(quantized),
                                  dequantized_with="transformers' convert_moe_packed_tensors")
    wrapped.mxfp4_names = quantized
    return wrapped
