"""MLX-LM quantized safetensors (what ``mlx_lm.convert -q`` writes): an HF folder whose config.json says
``quantization = {group_size: 64, bits: 4}`` (mlx-lm copies it to ``quantization_config``, with no ``quant_method``;
``mode``, when given, is one of mlx.core.quantize's modes: ``affine``, the default, or the microscaled ``mxfp4``,
``mxfp8``, ``nvfp4``), possibly with per-module entries (a module path mapping to its own ``{group_size, bits, mode}``,
or false for a module left unquantized), and whose quantized matrices are stored as ``X.weight`` (uint32, each word
packing 32 / bits codes along the input dimension) and ``X.scales`` (one per group of group_size input values: [...,
out, in / group_size]).  Affine mode stores ``X.biases`` too, scales and biases in the model's dtype, and the true
weight is scale x code + bias in each group; a microscaled mode stores uint8 scales (e8m0 or e4m3, as mlx's table of
modes says) and no biases, and the true weight is scale x the code's floating-point value (FP4 e2m1, FP8 e4m3).
Tensors without scales are stored unquantized and read as stored.

``read`` returns the dequantized float32 weight, dequantized by MLX itself (``mlx.core.dequantize``, the extra
``mlx``), imported only when a checkpoint needs it.  Affine scales and biases are handed to it in float32 (their
stored bfloat16/float16 values exactly), so the dequantized values are the file's, not rounded once more to its dtype.
What each mode accepts (bit widths, group sizes, defaults) and what each code and scale byte means are asked of mlx
(``mlx.core.quantize`` and ``dequantize``), not tabulated here.

The packed weight and scales must have the shapes the stated group size and bits call for, and the storage the stated
mode has: another fit is a conversion mistake (``QuantizedLayoutError``: another group size, another bit width, the
scales transposed, another mode), which a compare reports on the layer that holds it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache, cached_property
from pathlib import Path

from parity.definitions.distribution import install_command
from parity.definitions.files import shown
from parity.errors import CheckpointError, QuantizedLayoutError, UnstatedModuleError
from parity.sources.checkpoint import Checkpoint, dequantized_on_read, split_companions

EXTRA = "mlx"  # pyproject.toml's extra that installs mlx
# a module's parts beside its packed X.weight: its scales, affine's biases, and nvfp4's optional global scale (one
# float32 per tensor, which mlx.core.quantize and dequantize take as ``global_scale``, nvfp4 only)
COMPANIONS = (".scales", ".biases", ".global_scale")
WORD = 32  # bits per packed uint32
AFFINE = "affine"  # mlx.core.quantize's default mode: a scale and a bias per group


@dataclass(frozen=True)
class MLXParams:
    """One module's quantization: ``group_size`` input values share a scale (and in affine mode a bias); codes of
    ``bits`` bits; ``mode``: mlx.core.quantize's."""

    group_size: int
    bits: int
    mode: str = AFFINE

    @property
    def affine(self) -> bool:
        return self.mode == AFFINE

    def describe(self) -> str:
        return (f"{self.bits}-bit, groups of {self.group_size}" if self.affine
                else f"{self.mode}, groups of {self.group_size}")


@dataclass(frozen=True)
class MLXScheme:
    """What config.json's quantization states: the default parameters and each module's own (None: left
    unquantized)."""

    default: MLXParams
    modules: dict[str, MLXParams | None] = field(default_factory=dict)

    def params_for(self, name: str) -> MLXParams | None:
        """The parameters tensor ``name`` (``model.layers.0.mlp.gate_proj.weight``) is stated to be quantized with:
        its module's own entry, else the default."""
        module = name.rsplit(".", 1)[0]
        return self.modules.get(module, self.default)

    def describe(self) -> str:
        mixed = sum(1 for p in self.modules.values() if p is not None and p != self.default)
        kept = sum(1 for p in self.modules.values() if p is None)
        return (f"MLX {AFFINE + ' ' if self.default.affine else ''}{self.default.describe()}"
                + (f", {mixed} modules with their own" if mixed else "")
                + (f", {kept} left unquantized" if kept else ""))


@dataclass
class MLXQuantized:
    """One quantized matrix as its file stores it: each value's code ([..., out, in], float32: affine's integer code,
    a microscaled mode's value at unit scale), each group's scale (float32 of its stored value, decoded from its byte
    in a microscaled mode) and affine's bias (None otherwise), [..., out, in / group_size]; the dtype a writer casts the
    model to before quantizing (affine: the scales' stored dtype); a microscaled mode's levels (every code's value at
    unit scale, ascending), else None."""

    codes: object  # torch.Tensor
    scales: object
    biases: object | None
    params: MLXParams
    scale_dtype: str
    levels: object | None = None
    global_scale: float | None = None  # nvfp4's, as stored (its effect is in ``scales`` already)


@dataclass
class Held:
    """A quantized tensor as read from its file: the packed words, the scales and (affine) biases as stored."""

    packed: object  # torch.Tensor
    scales: object
    biases: object | None
    params: MLXParams
    global_scale: float | None = None  # nvfp4's X.global_scale, where the file stores one


@cache
def mode_defaults(mode: str, group: int | None, bits: int | None) -> tuple[int, int] | str:
    """(group size, bits) mlx.core.quantize uses in ``mode`` for these (None: its default), or mlx's own words for why
    it refuses them (an unknown mode, a width or group size the mode does not take)."""
    import mlx.core as mx

    width = 4096  # a multiple of every group size mlx offers
    try:
        packed, scales, *_ = mx.quantize(mx.zeros((1, width)), group_size=group, bits=bits, mode=mode)
    except (ValueError, TypeError) as refused:
        return str(refused)
    return width // scales.shape[-1], packed.shape[-1] * WORD // width


def mlx_accepts(params: MLXParams) -> bool:
    """Whether mlx.core.quantize takes this group size and width in this mode."""
    return mode_defaults(params.mode, params.group_size, params.bits) == (params.group_size, params.bits)


def params_of(entry, where: str, field_name: str, mode: str = AFFINE) -> MLXParams:
    """``{group_size, bits, mode}`` from config.json (a null or absent group size or width: mlx's default for the
    mode; an absent mode: ``mode``, the scheme's), or a CheckpointError naming the field, in mlx's words where mlx
    refuses the parameters."""
    if not isinstance(entry, dict) or not ({"group_size", "bits"} & entry.keys()):
        raise CheckpointError(f"{where}: config.json's {field_name} is {entry!r}; expected {{\"group_size\": N, "
                              "\"bits\": B}, optionally with \"mode\" (MLX's quantization)")
    mode = entry.get("mode", mode)
    group, bits = entry.get("group_size"), entry.get("bits")
    for value in (group, bits):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise CheckpointError(f"{where}: config.json's {field_name} is {entry!r}; group_size and bits must be "
                                  "positive integers (or null: mlx's default for the mode)")
    if not isinstance(mode, str):
        raise CheckpointError(f"{where}: config.json's {field_name}.mode is {mode!r}; expected one of "
                              "mlx.core.quantize's modes (a string)")
    require_mlx(where)
    found = mode_defaults(mode, group, bits)
    if isinstance(found, str):
        raise CheckpointError(f"{where}: config.json's {field_name} is {entry!r}, which mlx cannot quantize with: "
                              f"{found}")
    return MLXParams(*found, mode)


def scheme_of(raw_config: dict, where: str) -> MLXScheme | None:
    """The MLX scheme config.json states, None for a checkpoint that is not MLX-quantized (no ``quantization``, and
    no ``quantization_config`` without a ``quant_method``)."""
    config = raw_config.get("quantization")
    field_name = "quantization"
    if not isinstance(config, dict):
        config, field_name = raw_config.get("quantization_config"), "quantization_config"
        if not isinstance(config, dict) or "quant_method" in config or "bits" not in config:
            return None
    default = params_of(config, where, field_name)
    modules = {}
    for key, entry in config.items():
        if key in ("group_size", "bits", "mode") or not (isinstance(entry, dict) or entry is False):
            continue  # a module's entry is {group_size, bits} or false; another field is not one
        modules[key] = (None if entry is False
                        else params_of(entry, where, f"{field_name}[{key!r}]", default.mode))
    return MLXScheme(default, modules)


def require_mlx(where: str):
    """mlx.core, or a CheckpointError (exit 2) naming what to install."""
    try:
        import mlx.core as mx
    except ImportError:
        raise CheckpointError(
            f"{where}: its weights are MLX-quantized (config.json: quantization with group_size and bits, as "
            "mlx_lm.convert writes), which parity dequantizes with mlx, and that is not installed: "
            f"{install_command(EXTRA, fallback='mlx')} (ffn-parity's extra '{EXTRA}')") from None
    return mx


def check_mode_storage(location: str, name: str, scales, has_biases: bool, params: MLXParams) -> None:
    """The scales (and biases) are what the stated mode stores, else a QuantizedLayoutError naming the mode they are:
    affine keeps float scales and biases in the model's dtype, a microscaled mode uint8 scales and no biases."""
    import torch

    prefix = name.removesuffix("weight")
    byte_scales = scales.dtype == torch.uint8
    if params.affine and byte_scales and not has_biases:
        raise QuantizedLayoutError(f"{location}: {prefix}scales is uint8 with no {prefix}biases beside it, as MLX's "
                                   "microscaled modes (mxfp4, mxfp8, nvfp4) store them; config.json states affine "
                                   "quantization (a float scale and bias per group)", "mlx_mode_wrong")
    if not params.affine and (not byte_scales or has_biases):
        stored = f"{str(scales.dtype).removeprefix('torch.')}" + (f" with {prefix}biases" if has_biases else "")
        raise QuantizedLayoutError(f"{location}: {prefix}scales is {stored}, as MLX's affine mode stores them; "
                                   f"config.json states {params.mode} (one uint8 scale per group, no biases)",
                                   "mlx_mode_wrong")
    if params.affine and not has_biases:
        raise CheckpointError(f"{location}: {prefix}scales has no {prefix}biases beside it; MLX's affine "
                              "quantization stores both (scale x code + bias per group)")


def check_shapes(location: str, name: str, packed, scales, params: MLXParams, dims: set[int] | Callable) -> None:
    """The packed weight and scales have the shapes the stated parameters call for, else a QuantizedLayoutError
    naming what they fit: the scales transposed, another bit width at the stated group size, another group size at
    the stated width (either one mlx takes in the stated mode).  The input width each reading implies is held to the
    widths the module may have, ``dims`` (or a callable giving them, asked only for a misfit): its own in_features
    where transformers' model knows the module, else every size the config states (a set of all sizes alone misnames
    one where two sizes coincide, e.g. intermediate_size == vocab_size)."""
    if packed.dim() < 2 or packed.numel() == 0:
        raise CheckpointError(f"{location}: {name} is {list(packed.shape)}; an MLX-quantized matrix is uint32 "
                              "[..., out, in x bits / 32] with at least one value")
    columns = packed.shape[-1] * WORD // params.bits
    expected = (*packed.shape[:-1], columns // params.group_size)
    if columns % params.group_size == 0 and tuple(scales.shape) == expected:
        return
    said = (f"{location}: {name} is uint32 {list(packed.shape)} with {name.removesuffix('weight')}scales "
            f"{list(scales.shape)}; the stated {params.describe()} calls for scales {list(expected)}")
    if scales.dim() >= 2 and tuple(scales.shape[-2:]) == (expected[-1], expected[-2]):
        raise QuantizedLayoutError(f"{said}: they are that grid transposed", "mlx_scales_transposed")
    if scales.dim() != packed.dim():
        raise CheckpointError(f"{said}; a scale grid of {scales.dim()} dimensions beside {packed.dim()}")
    groups = scales.shape[-1]
    at_group = groups * params.group_size  # the input width if the group size is right: the bits are not
    bits = packed.shape[-1] * WORD // at_group if at_group else 0
    at_bits = columns  # the input width if the bits are right: the group size is not
    group = at_bits // groups if groups else 0
    bits_fit = (bits > 0 and packed.shape[-1] * WORD == bits * at_group
                and mlx_accepts(MLXParams(params.group_size, bits, params.mode)))
    group_fit = group > 0 and group * groups == at_bits and mlx_accepts(MLXParams(group, params.bits, params.mode))
    dims = dims() if callable(dims) else dims
    if bits_fit and (not group_fit or (at_group in dims and at_bits not in dims)):
        raise QuantizedLayoutError(f"{said}: they fit {bits}-bit codes in the stated groups of {params.group_size} "
                                   f"({at_group} input values), not {params.bits}-bit", "mlx_bits_mismatched")
    if group_fit:
        raise QuantizedLayoutError(f"{said}: they fit groups of {group} at the stated {params.bits} bits ({at_bits} "
                                   f"input values), not {params.group_size}", "mlx_group_size_wrong")
    raise CheckpointError(f"{said}; they fit no group size and bit width MLX writes in {params.mode} mode")


def check_dtypes(location: str, name: str, packed, scales, biases) -> None:
    """The packed words uint32, affine's scales and biases floats of one shape (as ``mlx.core.quantize`` returns
    them), else a CheckpointError naming the tensor: mlx's dequantizer refuses anything else in its own words."""
    import torch

    prefix = name.removesuffix("weight")
    if packed.dtype not in (torch.uint32, torch.int32):  # safetensors' U32, read as torch's uint32 (or a signed view)
        raise CheckpointError(f"{location}: {name} is {str(packed.dtype)[6:]}; MLX stores quantized codes as uint32 "
                              "words")
    if biases is not None and (not scales.dtype.is_floating_point or biases.shape != scales.shape
                               or not biases.dtype.is_floating_point):
        raise CheckpointError(f"{location}: {prefix}scales is {str(scales.dtype)[6:]} {list(scales.shape)} and "
                              f"{prefix}biases {str(biases.dtype)[6:]} {list(biases.shape)}; MLX's affine mode stores "
                              "one float scale and one float bias per group")


def to_mlx(mx, tensor):
    """A torch tensor as an mlx array of the same bits (uint32 words and uint8 scales kept as stored)."""
    import numpy as np
    import torch

    if tensor.dtype in (torch.uint32, torch.int32):
        return mx.array(tensor.contiguous().view(torch.int32).numpy().view(np.uint32))
    if tensor.dtype == torch.uint8:
        return mx.array(tensor.contiguous().numpy())
    return mx.array(tensor.float().numpy())


def even_rows(mx, call, *arrays):
    """``call`` on these arrays ([..., rows, columns], all alike in their leading shape) with their rows made even
    and the result's made back: mlx 0.32's nvfp4 quantize and dequantize reshape by 32 values and refuse a matrix of
    an odd number of rows of 16 (``[reshape] Cannot reshape array of size 16 into shape (0,4,8)``)."""
    lead = arrays[0].shape[:-1]
    flat = [a.reshape(-1, a.shape[-1]) for a in arrays]
    rows = flat[0].shape[0]
    if rows % 2:
        flat = [mx.concatenate([a, mx.zeros_like(a[:1])]) for a in flat]
    found = call(*flat)
    back = [t[:rows].reshape(*lead, t.shape[-1]) for t in (found if isinstance(found, (tuple, list)) else [found])]
    return tuple(back) if isinstance(found, (tuple, list)) else back[0]


@cache
def anchor(mode: str) -> tuple[int, object]:
    """A microscaled mode's reference scale byte and each byte's value relative to it (float32 [256]; NaN where a
    byte encodes no scale), asked of mlx: the byte mlx.core.quantize gives a group of ones, and a group of ones'
    codes dequantized with every byte as their scale, divided by the ones they give at the reference byte.  A code's
    value is read at the reference byte (``unpack``), so B's value is that times its group's relative scale."""
    import numpy as np
    import torch

    mx = require_mlx(f"MLX {mode}")
    group, _ = mode_defaults(mode, None, None)
    packed, scale = mx.quantize(mx.ones((2, group)), mode=mode)
    every = mx.arange(256).astype(mx.uint8).reshape(256, 1)
    ones = mx.dequantize(packed, scale, mode=mode, dtype=mx.float32)[0, 0]
    found = even_rows(mx, lambda w, s: mx.dequantize(w, s, mode=mode, dtype=mx.float32),
                      mx.broadcast_to(packed[:1], (256, packed.shape[-1])), every)
    return int(np.array(scale)[0, 0]), torch.from_numpy(np.array(found[:, 0] / ones)).float()


def decode_scales(scales, mode: str, global_scale: float | None = None):
    """A microscaled mode's uint8 scales as float32 values relative to its reference byte (``anchor``), times what
    nvfp4's ``global_scale`` multiplies every value by (``global_factor``)."""
    decoded = anchor(mode)[1][scales.long()]
    return decoded if global_scale is None else decoded * global_factor(mode, global_scale)


@cache
def global_factor(mode: str, global_scale: float) -> float:
    """What mlx.core.dequantize multiplies every value by given ``global_scale`` (mlx 0.32: global_scale / (448 x
    6), e4m3's and e2m1's largest magnitudes), asked of mlx: a group of ones dequantized with and without it."""
    import numpy as np

    mx = require_mlx(f"MLX {mode}")
    packed, scale = mx.quantize(mx.ones((2, mode_defaults(mode, None, None)[0])), mode=mode)
    plain, scaled = (mx.dequantize(packed, scale, mode=mode, global_scale=g, dtype=mx.float32)[0, 0]
                     for g in (None, mx.array(np.float32(global_scale))))
    return float(np.array(scaled / plain))


def unpack(mx, packed, params: MLXParams):
    """The codes of a packed uint32 weight, as float32, unpacked by mlx's own dequantize: affine's integer codes
    (unit scales, zero biases), a microscaled mode's values at its reference scale byte (``anchor``).  MLX's packing
    of 3-, 5- and 6-bit codes spans words: it is not re-implemented here."""
    import numpy as np
    import torch

    words = to_mlx(mx, packed)
    shape = (*packed.shape[:-1], packed.shape[-1] * WORD // params.bits // params.group_size)
    if params.affine:
        ones = mx.ones(shape, dtype=mx.float32)
        codes = mx.dequantize(words, ones, ones * 0, group_size=params.group_size, bits=params.bits)
    else:
        unit = mx.full(shape, anchor(params.mode)[0], dtype=mx.uint8)
        codes = even_rows(mx, lambda w, s: mx.dequantize(w, s, group_size=params.group_size, bits=params.bits,
                                                         mode=params.mode, dtype=mx.float32), words, unit)
    return torch.from_numpy(np.array(codes.astype(mx.float32)))


@cache
def mode_levels(params: MLXParams):
    """Every code's value at its reference scale byte in a microscaled mode (``anchor``), ascending and finite
    (FP4's 15 distinct values, FP8 e4m3's 253), asked of mlx: every code packed as mlx packs them (the first in the
    lowest bits) and unpacked."""
    import numpy as np
    import torch

    mx = require_mlx(f"MLX {params.mode}")
    count, per_word = 2 ** params.bits, WORD // params.bits
    codes = np.arange(max(count, params.group_size), dtype=np.uint32) % count
    words = (codes.reshape(-1, per_word) << (np.arange(per_word, dtype=np.uint32) * params.bits)).sum(-1)
    words = torch.from_numpy(words.astype(np.uint32).view(np.int32).reshape(1, -1))
    found = unpack(mx, words, params).reshape(-1)
    return found[torch.isfinite(found)].unique()


def dequantize(mx, held: Held):
    """mlx.core.dequantize of one packed weight -> float32 (affine: float32 scales and biases of the stored values;
    a microscaled mode: its uint8 scales as stored, and nvfp4's global scale where the file stores one)."""
    import numpy as np
    import torch

    params = held.params
    words, scales = to_mlx(mx, held.packed), to_mlx(mx, held.scales)
    if params.affine:
        out = mx.dequantize(words, scales, to_mlx(mx, held.biases), group_size=params.group_size, bits=params.bits)
    else:
        gs = None if held.global_scale is None else mx.array(np.float32(held.global_scale))
        out = even_rows(mx, lambda w, s: mx.dequantize(w, s, group_size=params.group_size, bits=params.bits,
                                                       mode=params.mode, global_scale=gs, dtype=mx.float32),
                        words, scales)
    return torch.from_numpy(np.array(out.astype(mx.float32)))


class MLXCheckpoint(Checkpoint):
    """An HF folder of MLX-quantized weights: ``read`` returns each quantized matrix dequantized (float32) by
    mlx; X.scales and X.biases are kept apart from ``weight_map`` (part of their weight's storage)."""

    scheme: MLXScheme
    companions: dict[str, str]
    as_stored: dict[str, str]
    dims: set[int]

    def held(self, name: str) -> Held | None:
        """A quantized ``name`` as read from the file (its packed weight, scales, affine's biases, parameters), checked
        against what config.json states; None for a tensor stored unquantized."""
        prefix = name.removesuffix("weight")
        if not name.endswith(".weight") or prefix + "scales" not in self.companions or not self.has(name):
            return None
        packed = self.reader(self.weight_map[name], [name])[name]
        scales = self.reader(self.companions[prefix + "scales"], [prefix + "scales"])[prefix + "scales"]
        params = self.scheme.params_for(name)
        if params is None:  # mlx-lm would keep it a Linear, its packed words and scales no parameters of it
            raise UnstatedModuleError(self.location, name.removesuffix(".weight"), "its own entry in quantization "
                                      f"is false, yet {prefix}scales is stored beside it", "mlx-lm would keep it a "
                                      "Linear, whose weights hold no scales")
        has_biases = prefix + "biases" in self.companions
        check_mode_storage(self.location, name, scales, has_biases, params)
        biases = self.reader(self.companions[prefix + "biases"], [prefix + "biases"])[prefix + "biases"] \
            if params.affine else None
        check_shapes(self.location, name, packed, scales, params, lambda: self.widths_of(name))
        check_dtypes(self.location, name, packed, scales, biases)
        return Held(packed, scales, biases, params, self.global_scale(name, params))

    def global_scale(self, name: str, params: MLXParams) -> float | None:
        """nvfp4's ``X.global_scale`` beside quantized ``name``, where the file stores one: a positive finite float32
        scalar (what mlx.core.dequantize takes), else a CheckpointError naming it; beside another mode, which mlx
        quantizes without one (its own words: "Global scale is only supported for 'nvfp4'"), a CheckpointError."""
        import torch

        part = name.removesuffix("weight") + "global_scale"
        if part not in self.companions:
            return None
        value = self.reader(self.companions[part], [part])[part]
        if params.mode != "nvfp4":
            raise CheckpointError(f"{self.location}: {part} is stored beside {params.describe()}; mlx takes a global "
                                  "scale in nvfp4 mode only")
        if value.numel() != 1 or value.dtype != torch.float32 or not bool(torch.isfinite(value).all()) \
                or float(value.reshape(())) <= 0:
            shown_value = value.reshape(-1)[:4].tolist()
            raise CheckpointError(f"{self.location}: {part} is {str(value.dtype).removeprefix('torch.')} "
                                  f"{list(value.shape)} {shown_value}; mlx.core.dequantize takes one positive finite "
                                  "float32 global scale per tensor")
        return float(value.reshape(()))

    @cached_property
    def in_features(self) -> dict[str, int]:
        """Each weight's input width in transformers' own model for this config (built on the meta device), {} where
        transformers cannot build it: the width a quantized matrix must unpack to, whatever other sizes coincide."""
        from parity.sources.skeleton import ModelSkeleton

        try:
            from transformers import AutoConfig

            raw = {k: v for k, v in self.raw_config.items() if k not in ("quantization", "quantization_config")}
            config = AutoConfig.for_model(raw.pop("model_type"), **raw)
            return {n: p.shape[-1] for n, p in ModelSkeleton(config).skeleton.named_parameters() if p.dim() >= 2}
        except Exception:  # an architecture transformers cannot build: the config's sizes stand in (widths_of)
            return {}

    def widths_of(self, name: str) -> set[int]:
        """The input widths ``name`` may have: its module's in_features where transformers' model has it (mlx-lm
        keeps transformers' names for dense layers), else every size config.json states."""
        width = self.in_features.get(name)
        return {width} if width is not None else self.dims

    def mlx_quantized(self, name: str, *, expert: int | None = None) -> MLXQuantized | None:
        """How tensor ``name`` is stored, when it is MLX-quantized: its codes, scales, biases and parameters;
        ``expert``: that expert's slice of a stacked [E, out, in] tensor alone (only its codes are unpacked)."""
        held = self.held(name)
        if held is None:
            return None
        packed, scales, biases, params = held.packed, held.scales, held.biases, held.params
        if expert is not None and packed.dim() == 3:
            packed, scales = packed[expert], scales[expert]
            biases = biases[expert] if biases is not None else None
        codes = unpack(require_mlx(self.location), packed, params)
        if params.affine:
            return MLXQuantized(codes, scales.float(), biases.float(), params, str(scales.dtype).removeprefix("torch."))
        return MLXQuantized(codes, decode_scales(scales, params.mode, held.global_scale), None, params,
                            self.model_dtype, mode_levels(params), held.global_scale)

    @cached_property
    def model_dtype(self) -> str:
        """The dtype mlx_lm.convert cast the model to before quantizing it (a microscaled mode's scales are bytes:
        they do not say it): that of a tensor it left unquantized (a norm's weight), else config.json's
        ``torch_dtype`` (``dtype``), else float32."""
        from parity.sources.safetensors_files import DTYPES

        described = self.describe([n for n in self.weight_map if n.endswith("norm.weight")][:1]) or {}
        for _, kind in described.values():
            if kind in ("BF16", "F16", "F32"):
                return DTYPES[kind][0]
        stated = self.raw_config.get("torch_dtype", self.raw_config.get("dtype"))
        return stated if isinstance(stated, str) and stated in ("bfloat16", "float16", "float32") else "float32"

    def describe(self, names: list[str]) -> dict[str, tuple[list[int], str]] | None:
        """Shape and dtype of these tensors from the local safetensors headers, a quantized one as the matrix it
        holds ([..., out, in], its scales' dtype: the model's) rather than its packed uint32 words, so that the
        inventory outside the FFN does not report every quantized tensor as reshaped; None for a hub checkpoint."""
        if self.repo_id is not None or self.weights != "real":
            return None
        from parity.sources.safetensors_files import describe_files

        scales = {n: n.removesuffix("weight") + "scales" for n in names if n.endswith(".weight")}
        scales = {n: s for n, s in scales.items() if s in self.companions}
        wanted = {**{n: self.weight_map[n] for n in names}, **{s: self.companions[s] for s in scales.values()}}
        found = describe_files(self.fetch, wanted)
        if found is None:
            return None
        for name, scale in scales.items():
            params = self.scheme.params_for(name)
            shape, _ = found[name]
            if params is not None:  # affine: its scales' dtype (the model's); a microscaled mode: the mode
                found[name] = ([*shape[:-1], shape[-1] * WORD // params.bits],
                               found[scale][1] if params.affine else params.mode.upper())
        return {name: found[name] for name in names}

    def stored_dtype(self, name: str) -> str | None:
        """The dtype tensor ``name`` had in its file when last read (a quantized one: its scales' dtype)."""
        return self.as_stored.get(name)

    def read(self, names: list[str]):
        out = super().read(names)
        self.as_stored = {name: str(out[name].dtype).removeprefix("torch.") for name in names}
        for name in names:
            held = self.held(name)
            if held is not None:
                out[name] = dequantize(require_mlx(self.location), held)
        return out


def config_dims(raw_config: dict) -> set[int]:
    """The model's widths its config states (hidden_size, intermediate_size, moe_intermediate_size, ...), nested
    text configs included: what a quantized matrix's input width may be."""
    found = set()
    for key, value in raw_config.items():
        if isinstance(value, dict):
            found |= config_dims(value)
        elif key.endswith("_size") and isinstance(value, int) and not isinstance(value, bool):
            found.add(value)
    return found


def wrap(checkpoint: Checkpoint, folder: Path | str) -> Checkpoint:
    """``checkpoint`` as an MLXCheckpoint when its config states MLX quantization, else unchanged."""
    scheme = scheme_of(checkpoint.raw_config, shown(folder))
    if scheme is None:
        return checkpoint
    require_mlx(shown(folder))  # before anything is computed: exit 2 naming the extra
    weights, companions = split_companions(checkpoint, COMPANIONS)
    for name in [n for n in companions if n.endswith(".global_scale")]:  # a quantized matrix's only (beside its scales)
        if name.removesuffix("global_scale") + "scales" not in companions:
            weights[name] = companions.pop(name)
    quantized = sum(1 for n in companions if n.endswith(".scales") and n[:-len("scales")] + "weight" in weights)
    wrapped = dequantized_on_read(checkpoint, MLXCheckpoint, scheme, weights, companions, matrices=quantized,
                                  dequantized_with="mlx.core.dequantize", stated_in="quantization")
    wrapped.dims = config_dims(checkpoint.raw_config)
    return wrapped
