"""FP8 block-quantized safetensors (DeepSeek V3's and Qwen3's FP8 releases): an HF folder whose config.json says
``quantization_config = {quant_method: "fp8", fmt: "e4m3", weight_block_size: [128, 128], ...}`` and whose quantized
matrices are stored as ``X.weight`` (float8_e4m3fn) beside ``X.weight_scale_inv`` (float32, one per block:
[ceil(out / 128), ceil(in / 128)]); the true weight is each code times its block's ``weight_scale_inv``.  Tensors the
release leaves unquantized (``modules_to_not_convert``) have no scale and are read as stored.  The config is read by
transformers' own ``FineGrainedFP8Config`` (quant_method "fp8" and "mxfp8": its defaults and aliases) and each
module's stored parts are found through its FP8 quantizer's own renamings (DeepSeek V4's ``X.scale``, Mistral Large
4's ``X.qscale_weight``); a null ``weight_block_size`` is one scale per tensor, uint8 scales are e8m0 exponents.
``fbgemm_fp8`` (Meta's FP8 releases) stores one float32 ``X.weight_scale`` per output row (``FBGEMM``).

``read`` returns the dequantized float32 weight, dequantized by compressed-tensors (``dequantize`` with a block
strategy of the config's ``weight_block_size``: the extra ``quant``), imported only when a checkpoint needs it.  Why
not transformers' own FP8 dequantizer (``Fp8Dequantize``, what ``FineGrainedFP8Config(dequantize=True)`` runs on
CPU): it infers the block from the scale grid (rows / grid rows) instead of reading ``weight_block_size``, so a matrix
whose sides are not multiples of the block is read with other blocks: on tests/test_quantized_fp8.py's tiny LLaMA
(gate_proj [200, 160], blocks 128x128, grid [2, 2], read as 100x80 blocks) its values lie 2.4 to 4.9 steps from the
unquantized weight's (up to 0.071, on each of the six FFN matrices), where compressed-tensors' lie within half a step
(0.0077 at most), as rounding to the nearest code does.  Where the two disagree, the one that follows the stated
block size is trusted.

The scale grid must be the one the stated block calls for: a grid of another shape is a conversion mistake
(``QuantizedLayoutError``: the scales transposed, or written for another block size), which a compare reports on
the layer that holds it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from parity.definitions.distribution import install_command
from parity.definitions.files import shown
from parity.errors import CheckpointError, QuantizedLayoutError
from parity.sources.checkpoint import Checkpoint, check_converted, dequantized_on_read, split_companions
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
from parity.sources.config_check import stated_modules

QUANT_METHOD = "fp8"
# transformers loads both with its FineGrainedFP8 quantizer (quantizers/auto.py): "mxfp8" is FP8 e4m3 codes with
# [1, 32] blocks of e8m0 scales stored as uint8 bytes (Inkling2's releases)
TRANSFORMERS_METHODS = (QUANT_METHOD, "mxfp8")
# Meta's FP8 releases (Llama 3.1 405B FP8): e4m3 codes with one float32 X.weight_scale per output row, which
# transformers loads with its FbgemmFp8 quantizer (CUDA only: fbgemm_gpu's kernels; no CPU reader exists), read here
# with compressed-tensors' channel dequantization (code x its row's scale, the same product)
FBGEMM = "fbgemm_fp8"
COMPRESSED = "compressed-tensors"
# X.weight -> its scale: transformers' FP8 layout stores X.weight_scale_inv, compressed-tensors X.weight_scale (both the
# factor the codes are multiplied by to dequantize)
SCALE_SUFFIX = {**dict.fromkeys(TRANSFORMERS_METHODS, "_scale_inv"), FBGEMM: "_scale", COMPRESSED: "_scale"}
# compressed-tensors' other per-module tensors beside a weight: part of its storage or of the activations' scheme
COMPANIONS = (".weight_scale", ".weight_zero_point", ".input_scale", ".input_zero_point")
EXTRA = "quant"  # pyproject.toml's extra that installs compressed-tensors


@dataclass(frozen=True)
class FP8Scheme:
    """What config.json's quantization_config states: how each scale covers its weight (``strategy``: one per
    ``block`` of (rows, columns), per output channel, or one per tensor), the scale's name, what is left
    unquantized."""

    block: tuple[int, int] | None
    not_converted: tuple[str, ...] = ()
    power_of_two: bool = False  # scale_fmt "ue8m0": each scale a power of two (DeepSeek V3.1's UE8M0 scales)
    method: str = QUANT_METHOD  # quant_method: "fp8" / "mxfp8" / "fbgemm_fp8" (transformers') or "compressed-tensors"
    strategy: str = "block"  # compressed-tensors' strategy: "block", "channel" or "tensor"
    targets: tuple[str, ...] = ()  # compressed-tensors' config group targets (``compressed_config.module_scheme``)
    # compressed-tensors' groups stating several FP8 schemes (llm-compressor's non-uniform recipes: attention per
    # channel, the MLP per tensor): each target -> its own scheme, in the config's order
    groups: tuple[tuple[str, FP8Scheme], ...] = ()

    def for_module(self, module: str, where: str) -> FP8Scheme:
        """The scheme of quantized ``module``: the one compressed-tensors gives it (``compressed_config.
        module_scheme``: a module no group targets, or one its ignore list names, is refused), or this one where
        transformers' quantizer converts it (``check_converted``: one modules_to_not_convert names is refused)."""
        if self.method != COMPRESSED:
            check_converted(module, self.not_converted, where)
            return self
        return module_scheme(dict(self.groups) or dict.fromkeys(self.targets, self), self.not_converted, module,
                             where)

    def block_for(self, shape) -> tuple[int, int]:
        """The block one scale covers in a matrix of ``shape``: a channel's is its row, a tensor's the matrix."""
        if self.strategy == "channel":
            return 1, shape[-1]
        if self.strategy == "tensor":
            return shape[-2], shape[-1]
        return self.block

    @property
    def suffix(self) -> str:
        return SCALE_SUFFIX[self.method]

    def describe(self) -> str:
        if len({scheme.describe() for _, scheme in self.groups}) > 1:
            return "; ".join(f"{target}: {scheme.describe()}" for target, scheme in self.groups)
        how = (f"{self.block[0]}x{self.block[1]} blocks" if self.strategy == "block"
               else f"one scale per {self.strategy}")
        layout = {COMPRESSED: ", compressed-tensors' float-quantized layout",
                  FBGEMM: ", fbgemm_fp8's layout (Meta's FP8 releases)"}.get(self.method, "")
        return f"FP8 e4m3, {how}" + (", power-of-two (ue8m0) scales" if self.power_of_two else "") + layout


@dataclass
class BlockQuantized:
    """One quantized matrix as its file stores it: the e4m3 codes, each block's scale (``weight_scale_inv``), and
    the block one scale covers.  Stored layout ([out, in])."""

    codes: object  # torch.Tensor, float8_e4m3fn
    scales: object  # torch.Tensor, float32 [ceil(out / block[0]), ceil(in / block[1])]
    block: tuple[int, int]
    scale_name: str
    power_of_two: bool = False
    scale_dtype: str = "float32"  # as the file stores the scales (llm-compressor keeps a bfloat16 model's dtype)


def scheme_of(raw_config: dict, where: str) -> FP8Scheme | None:
    """The FP8 scheme config.json states, None for a checkpoint that is neither FP8 block-quantized nor in
    compressed-tensors' layout; a quantization_config parity cannot read is a CheckpointError naming the field."""
    config = raw_config.get("quantization_config")
    if isinstance(config, dict) and config.get("quant_method") == COMPRESSED:
        return compressed_scheme(config, where)
    if isinstance(config, dict) and config.get("quant_method") == FBGEMM:
        transformers_config(config, where)  # its checks, in its words
        return FP8Scheme(None, stated_modules(config, "modules_to_not_convert", where), method=FBGEMM,
                         strategy="channel")
    if not isinstance(config, dict) or config.get("quant_method") not in TRANSFORMERS_METHODS:
        return None
    fmt = config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise CheckpointError(f"{where}: config.json's quantization_config.fmt is {fmt!r}; parity reads FP8 block "
                              "quantization in e4m3 (float8_e4m3fn) only")
    block = config.get("weight_block_size", ())  # absent: transformers' default (128, 128); null: one per tensor
    if block not in ((), None) and (not isinstance(block, list) or len(block) != 2
                                    or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0
                                               for b in block)):
        raise CheckpointError(f"{where}: config.json's quantization_config.weight_block_size is {block!r}; expected "
                              "two positive integers such as [128, 128] (the rows and columns each weight_scale_inv "
                              "covers), or null (one scale per tensor)")
    parsed = transformers_config(config, where)
    block = parsed.weight_block_size
    if parsed.expert_dtype != "fp8":
        raise CheckpointError(f"{where}: config.json's quantization_config.expert_dtype is {parsed.expert_dtype!r} "
                              "(DeepSeek V4's FP4-packed experts); parity reads FP8 experts only so far")
    # transformers reads MiniMax's ``ignored_layers`` as modules_to_not_convert
    key = "modules_to_not_convert" if config.get("modules_to_not_convert") is not None or \
        "ignored_layers" not in config else "ignored_layers"
    skipped = stated_modules(config, key, where)
    return FP8Scheme(None if block is None else (block[0], block[1]), skipped, parsed.scale_fmt == "ue8m0",
                     method=config["quant_method"], strategy="tensor" if block is None else "block")


def transformers_config(config: dict, where: str):
    """quantization_config read by transformers' own class for its quant_method (FineGrainedFP8Config: its defaults,
    its aliases, its checks), or a CheckpointError in its words."""
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING

    try:
        return AUTO_QUANTIZATION_CONFIG_MAPPING[config["quant_method"]].from_dict(dict(config))
    except (ValueError, TypeError) as refused:
        raise CheckpointError(f"{where}: config.json's quantization_config is not one transformers reads: "
                              f"{refused}") from None


def stored_parts(raw_config: dict, names, where: str, scale: str) -> tuple[dict[str, str], set[str]]:
    """The tensors transformers' FP8 quantizer loads as a quantized module's parts beside its weight (its
    ``serialized_names``: ``weight_scale_inv`` (``scale``), ``activation_scale``), found through its own renamings
    (``update_weight_conversions``: DeepSeek V4 stores ``X.scale``, Mistral Large 4 ``X.qscale_weight``; Inkling2's
    model type keeps ``.scale`` for its norms) where an ``X.weight`` is stored beside the renamed name.  Only its
    renamings are applied: the converters it adds (``dequantize: true`` folds weight and scale into one) say how it
    loads them, not what they are called.  Two stored tensors naming one module's scale is a CheckpointError naming
    both (which one a loader takes is its own order).  Returns each weight -> its stored scale, and every such part's
    stored name."""
    from types import SimpleNamespace as Stub

    from transformers.core_model_loading import WeightRenaming
    from transformers.quantizers.auto import AutoHfQuantizer

    config = raw_config["quantization_config"]
    quantizer = AutoHfQuantizer.from_config(transformers_config(config, where), pre_quantized=True)
    model = Stub(config=Stub(model_type=str(raw_config.get("model_type", ""))), named_parameters=lambda: iter(()))
    renamings = [r for r in quantizer.update_weight_conversions([], model) if isinstance(r, WeightRenaming)]
    kinds = [part for part in quantizer.serialized_names["weight"] if part != "weight"]
    weights = set(names)
    scales, parts = {}, set()
    for name in names:
        renamed = name
        for renaming in renamings:
            renamed, _ = renaming.rename_source_key(renamed)
        module, _, part = renamed.rpartition(".")
        if part in kinds and f"{module}.weight" in weights:
            parts.add(name)
            if part == scale and f"{module}.weight" in scales:
                raise CheckpointError(f"{where}: {scales[f'{module}.weight']} and {name} are both {module}'s "
                                      f"{scale} as transformers' FP8 loader names them; keep one")
            if part == scale:
                scales[f"{module}.weight"] = name
    return scales, parts


def powers_of_two(scales) -> bool:
    """Whether stored scales are e8m0 exponents (float8_e8m0fnu, or MXFP8's uint8 bytes): powers of two, whatever
    the config's scale_fmt says."""
    import torch

    return scales.dtype in (torch.uint8, torch.float8_e8m0fnu)


def decoded(scales):
    """Stored scales as float32: e8m0 exponents kept as uint8 bytes (MXFP8's, which transformers' Fp8Dequantize reads
    as 2^(byte - 127)) through torch's float8_e8m0fnu, the rest as they are."""
    import torch

    return (scales.view(torch.float8_e8m0fnu) if scales.dtype == torch.uint8 else scales).float()


def compressed_scheme(config: dict, where: str) -> FP8Scheme:
    """compressed-tensors' quantization_config, read by compressed-tensors itself (``QuantizationConfig``): FP8
    weights (format float-quantized, 8-bit float, symmetric) are read, each config group's scheme for the modules
    compressed-tensors gives it (``FP8Scheme.for_module``); any other is refused naming what it is."""
    library = require_library(where, COMPRESSED)
    parsed = parsed_config(library.QuantizationConfig, config, where)
    schemes = {k: g for k, g in weight_schemes(parsed).items() if group_format(parsed, g) not in FP4_FORMATS
               and (parsed.format != MIXED or str(getattr(g.weights.type, "value", g.weights.type)) == "float")}
    if not schemes:
        raise CheckpointError(f"{where}: config.json's quantization_config (compressed-tensors) states no weight "
                              "scheme in its config_groups")
    ignore = tuple(str(n) for n in parsed.ignore or [])
    read = {key: float_scheme(group_format(parsed, group), group, ignore, where) for key, group in schemes.items()}
    targets = {t: g for t, g in targets_of(parsed).items() if g.weights.model_dump_json() in read}
    groups = tuple((target, read[group.weights.model_dump_json()]) for target, group in targets.items())
    return dataclasses.replace(next(iter(read.values())), targets=tuple(targets), groups=groups)


def float_scheme(form: str, group, ignore: tuple[str, ...], where: str) -> FP8Scheme:
    """One config group's FP8 scheme (stored in ``form``: ``compressed_config.group_format``), or a CheckpointError
    naming what it is."""
    args = group.weights
    strategy = str(getattr(args.strategy, "value", args.strategy))
    readable = (form in ("float-quantized", "naive-quantized") and str(getattr(args.type, "value", args.type))
                == "float" and args.num_bits == 8 and args.symmetric and strategy in ("block", "channel", "tensor"))
    if not readable:
        raise CheckpointError(f"{where}: compressed-tensors format {form!r} with {args.num_bits}-bit "
                              f"{getattr(args.type, 'value', args.type)} weights, strategy {strategy!r}: parity reads "
                              "compressed-tensors' integer weights (formats pack-quantized, int-quantized, "
                              "naive-quantized, mixed-precision), its 8-bit float weights (float-quantized: symmetric, "
                              "strategy block, channel or tensor) and its FP4 (nvfp4- and mxfp4-pack-quantized)")
    block = tuple(args.block_structure) if strategy == "block" else None
    return FP8Scheme(block, ignore, method=COMPRESSED, strategy=strategy)


def require_library(where: str, method: str = QUANT_METHOD):
    """compressed-tensors (its QuantizationArgs, QuantizationConfig and dequantize), or a CheckpointError (exit 2)
    naming what to install."""
    try:
        from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig
        from compressed_tensors.quantization.lifecycle.forward import dequantize
    except ImportError:
        raise CheckpointError(
            f"{where}: its weights are FP8-quantized (config.json: quantization_config.quant_method {method!r}), "
            "which parity dequantizes with compressed-tensors, and that is not installed: "
            f"{install_command(EXTRA, fallback='compressed-tensors')} (ffn-parity's extra '{EXTRA}')") from None
    return SimpleNamespace(QuantizationArgs=QuantizationArgs, QuantizationConfig=QuantizationConfig,
                           dequantize=dequantize)


def expected_grid(shape, block: tuple[int, int]) -> tuple[int, int]:
    """The scale grid the stated block calls for: one scale per block, partial edge blocks included."""
    return math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1])


def implied_blocks(shape, grid) -> str:
    """The power-of-two blocks a grid of this shape fits (ceil(side / block) == grid side), in words."""
    fits = []
    for side, cells in zip(shape[-2:], grid, strict=True):
        fits.append([2 ** k for k in range(0, 16) if cells and math.ceil(side / 2 ** k) == cells])
    if all(fits):
        return f"{fits[0][0]}x{fits[1][0]}" + (" or larger" if len(fits[0]) > 1 or len(fits[1]) > 1 else "")
    return "no power-of-two block"


def as_grid(scales):
    """A scale tensor as a grid [rows, columns]: a per-tensor scale ([1] or []) is [1, 1]."""
    return scales.reshape(1, 1) if scales.dim() < 2 and scales.numel() == 1 else scales


def check_grid(location: str, name: str, codes, scales, scheme: FP8Scheme, scale_name: str) -> None:
    """The scale grid (tensor ``scale_name``) is the one the stated scheme calls for, else a QuantizedLayoutError
    saying what it is."""
    block = scheme.block_for(codes.shape)
    grid = expected_grid(codes.shape, block)
    found = tuple(scales.shape)
    if found == grid:
        return
    stated = (f"weight_block_size {list(block)}" if scheme.strategy == "block" else f"strategy {scheme.strategy!r}")
    said = (f"{location}: {scale_name} has shape {list(scales.shape)} for {name} {list(codes.shape)}; "
            f"config.json's {stated} calls for one scale per block, {list(grid)}")
    if len(found) != 2:
        raise QuantizedLayoutError(f"{said}: a grid of {len(found)} dimensions", "fp8_block_size_wrong")
    if found == tuple(reversed(grid)):
        raise QuantizedLayoutError(f"{said}: it is that grid transposed", "fp8_scales_transposed")
    raise QuantizedLayoutError(f"{said}: it is the grid of {implied_blocks(codes.shape, found)} blocks, not the "
                               "stated ones", "fp8_block_size_wrong")


class FP8Checkpoint(Checkpoint):
    """An HF folder of FP8-quantized weights: ``read`` returns each quantized matrix dequantized (float32) by
    compressed-tensors; the scale tensors (and compressed-tensors' other companions of a weight) are kept apart from
    ``weight_map`` (they are part of their weight's storage, not tensors of the model)."""

    scheme: FP8Scheme
    companions: dict[str, str]
    as_stored: dict[str, str]  # tensor name -> its dtype in the file, for the tensors the last read returned
    scale_of: dict[str, str]  # a quantized weight -> its scale's stored name

    def quantized(self, name: str) -> BlockQuantized | None:
        """How tensor ``name`` is stored, when it is FP8-quantized: its codes, scales (as a grid) and block."""
        scale_name = self.scale_of.get(name)
        if scale_name is None or not self.has(name):
            return None
        codes = self.reader(self.weight_map[name], [name])[name]
        if codes.dtype.itemsize != 1 or codes.dim() != 2:
            return None
        scales = self.reader(self.companions[scale_name], [scale_name])[scale_name]
        block = self.scheme.for_module(name.removesuffix(".weight"), self.location).block_for(codes.shape)
        return BlockQuantized(codes, as_grid(decoded(scales)), block, scale_name,
                              self.scheme.power_of_two or powers_of_two(scales),
                              str(scales.dtype).removeprefix("torch."))

    def stored_dtype(self, name: str) -> str | None:
        """The dtype tensor ``name`` had in its file when last read (torch's name: ``bfloat16``), None if not read:
        a layer mixing dequantized float32 with a tensor left in bfloat16 is upcast to one dtype when read, and a
        compare must judge the bfloat16 one as the cast it is."""
        return self.as_stored.get(name)

    def read(self, names: list[str]):
        out = super().read(names)
        self.as_stored = {name: str(out[name].dtype).removeprefix("torch.") for name in names}
        for name in names:
            scale_name = self.scale_of.get(name)
            if scale_name is not None and out[name].dtype.itemsize == 1:
                scales = self.reader(self.companions[scale_name], [scale_name])[scale_name]
                out[name] = self.dequantize(name, out[name], scales)
            elif out[name].dtype.itemsize == 1 and out[name].dtype.is_floating_point:
                raise CheckpointError(f"{self.location}: {name} is stored "
                                      f"{str(out[name].dtype).removeprefix('torch.')} without a scale beside it "
                                      f"({name}{self.scheme.suffix}, or a name the format's loader renames to it): "
                                      "its codes are not its values")
            elif self.scheme.method == COMPRESSED:  # a linear its config quantizes, stored plain: the layer's finding
                check_plain(self.scheme.targets, self.scheme.not_converted, name, out[name], self.location)
        return out

    def dequantize(self, name: str, codes, scales):
        """compressed-tensors' dequantization (float32) in the block one scale covers; the grid checked first.  A
        stacked (3-D) FP8 tensor is not read yet: refused, naming it."""
        import torch

        if codes.dim() != 2:
            raise CheckpointError(f"{self.location}: {name} is an FP8 tensor of shape {list(codes.shape)}; parity "
                                  "reads FP8 matrices (2-D), not stacked experts, so far")
        # one its loader would not quantize: the layer's finding
        scheme = self.scheme.for_module(name.removesuffix(".weight"), self.location)
        scales = as_grid(decoded(scales))
        check_grid(self.location, name, codes, scales, scheme, self.scale_of[name])
        library = require_library(self.location, self.scheme.method)
        block = scheme.block_for(codes.shape)
        args = library.QuantizationArgs(num_bits=8, type="float", strategy="block", block_structure=list(block),
                                        symmetric=True, dynamic=False)
        return library.dequantize(codes, scales, None, args=args, dtype=torch.float32)


def wrap(checkpoint: Checkpoint, folder: Path | str) -> Checkpoint:
    """``checkpoint`` as an FP8Checkpoint when its config states FP8 quantization, else unchanged."""
    scheme = scheme_of(checkpoint.raw_config, shown(folder))
    if scheme is None:
        return checkpoint
    require_library(shown(folder), scheme.method)  # before anything is computed: exit 2 naming the extra
    if scheme.method == COMPRESSED:
        weights, companions = split_companions(checkpoint, COMPANIONS)
        scale_of = {n[:-len(scheme.suffix)]: n for n in companions
                    if n.endswith(scheme.suffix) and n[:-len(scheme.suffix)] in weights}
    else:
        scale_of, parts = stored_parts(checkpoint.raw_config, list(checkpoint.weight_map), shown(folder),
                                       "weight" + scheme.suffix)
        weights = {n: f for n, f in checkpoint.weight_map.items() if n not in parts}
        companions = {n: f for n, f in checkpoint.weight_map.items() if n in parts}
    how = "compressed-tensors in the stated blocks (partial edge blocks included)"
    wrapped = dequantized_on_read(checkpoint, FP8Checkpoint, scheme, weights, companions, matrices=len(scale_of),
                                  dequantized_with=how)
    wrapped.scale_of = scale_of
    return wrapped
