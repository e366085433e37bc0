"""compressed-tensors' FP4 formats (what llm-compressor writes for its NVFP4 and MXFP4 schemes): config.json says
``quantization_config = {quant_method: "compressed-tensors", format: "nvfp4-pack-quantized" or "mxfp4-pack-quantized",
config_groups: {...: {weights: {num_bits: 4, type: float, strategy: tensor_group or group, group_size: 16 or 32}}},
ignore: [...]}``, and each quantized Linear X stores ``X.weight_packed`` (uint8 [out, in / 2]: two e2m1 codes a
byte), ``X.weight_scale`` (one per group: float8_e4m3fn for NVFP4, a uint8 e8m0 exponent for MXFP4) and, for NVFP4,
``X.weight_global_scale`` (float32 [1]: the weight is code x scale / global scale).  Modules in ``ignore`` are stored
as they are.

``read`` returns X.weight dequantized by compressed-tensors itself (its registered compressor for the format,
``decompress``), in float32; ``fp4_held`` gives the codes' levels (compressed-tensors' ``unpack_fp4_from_uint8``) and
each group's scale as that compressor applies it, for ``engine.compare.fp4_grid``.  compressed-tensors is the extra
``compressed-tensors``, imported only when a checkpoint needs it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from parity.definitions.distribution import install_command
from parity.definitions.files import shown
from parity.errors import CheckpointError
from parity.sources.checkpoint import Checkpoint, dequantized_on_read
from parity.sources.compressed_config import (
    FP4_FORMATS,
    MIXED,
    check_plain,
    group_format,
    module_scheme,
    parsed_config,
    targets_of,
    weight_schemes,
)
from parity.sources.fp4 import Fp4Held, norm_dtype

EXTRA = "compressed-tensors"  # pyproject.toml's extra that installs compressed-tensors
COMPRESSED = "compressed-tensors"
PACKED, SCALE, GLOBAL = "weight_packed", "weight_scale", "weight_global_scale"
PARTS = (PACKED, SCALE, GLOBAL, "weight_zero_point", "input_global_scale")  # the compressor's parameter names
# the dtype each format stores weight_scale in: compressed-tensors' compressors (NVFP4PackedCompressor's default
# scale_dtype float8_e4m3fn, MXFP4PackedCompressor's uint8 e8m0 exponents), as llm-compressor 0.14 writes them
SCALE_DTYPES = {"nvfp4-pack-quantized": "float8_e4m3fn", "mxfp4-pack-quantized": "uint8"}


def dtype_name(tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Fp4Scheme:
    """What config.json's quantization_config states: the format, the group size and the modules left unquantized;
    ``library``: compressed-tensors' QuantizationScheme, handed to its compressor."""

    form: str
    group: int
    not_converted: tuple[str, ...] = ()
    library: object = field(default=None, compare=False)
    targets: tuple[str, ...] = ()  # the config group's targets (``compressed_config.module_scheme``)
    # a mixed-precision config's other groups' targets (llm-compressor's nvfp4 recipe with down_proj in FP8): their
    # modules are read by ``fp8_blocks`` (``wrap``'s ``rest``)
    others: tuple[str, ...] = ()

    def describe(self) -> str:
        return f"compressed-tensors {self.form}, groups of {self.group}"


def require_library(where: str):
    """compressed-tensors' QuantizationConfig, its compressor registry and FP4 unpacker, or a CheckpointError (exit
    2) naming what to install."""
    try:
        from compressed_tensors.compressors.base import BaseCompressor
        from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
        from compressed_tensors.quantization import QuantizationConfig
    except ImportError:
        raise CheckpointError(
            f"{where}: its weights are FP4-quantized in compressed-tensors' format, which parity reads with "
            f"compressed-tensors, and that is not installed: {install_command(EXTRA, fallback='compressed-tensors')} "
            f"(ffn-parity's extra '{EXTRA}')") from None
    return QuantizationConfig, BaseCompressor, unpack_fp4_from_uint8


def scheme_of(raw_config: dict, where: str) -> Fp4Scheme | None:
    """The FP4 scheme config.json states, None for a checkpoint of another format; one parity cannot read is a
    CheckpointError naming it."""
    config = raw_config.get("quantization_config")
    if not isinstance(config, dict) or config.get("quant_method") != COMPRESSED \
            or config.get("format") not in (*FP4_FORMATS, MIXED):
        return None
    config_class, _, _ = require_library(where)
    parsed = parsed_config(config_class, config, where)
    groups = {key: g for key, g in weight_schemes(parsed).items() if group_format(parsed, g) in FP4_FORMATS}
    if not groups:
        return None
    if len(groups) > 1 or len({group_format(parsed, g) for g in groups.values()}) > 1:
        raise CheckpointError(f"{where}: config.json's quantization_config (compressed-tensors) holds "
                              f"{len(groups)} FP4 weight schemes across its config_groups; parity reads one so far")
    scheme = next(iter(groups.values()))
    targets = targets_of(parsed)
    mine = tuple(t for t, g in targets.items() if group_format(parsed, g) in FP4_FORMATS)
    args = scheme.weights
    kind = str(getattr(args.type, "value", args.type))
    if kind != "float" or args.num_bits != 4 or not args.symmetric or not args.group_size:
        raise CheckpointError(f"{where}: compressed-tensors format {group_format(parsed, scheme)!r} with "
                              f"{args.num_bits}-bit {kind} "
                              f"weights (symmetric {args.symmetric}, group_size {args.group_size}): parity reads "
                              "symmetric 4-bit float weights in groups")
    return Fp4Scheme(group_format(parsed, scheme), int(args.group_size), tuple(str(n) for n in parsed.ignore or []),
                     scheme, mine, tuple(t for t in targets if t not in mine))


class Fp4Checkpoint(Checkpoint):
    """An HF folder of compressed-tensors FP4 weights: X.weight read dequantized by compressed-tensors (float32);
    X.weight_packed, X.weight_scale and X.weight_global_scale kept apart from ``weight_map`` (X's storage)."""

    scheme: Fp4Scheme
    companions: dict[str, str]
    as_stored: dict[str, str]
    fp4_modules: dict[str, str]  # X.weight -> X, for each packed matrix
    others: Checkpoint | None  # a mixed-precision config's FP8 modules (and the plain tensors), read by fp8_blocks

    def quantized(self, name: str):
        """How an FP8 module of a mixed-precision B is stored (``fp8_blocks.FP8Checkpoint.quantized``)."""
        return self.others.quantized(name) if self.others is not None else None

    def parts_of(self, name: str) -> dict | None:
        """A packed ``name``'s stored parameters under the compressor's names, checked; None for another tensor."""
        module = self.fp4_modules.get(name)
        if module is None:
            return None
        stated = {**dict.fromkeys(self.scheme.others, "another"), **dict.fromkeys(self.scheme.targets, self.scheme)}
        if module_scheme(stated, self.scheme.not_converted, module, self.location) == "another":
            raise CheckpointError(f"{self.location}: {module} is stored {self.scheme.form}, but config.json's "
                                  "quantization_config gives it a group of another format")
        wanted = [f"{module}.{p}" for p in PARTS if f"{module}.{p}" in self.companions]
        read = {n.rsplit(".", 1)[1]: self.reader(self.companions[n], [n])[n] for n in wanted}
        for part in (SCALE,) + ((GLOBAL,) if self.scheme.form.startswith("nvfp4") else ()):
            if part not in read:
                raise CheckpointError(f"{self.location}: {module}.{PACKED} has no {module}.{part} beside it; "
                                      f"{self.scheme.form} stores it")
        import torch

        packed, scale = read[PACKED], read[SCALE]
        columns = packed.shape[-1] * 2 if packed.dim() else 0
        expected = [*packed.shape[:-1], columns // self.scheme.group]
        said = (f"{self.location}: {module}.{PACKED} is {dtype_name(packed)} {list(packed.shape)} with "
                f"{module}.{SCALE} {dtype_name(scale)} {list(scale.shape)}")
        if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.numel() == 0:
            raise CheckpointError(f"{said}; {self.scheme.form} packs two e2m1 codes a byte: uint8 [out, in / 2]")
        if columns % self.scheme.group or list(scale.shape) != expected:
            raise CheckpointError(f"{said}; one scale per group of {self.scheme.group} of its {columns} inputs calls "
                                  f"for {expected}")
        scale_dtype = SCALE_DTYPES[self.scheme.form]
        if dtype_name(scale) != scale_dtype:
            raise CheckpointError(f"{said}; {self.scheme.form} stores its scales as {scale_dtype}")
        if GLOBAL in read and read[GLOBAL].numel() != 1:
            raise CheckpointError(f"{self.location}: {module}.{GLOBAL} holds {read[GLOBAL].numel()} values; NVFP4 "
                                  "stores one global scale per tensor")
        return read

    def decompressed(self, name: str, parts: dict):
        """compressed-tensors' own decompress of one packed matrix: (weight, scale as it applies it), float32."""
        _, registry, _ = require_library(self.location)
        compressor = registry.load_from_registry(self.scheme.form)
        out = compressor.decompress(dict(parts), self.scheme.library)
        return out["weight"].float(), out[SCALE].float()

    def fp4_held(self, name: str, *, expert: int | None = None):
        """How ``name`` is stored when it is FP4 (``Fp4Held``, the file's [out, in]): each value's e2m1
        level, each group's scale as the compressor applies it (divided by the global scale); None otherwise."""
        parts = self.parts_of(name)
        if parts is None:
            return None
        import torch

        _, _, unpack = require_library(self.location)
        packed = parts[PACKED]
        levels = unpack(packed, packed.shape[0], packed.shape[1] * 2, dtype=torch.float32)
        _, scale = self.decompressed(name, parts)
        global_scale = parts[GLOBAL].float().reshape(-1)[0] if GLOBAL in parts else torch.tensor(1.0)
        return Fp4Held(levels, scale / global_scale, self.scheme.group, self.model_dtype,
                       f"{self.scheme.form.removesuffix('-pack-quantized')}/{self.scheme.group}",
                       power_of_two=self.scheme.form.startswith("mxfp4"), e4m3_unit=float(1 / global_scale))

    @cached_property
    def model_dtype(self) -> str:
        """The dtype llm-compressor left the unquantized tensors in (a norm's weight), else float32."""
        return norm_dtype(self)

    def describe(self, names: list[str]) -> dict[str, tuple[list[int], str]] | None:
        """Shape and dtype of these tensors from the local safetensors headers, a packed one as the matrix it holds
        ([out, in], the format); None for a hub checkpoint."""
        if self.repo_id is not None or self.weights != "real":
            return None
        from parity.sources.safetensors_files import describe_files

        wanted = {n: self.weight_map[n] for n in names if n not in self.fp4_modules}
        wanted |= {f"{self.fp4_modules[n]}.{PACKED}": self.weight_map[n] for n in names if n in self.fp4_modules}
        found = describe_files(self.fetch, wanted)
        if found is None:
            return None
        for name in names:
            if name in self.fp4_modules:
                shape = found.pop(f"{self.fp4_modules[name]}.{PACKED}")[0]
                found[name] = ([*shape[:-1], shape[-1] * 2], self.scheme.form.split("-")[0].upper())
        return {name: found[name] for name in names}

    def stored_dtype(self, name: str) -> str | None:
        if self.others is not None and name not in self.fp4_modules:
            return self.others.stored_dtype(name)
        return self.as_stored.get(name)

    def read(self, names: list[str]):
        plain = [n for n in names if n not in self.fp4_modules]
        if self.others is not None:  # FP8 modules and plain tensors, as fp8_blocks reads them
            out = self.others.read(plain) if plain else {}
        else:
            out = super().read(plain) if plain else {}
            for name in plain:  # a linear its config quantizes, stored plain: the layer's finding
                check_plain(self.scheme.targets, self.scheme.not_converted, name, out[name], self.location)
        self.as_stored = {name: str(out[name].dtype).removeprefix("torch.") for name in plain}
        for name in names:
            parts = self.parts_of(name)
            if parts is not None:
                out[name] = self.decompressed(name, parts)[0]
                self.as_stored[name] = self.scheme.form.split("-")[0]
        return out


def wrap(checkpoint: Checkpoint, folder: Path | str, *, rest: Callable[[Checkpoint, Path | str], Checkpoint]
         ) -> Checkpoint | None:
    """``checkpoint`` as an Fp4Checkpoint when its config states compressed-tensors' FP4, else None; ``rest``: the
    reader of a mixed-precision config's other groups (``fp8_blocks.wrap``, handed in by ``quantized``, which
    knows every reader), given the checkpoint without the packed modules."""
    scheme = scheme_of(checkpoint.raw_config, shown(folder))
    if scheme is None:
        return None
    parts = {n: f for n, f in checkpoint.weight_map.items() if n.rsplit(".", 1)[-1] in PARTS}
    modules = {n.rsplit(".", 1)[0] + ".weight": n.rsplit(".", 1)[0] for n in parts if n.endswith("." + PACKED)}
    if not modules:
        raise CheckpointError(f"{shown(folder)}: config.json's quantization_config states format {scheme.form!r}, "
                              f"yet no tensor is stored as X.{PACKED}: the weights are not in that format (re-export "
                              "them, or state the format they are in)")
    parts = {n: f for n, f in parts.items() if n.rsplit(".", 1)[0] in modules.values()}  # the packed modules' own
    weights = {n: f for n, f in checkpoint.weight_map.items() if n not in parts}
    others = None
    if scheme.others:  # the other groups' modules: a checkpoint of the rest, read by fp8_blocks
        others = rest(dataclasses.replace(checkpoint, weight_map=weights), folder)
    weights.update({name: parts[prefix + "." + PACKED] for name, prefix in modules.items()})
    wrapped = dequantized_on_read(checkpoint, Fp4Checkpoint, scheme, weights, parts, matrices=len(modules),
                                  dequantized_with=f"compressed-tensors ({scheme.form} decompress)")
    wrapped.fp4_modules, wrapped.others = modules, others
    if others is not None:
        wrapped.notes.append(others.notes[-1])
    return wrapped
