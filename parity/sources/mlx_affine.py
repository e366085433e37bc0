"""MLX-LM affine-quantized safetensors (what ``mlx_lm.convert -q`` writes): an HF folder whose config.json says
``quantization = {group_size: 64, bits: 4}`` (mlx-lm copies it to ``quantization_config``, with no ``quant_method``),
possibly with per-module entries (a module path mapping to its own ``{group_size, bits}``, or false for a module
left unquantized), and whose quantized matrices are stored as ``X.weight`` (uint32, each word packing 32 / bits
codes along the input dimension), ``X.scales`` and ``X.biases`` (the model's dtype, one per group of group_size input
values: [..., out, in / group_size]).  The true weight is scale x code + bias in each group.  Tensors without scales
are stored unquantized and read as stored.

``read`` returns the dequantized float32 weight, dequantized by MLX itself (``mlx.core.dequantize``, the extra
``mlx``), imported only when a checkpoint needs it.  The scales and biases are handed to it in float32 (their stored
bfloat16/float16 values exactly), so the dequantized values are the file's, not rounded once more to its dtype.

The packed weight and scales must have the shapes the stated group size and bits call for: another fit is a
conversion mistake (``QuantizedLayoutError``: another group size, another bit width, the scales transposed), which a
compare reports on the layer that holds it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from parity.definitions.distribution import install_command
from parity.definitions.files import shown
from parity.errors import CheckpointError, QuantizedLayoutError
from parity.sources.checkpoint import Checkpoint, dequantized_on_read, split_companions

EXTRA = "mlx"  # pyproject.toml's extra that installs mlx
COMPANIONS = (".scales", ".biases")
BITS = (2, 3, 4, 5, 6, 8)  # the widths mlx.core.quantize packs in affine mode
WORD = 32  # bits per packed uint32


@dataclass(frozen=True)
class AffineParams:
    """One module's quantization: ``group_size`` input values share a scale and a bias; codes of ``bits`` bits."""

    group_size: int
    bits: int

    def describe(self) -> str:
        return f"{self.bits}-bit, groups of {self.group_size}"


@dataclass(frozen=True)
class MLXScheme:
    """What config.json's quantization states: the default parameters and each module's own (None: left
    unquantized)."""

    default: AffineParams
    modules: dict[str, AffineParams | None] = field(default_factory=dict)

    def params_for(self, name: str) -> AffineParams | None:
        """The parameters tensor ``name`` (``model.layers.0.mlp.gate_proj.weight``) is stated to be quantized with:
        its module's own entry, else the default."""
        module = name.rsplit(".", 1)[0]
        return self.modules.get(module, self.default)

    def describe(self) -> str:
        mixed = sum(1 for p in self.modules.values() if p is not None and p != self.default)
        kept = sum(1 for p in self.modules.values() if p is None)
        return (f"MLX affine {self.default.describe()}" + (f", {mixed} modules with their own" if mixed else "")
                + (f", {kept} left unquantized" if kept else ""))


@dataclass
class AffineQuantized:
    """One quantized matrix as its file stores it: the codes unpacked ([..., out, in], float32 integers), each
    group's scale and bias (float32 of their stored values, [..., out, in / group_size]), and their stored dtype."""

    codes: object  # torch.Tensor
    scales: object
    biases: object
    params: AffineParams
    scale_dtype: str


def default_group(where: str, bits: int) -> int:
    """The group size mlx quantizes with when none is given: mlx_lm.convert's mixed recipes (``--quant-predicate``
    without ``--q-group-size``; mlx-lm 0.32) write each module's entry as ``{"group_size": null, "bits": B, "mode":
    "affine"}`` and mlx's QuantizedLinear then uses its mode's default.  Asked of mlx.core.quantize itself."""
    mx = require_mlx(where)
    width = 4096  # a multiple of every group size mlx offers
    _, scales, _ = mx.quantize(mx.zeros((1, width)), bits=bits, mode="affine")
    return width // scales.shape[-1]


def params_of(entry, where: str, field_name: str) -> AffineParams:
    """``{group_size, bits}`` from config.json (a null group size: mlx's default for the mode), or a CheckpointError
    naming the field."""
    group, bits = (entry.get("group_size"), entry.get("bits")) if isinstance(entry, dict) else (None, None)
    mode = entry.get("mode", "affine") if isinstance(entry, dict) else "affine"
    if mode != "affine":
        raise CheckpointError(f"{where}: config.json's {field_name}.mode is {mode!r}; parity reads MLX's affine "
                              "quantization (scales and biases per group) so far")
    if isinstance(entry, dict) and "group_size" in entry and group is None and bits in BITS:
        group = default_group(where, bits)
    if not (isinstance(group, int) and not isinstance(group, bool) and group > 0 and bits in BITS):
        raise CheckpointError(f"{where}: config.json's {field_name} is {entry!r}; expected {{\"group_size\": N, "
                              f"\"bits\": B}} with N a positive integer and B one of {list(BITS)} (MLX's affine "
                              "quantization)")
    return AffineParams(group, bits)


def scheme_of(raw_config: dict, where: str) -> MLXScheme | None:
    """The MLX scheme config.json states, None for a checkpoint that is not MLX-quantized (no ``quantization``, and
    no ``quantization_config`` without a ``quant_method``); a mode other than affine is refused naming it."""
    config = raw_config.get("quantization")
    field_name = "quantization"
    if not isinstance(config, dict):
        config, field_name = raw_config.get("quantization_config"), "quantization_config"
        if not isinstance(config, dict) or "quant_method" in config or "bits" not in config:
            return None
    mode = config.get("mode", "affine")
    if mode != "affine":
        raise CheckpointError(f"{where}: config.json's {field_name}.mode is {mode!r}; parity reads MLX's affine "
                              "quantization (scales and biases per group) so far")
    default = params_of(config, where, field_name)
    modules = {}
    for key, entry in config.items():
        if key in ("group_size", "bits", "mode") or not (isinstance(entry, dict) or entry is False):
            continue  # a module's entry is {group_size, bits} or false; another field is not one
        modules[key] = None if entry is False else params_of(entry, where, f"{field_name}[{key!r}]")
    return MLXScheme(default, modules)


def require_mlx(where: str):
    """mlx.core, or a CheckpointError (exit 2) naming what to install."""
    try:
        import mlx.core as mx
    except ImportError:
        raise CheckpointError(
            f"{where}: its weights are MLX affine-quantized (config.json: quantization with group_size and bits, as "
            "mlx_lm.convert writes), which parity dequantizes with mlx, and that is not installed: "
            f"{install_command(EXTRA, fallback='mlx')} (ffn-parity's extra '{EXTRA}')") from None
    return mx


def check_shapes(location: str, name: str, packed, scales, params: AffineParams, dims: set[int] | Callable) -> None:
    """The packed weight and scales have the shapes the stated parameters call for, else a QuantizedLayoutError
    naming what they fit: the scales transposed, another bit width at the stated group size, another group size at
    the stated width.  The input width each reading implies is held to the widths the module may have, ``dims`` (or a
    callable giving them, asked only for a misfit): its own in_features where transformers' model knows the module,
    else every size the config states (a set of all sizes alone misnames one where two sizes coincide, e.g.
    intermediate_size == vocab_size)."""
    columns = packed.shape[-1] * WORD // params.bits
    expected = (*packed.shape[:-1], columns // params.group_size)
    if columns % params.group_size == 0 and tuple(scales.shape) == expected:
        return
    said = (f"{location}: {name} is uint32 {list(packed.shape)} with {name.removesuffix('weight')}scales "
            f"{list(scales.shape)}; the stated {params.describe()} calls for scales {list(expected)}")
    if scales.dim() >= 2 and tuple(scales.shape[-2:]) == (expected[-1], expected[-2]):
        raise QuantizedLayoutError(f"{said}: they are that grid transposed", "mlx_scales_transposed")
    groups = scales.shape[-1]
    at_group = groups * params.group_size  # the input width if the group size is right: the bits are not
    bits = packed.shape[-1] * WORD // at_group if at_group else 0
    at_bits = columns  # the input width if the bits are right: the group size is not
    group = at_bits // groups if groups else 0
    bits_fit = bits in BITS and packed.shape[-1] * WORD == bits * at_group
    group_fit = group > 0 and group * groups == at_bits
    dims = dims() if callable(dims) else dims
    if bits_fit and (not group_fit or (at_group in dims and at_bits not in dims)):
        raise QuantizedLayoutError(f"{said}: they fit {bits}-bit codes in the stated groups of {params.group_size} "
                                   f"({at_group} input values), not {params.bits}-bit", "mlx_bits_mismatched")
    if group_fit:
        raise QuantizedLayoutError(f"{said}: they fit groups of {group} at the stated {params.bits} bits ({at_bits} "
                                   f"input values), not {params.group_size}", "mlx_group_size_wrong")
    raise CheckpointError(f"{said}; they fit no group size and bit width MLX writes")


def unpack(mx, packed, params: AffineParams):
    """The codes of a packed uint32 weight, as float32 integers: mlx's own dequantize with unit scales and zero
    biases (MLX's packing of 3-, 5- and 6-bit codes spans words: it is not re-implemented here)."""
    import numpy as np
    import torch

    words = mx.array(packed.contiguous().view(torch.int32).numpy().view(np.uint32))
    ones = mx.ones((*packed.shape[:-1], packed.shape[-1] * WORD // params.bits // params.group_size), dtype=mx.float32)
    codes = mx.dequantize(words, ones, ones * 0, group_size=params.group_size, bits=params.bits)
    return torch.from_numpy(np.array(codes.astype(mx.float32)))


def dequantize(mx, packed, scales, biases, params: AffineParams):
    """mlx.core.dequantize of one packed weight (float32 scales and biases of the stored values) -> float32."""
    import numpy as np
    import torch

    words = mx.array(packed.contiguous().view(torch.int32).numpy().view(np.uint32))
    out = mx.dequantize(words, mx.array(scales.float().numpy()), mx.array(biases.float().numpy()),
                        group_size=params.group_size, bits=params.bits)
    return torch.from_numpy(np.array(out.astype(mx.float32)))


class MLXCheckpoint(Checkpoint):
    """An HF folder of MLX affine-quantized weights: ``read`` returns each quantized matrix dequantized (float32) by
    mlx; X.scales and X.biases are kept apart from ``weight_map`` (part of their weight's storage)."""

    scheme: MLXScheme
    companions: dict[str, str]
    as_stored: dict[str, str]
    dims: set[int]

    def held(self, name: str):
        """(packed weight, scales, biases, params) of a quantized ``name`` as read from the file, else None."""
        prefix = name.removesuffix("weight")
        if not name.endswith(".weight") or prefix + "scales" not in self.companions or not self.has(name):
            return None
        packed = self.reader(self.weight_map[name], [name])[name]
        parts = [prefix + "scales", prefix + "biases"]
        if parts[1] not in self.companions:
            raise CheckpointError(f"{self.location}: {parts[0]} has no {parts[1]} beside it; MLX's affine "
                                  "quantization stores both (scale x code + bias per group)")
        read = {n: self.reader(self.companions[n], [n])[n] for n in parts}
        params = self.scheme.params_for(name)
        if params is None:
            raise CheckpointError(f"{self.location}: config.json's quantization leaves {name.removesuffix('.weight')} "
                                  f"unquantized (false), yet {parts[0]} is stored beside it")
        check_shapes(self.location, name, packed, read[parts[0]], params, lambda: self.widths_of(name))
        return packed, read[parts[0]], read[parts[1]], params

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

    def affine_quantized(self, name: str, *, expert: int | None = None) -> AffineQuantized | None:
        """How tensor ``name`` is stored, when it is MLX-quantized: its codes, scales, biases and parameters;
        ``expert``: that expert's slice of a stacked [E, out, in] tensor alone (only its codes are unpacked)."""
        held = self.held(name)
        if held is None:
            return None
        packed, scales, biases, params = held
        if expert is not None and packed.dim() == 3:
            packed, scales, biases = packed[expert], scales[expert], biases[expert]
        codes = unpack(require_mlx(self.location), packed, params)
        return AffineQuantized(codes, scales.float(), biases.float(), params,
                               str(scales.dtype).removeprefix("torch."))

    def describe(self, names: list[str]) -> dict[str, tuple[list[int], str]] | None:
        """Shape and dtype of these tensors from the local safetensors headers, a quantized one as the matrix it
        holds ([..., out, in], its scales' dtype: the model's) rather than its packed uint32 words, so that the
        inventory outside the FFN does not report every quantized tensor as reshaped; None for a hub checkpoint."""
        if self.repo_id is not None or self.weights != "real":
            return None
        from parity.sources.safetensors_files import describe_local

        scales = {n: n.removesuffix("weight") + "scales" for n in names if n.endswith(".weight")}
        scales = {n: s for n, s in scales.items() if s in self.companions}
        wanted = {**{n: self.weight_map[n] for n in names}, **{s: self.companions[s] for s in scales.values()}}
        found: dict[str, tuple[list[int], str]] = {}
        try:
            for file_name in sorted(set(wanted.values())):
                found.update(describe_local(self.fetch(file_name), [n for n, f in wanted.items() if f == file_name]))
        except CheckpointError:  # an unreadable header: the inventory says it cannot tell, the read says why
            return None
        for name, scale in scales.items():
            params = self.scheme.params_for(name)
            shape, _ = found[name]
            if params is not None:
                found[name] = ([*shape[:-1], shape[-1] * WORD // params.bits], found[scale][1])
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
                out[name] = dequantize(require_mlx(self.location), *held)
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
    quantized = sum(1 for n in companions if n.endswith(".scales") and n[:-len("scales")] + "weight" in weights)
    wrapped = dequantized_on_read(checkpoint, MLXCheckpoint, scheme, weights, companions, matrices=quantized,
                                  dequantized_with="mlx.core.dequantize", stated_in="quantization")
    wrapped.dims = config_dims(checkpoint.raw_config)
    return wrapped
