"""What an integer group-quantized checkpoint states and stores: config.json's scheme (GPTQ, AWQ, compressed-tensors'
pack-quantized and int-quantized, read by compressed-tensors itself; GPTQModel's ``dynamic`` rules), the tensors
each method stores for one module (``STORAGE``), the unpacked grid every reader returns (``GroupQuantized``) and the
layout checks all of them share (each part present and of its format's shape; the scale grid of the stated group
size).  The readers are ``gptq_awq`` and ``compressed_int``; the checkpoint wrapper is ``int_groups``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace

from parity.definitions.distribution import install_command
from parity.errors import CheckpointError, QuantizedLayoutError
from parity.sources.checkpoint import check_converted
from parity.sources.compressed_config import module_scheme, parsed_config, targets_of, weight_schemes
from parity.sources.config_check import stated_modules

COMPRESSED = "compressed-tensors"
PACKED = "pack-quantized"
# compressed-tensors' unpacked integer codes: llm-compressor's W8A8 schemes write "int-quantized"; "naive-quantized" is
# its fallback compressor's name for the same layout (compressed_tensors.config.CompressionFormat)
STORED, NAIVE = "int-quantized", "naive-quantized"
MIXED = "mixed-precision"  # compressed-tensors' format of a config whose groups each state their own
EXTRA = "quant"  # pyproject.toml's extra that installs compressed-tensors
# the tensors each method stores for one quantized module X (beside which X.weight does not exist), and how each is
# stored, as each format's own writer stores it (GPTQModel's PackableQuantLinear.pack, AutoAWQ's
# WQLinear_GEMM.from_linear, compressed-tensors' PackedQuantizationCompressor and NaiveQuantizationCompressor): the
# dimensions it may have, and its dtype ("int32": packed words; "int": any integer dtype; "float")
STORAGE = {"gptq": {"qweight": ((2,), "int32"), "qzeros": ((2,), "int32"), "scales": ((2,), "float"),
                    "g_idx": ((1,), "int")},
           "awq": {"qweight": ((2,), "int32"), "qzeros": ((2,), "int32"), "scales": ((2,), "float")},
           PACKED: {"weight_packed": ((2,), "int32"), "weight_scale": ((2,), "float"),
                    "weight_zero_point": ((2,), "int32"), "weight_shape": ((1,), "int"), "weight_g_idx": ((1,), "int")},
           STORED: {"weight": ((2,), "int"), "weight_scale": ((0, 1, 2), "float"),
                    "weight_zero_point": ((0, 1, 2), "int")}}
PARTS = {method: tuple(parts) for method, parts in STORAGE.items()}
CODES_PART = {"gptq": "qweight", "awq": "qweight", PACKED: "weight_packed", STORED: "weight"}
# what W8A8's static activation quantization stores beside a weight: a runtime input scale, no part of the weights
ACTIVATION_PARTS = ("input_scale", "input_zero_point")


@dataclass(frozen=True)
class IntScheme:
    """What config.json's quantization_config states: the method (its packing), bits per code, values per group
    (0: one group per row), whether the zero point is the middle code (sym), GPTQ's v1 checkpoint format (zero
    points stored minus one) and what is left unquantized."""

    method: str  # "gptq" | "awq" | "pack-quantized" | "int-quantized"
    bits: int
    group_size: int
    sym: bool = True
    v1: bool = True
    not_converted: tuple[str, ...] = ()
    library: object | None = None  # compressed-tensors' QuantizationScheme, for pack-quantized
    # compressed-tensors' config groups: each target -> its scheme, in the config's order (a module none targets, or
    # one the ignore list names, is not quantized by compressed-tensors: ``compressed_config.module_scheme``)
    targets: tuple[tuple[str, IntScheme], ...] = ()
    # GPTQModel's ``dynamic`` rules: each pattern -> the scheme of the modules it matches, None for "-:" (left
    # unquantized), in the config's order
    dynamic: tuple[tuple[str, IntScheme | None], ...] = ()

    def for_module(self, where: str, module: str) -> IntScheme:
        """The scheme of quantized module ``module``: this one, or, where the config's groups state several, the one
        compressed-tensors gives it (``compressed_config.module_scheme``), or the first of GPTQModel's ``dynamic``
        rules whose pattern matches its name (``re.match``, as GPTQModel and vLLM's ``get_dynamic_override`` apply
        them); a module no group targets, or one a "-:" rule leaves unquantized, is a CheckpointError naming it."""
        if self.dynamic:
            return dynamic_scheme(self, where, module)
        if self.method == "awq":  # transformers' AWQ integration skips modules_to_not_convert
            check_converted(module, self.not_converted, where)
        if self.method not in (PACKED, STORED):
            return self
        return module_scheme(dict(self.targets), self.not_converted, module, where)  # no targets: none quantized

    def describe(self) -> str:
        if len({scheme.describe() for _, scheme in self.targets}) > 1:
            return "; ".join(f"{target}: {scheme.describe()}" for target, scheme in self.targets)
        if self.targets:
            return self.targets[0][1].describe()
        if self.dynamic:
            rules = "; ".join(f"{pattern!r}: {'left unquantized' if scheme is None else scheme.describe()}"
                              for pattern, scheme in self.dynamic)
            return f"{dataclasses.replace(self, dynamic=()).describe()}; GPTQModel's dynamic rules: {rules}"
        strategy = getattr(self.library.weights, "strategy", None) if self.library is not None else None
        whole = str(getattr(strategy, "value", strategy)) == "tensor"
        group = (f"groups of {self.group_size}" if self.group_size else "one scale per tensor" if whole
                 else "one group per row")
        how = {"gptq": f"GPTQ ({'v1: zero points stored minus one' if self.v1 else 'v2'})",
               "awq": "AWQ GEMM (packed order 0 2 4 6 1 3 5 7)", PACKED: "compressed-tensors pack-quantized",
               STORED: "compressed-tensors int-quantized (one code per value)"}
        return f"int{self.bits} {group}, {'symmetric' if self.sym else 'asymmetric'}, {how[self.method]}"


@dataclass
class GroupQuantized:
    """One quantized matrix as its file stores it, unpacked, in ``nn.Linear``'s [out, in]: integer codes, each
    group's scale and zero point ([out, groups], in code units), the group of each input column (``g_idx``), and the
    codes' range."""

    codes: object  # torch.Tensor int64 [out, in]
    scales: object  # float32 [out, groups]
    zeros: object  # float32 [out, groups]
    g_idx: object  # int64 [in]
    low: int
    high: int
    method: str
    bits: int
    whole: bool = False  # one scale (and zero point) for the whole matrix: compressed-tensors' strategy "tensor"

    def values(self):
        """The dequantized weight (float32): scale x (code - zero) of each value's group."""
        return (self.codes.float() - self.zeros[:, self.g_idx]) * self.scales[:, self.g_idx]


def _positive_int(config: dict, key: str, where: str, allowed=None) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or (allowed is not None and value not in allowed):
        wanted = f"one of {sorted(allowed)}" if allowed is not None else "an integer"
        raise CheckpointError(f"{where}: config.json's quantization_config.{key} is {value!r}; parity reads "
                              f"{wanted} here")
    return value


def scheme_of(raw_config: dict, where: str) -> IntScheme | None:
    """The integer group scheme config.json states; None for a checkpoint of another quantization (or none).  A
    field parity cannot read is a CheckpointError naming it."""
    config = raw_config.get("quantization_config")
    if not isinstance(config, dict):
        return None
    method = config.get("quant_method")
    if method == COMPRESSED and config.get("format") in (PACKED, STORED, NAIVE, MIXED):
        return packed_scheme(config, where)
    if method not in ("gptq", "awq"):
        return None
    # transformers' GPTQConfig / AwqConfig say "bits"; AutoAWQ's own quant_config says "w_bit"
    # GPTQ's 3 bits pack 32 codes into three words (GPTQModel writes them); AWQ's GEMM packs 2, 4 or 8
    bits = _positive_int(config, "bits" if "bits" in config or method == "gptq" else "w_bit", where,
                         {2, 3, 4, 8} if method == "gptq" else {2, 4, 8})
    group = config.get("group_size", config.get("q_group_size"))
    if isinstance(group, bool) or not isinstance(group, int) or group == 0 or group < -1:
        raise CheckpointError(f"{where}: config.json's quantization_config.group_size is {group!r}; expected a "
                              "positive integer (values per group) or -1 (one group per row)")
    skipped = stated_modules(config, "modules_to_not_convert", where)
    if method == "awq":
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise CheckpointError(f"{where}: config.json's quantization_config.version is {version!r}; parity reads "
                                  "AWQ's GEMM layout ('gemm') so far")
        return IntScheme("awq", bits, max(group, 0), sym=not config.get("zero_point", True),
                         not_converted=skipped)
    form = str(config.get("checkpoint_format", "gptq"))
    if form not in ("gptq", "gptq_v2"):
        raise CheckpointError(f"{where}: config.json's quantization_config.checkpoint_format is {form!r}; parity "
                              "reads GPTQ's 'gptq' (v1) and 'gptq_v2'")
    base = IntScheme("gptq", bits, max(group, 0), sym=bool(config.get("sym", True)), v1=form == "gptq",
                     not_converted=skipped)
    return dataclasses.replace(base, dynamic=dynamic_rules(config, base, where))


DYNAMIC_FIELDS = {"bits": (int,), "group_size": (int,), "sym": (bool,), "desc_act": (bool,)}


def dynamic_rules(config: dict, base: IntScheme, where: str) -> tuple[tuple[str, IntScheme | None], ...]:
    """GPTQModel's ``dynamic`` (pattern -> the fields it overrides; a "-:" pattern skips the modules it matches),
    each pattern compiled and each override checked as the base fields are; anything else a CheckpointError naming
    the rule."""
    import re

    rules = config.get("dynamic") or {}
    if not isinstance(rules, dict):
        raise CheckpointError(f"{where}: config.json's quantization_config.dynamic is {rules!r}; GPTQModel writes an "
                              "object of pattern -> overrides")
    read = []
    for pattern, fields in rules.items():
        said = f"{where}: config.json's quantization_config.dynamic[{pattern!r}]"
        try:
            re.compile(pattern.removeprefix("-:").removeprefix("+:"))
        except re.error as exc:
            raise CheckpointError(f"{said}: not a regular expression ({exc})") from None
        if not isinstance(fields, dict):
            raise CheckpointError(f"{said} is {fields!r}; expected an object of overrides")
        if pattern.startswith("-:"):
            read.append((pattern, None))
            continue
        bad = {k: v for k, v in fields.items() if k in DYNAMIC_FIELDS and (
            type(v) not in DYNAMIC_FIELDS[k] or (k == "bits" and v not in (2, 3, 4, 8))
            or (k == "group_size" and (v == 0 or v < -1)))}
        if bad:
            raise CheckpointError(f"{said} overrides {bad}; parity reads bits 2/3/4/8, a group_size (-1: one group "
                                  "per row) and sym / desc_act booleans there")
        changes = {"bits": fields.get("bits", base.bits), "sym": fields.get("sym", base.sym),
                   "group_size": max(fields.get("group_size", base.group_size or -1), 0)}
        read.append((pattern, dataclasses.replace(base, **changes)))
    return tuple(read)


def dynamic_scheme(base: IntScheme, where: str, module: str) -> IntScheme:
    """The scheme GPTQModel's ``dynamic`` rules give quantized module ``module`` (``IntScheme.for_module``)."""
    import re

    for pattern, scheme in base.dynamic:
        if re.match(pattern.removeprefix("-:").removeprefix("+:"), module):
            if scheme is None:
                raise CheckpointError(f"{where}: {module} is stored quantized, but config.json's quantization_config."
                                      f"dynamic rule {pattern!r} leaves it unquantized")
            return scheme
    return dataclasses.replace(base, dynamic=())


def packed_scheme(config: dict, where: str) -> IntScheme | None:
    """compressed-tensors' pack-quantized or int-quantized config, read by compressed-tensors itself: integer
    weights, strategy group or channel (int-quantized: or tensor); groups stating several such schemes in one of
    the two formats (``targets``: each module's found as compressed-tensors finds it); any other is refused naming
    what it is.  None where no group is of integer weights (naive-quantized or mixed-precision floats:
    ``fp8_blocks`` and ``fp4_packed`` read or refuse those)."""
    library = require_library(where)
    parsed = parsed_config(library.QuantizationConfig, config, where)
    schemes = weight_schemes(parsed)
    kinds = {str(getattr(g.weights.type, "value", g.weights.type)) for g in schemes.values()}
    if config.get("format") in (NAIVE, MIXED) and "int" not in kinds:
        return None
    if len(kinds) > 1:
        raise CheckpointError(f"{where}: config.json's quantization_config groups state {' and '.join(sorted(kinds))} "
                              "weights; parity reads one kind of compressed-tensors weights per checkpoint so far")
    if not schemes:
        raise CheckpointError(f"{where}: config.json's quantization_config (compressed-tensors) states no weight "
                              "scheme in its config_groups")
    left = tuple(str(n) for n in parsed.ignore or [])
    read = {key: int_scheme(config.get("format"), group, left, where) for key, group in schemes.items()}
    methods = {scheme.method for scheme in read.values()}
    if len(methods) > 1:
        raise CheckpointError(f"{where}: config.json's quantization_config groups are stored in "
                              f"{' and '.join(sorted(methods))}; parity reads one compressed-tensors format per "
                              "checkpoint so far")
    first = next(iter(read.values()))
    targets = tuple((target, read[group.weights.model_dump_json()]) for target, group in targets_of(parsed).items())
    return dataclasses.replace(first, targets=targets)


def int_scheme(form: str, group, left: tuple[str, ...], where: str) -> IntScheme:
    """One config group's integer scheme, in its own format where the config is mixed-precision."""
    args = group.weights
    form = (getattr(group, "format", None) or form) if form == MIXED else form
    strategy = str(getattr(args.strategy, "value", args.strategy))
    kind = str(getattr(args.type, "value", args.type))
    strategies = ("group", "channel") if form == PACKED else ("group", "channel", "tensor")
    if (form not in (PACKED, STORED, NAIVE) or kind != "int" or strategy not in strategies
            or not 1 <= args.num_bits <= 8):
        raise CheckpointError(f"{where}: compressed-tensors format {form!r} with {args.num_bits}-bit {kind} "
                              f"weights, strategy {strategy!r}: parity reads integer weights of 1 to 8 bits "
                              f"{', '.join(strategies[:-1])} or {strategies[-1]} (by strategy) in pack-quantized "
                              "or int-quantized")
    size = args.group_size if strategy == "group" else 0
    return IntScheme(PACKED if form == PACKED else STORED, args.num_bits, size, sym=bool(args.symmetric),
                     not_converted=left, library=group)


def require_library(where: str):
    """compressed-tensors (its QuantizationConfig, the pack-quantized compressor and its unpacker), or a
    CheckpointError (exit 2) naming what to install."""
    try:
        from compressed_tensors.compressors.naive_quantized.base import NaiveQuantizationCompressor
        from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
        from compressed_tensors.quantization import QuantizationConfig
    except ImportError:
        raise CheckpointError(
            f"{where}: its weights are integer-quantized in compressed-tensors' pack-quantized or int-quantized "
            "format, which parity reads with compressed-tensors, and that is not installed: "
            f"{install_command(EXTRA, fallback='compressed-tensors')} (ffn-parity's extra '{EXTRA}')") from None
    return SimpleNamespace(QuantizationConfig=QuantizationConfig, compressor=PackedQuantizationCompressor,
                           naive=NaiveQuantizationCompressor, unpack=unpack_from_int32)


def layout_error(where: str, name: str, said: str, mistake: str) -> QuantizedLayoutError:
    return QuantizedLayoutError(f"{where}: {name}: {said}", mistake)


def bits_error(where: str, name: str, scheme: IntScheme, packed: int, values: int, what: str) -> QuantizedLayoutError:
    """``packed`` int32 words hold ``values`` codes: the bits they imply against the stated ones."""
    implied = packed * 32 / values if values else float("nan")
    return layout_error(where, name, f"{packed} packed int32 words hold {values} {what}: {implied:g} bits each, "
                        f"where config.json's quantization_config states {scheme.bits}", "group_bits_mismatched")


def required_parts(scheme: IntScheme) -> tuple[str, ...]:
    """The parts a quantized module of ``scheme`` cannot be read without (an asymmetric scheme's zero points too)."""
    zeros = () if scheme.sym else ("weight_zero_point",)
    return {"gptq": ("qweight", "qzeros", "scales"), "awq": ("qweight", "qzeros", "scales"),
            PACKED: ("weight_packed", "weight_scale", "weight_shape", *zeros),
            STORED: ("weight", "weight_scale", *zeros)}[scheme.method]


def check_parts(where: str, prefix: str, scheme: IntScheme, parts: dict) -> None:
    """Each stored part of quantized module ``prefix`` present (those ``required_parts`` names) and of the dimensions
    and dtype its format stores (``STORAGE``), else a CheckpointError naming it: the format's reader would fail on it
    in its own words, or read something else."""
    missing = [p for p in required_parts(scheme) if p not in parts]
    if missing:
        raise CheckpointError(f"{where}: {prefix} is stored quantized ({scheme.describe()}) without "
                              f"{', '.join(prefix + '.' + m for m in missing)}; its format stores "
                              f"{', '.join(required_parts(scheme))} for each quantized module")
    for part, value in parts.items():
        dims, kind = STORAGE[scheme.method][part]  # ``parts`` holds only the method's own (PARTS)
        dtype = str(value.dtype).removeprefix("torch.")
        fits = {"int32": dtype == "int32", "float": value.dtype.is_floating_point and value.dtype.itemsize > 1,
                "int": not value.dtype.is_floating_point and dtype != "bool"}[kind]
        if value.dim() not in dims or not fits or (part == "weight_shape" and value.numel() != 2):
            shape = "[out, in]" if part == "weight_shape" else f"{' or '.join(f'{d}-D' for d in dims)}"
            raise CheckpointError(f"{where}: {prefix}.{part} is {dtype} {list(value.shape)}; {scheme.describe()} "
                                  f"stores it as {kind} {shape}")


def check_groups(where: str, name: str, scheme: IntScheme, inputs: int, outputs: int, scales) -> None:
    """The scales are [groups, out] (compressed-tensors: [out, groups]) for the stated group size, else a
    QuantizedLayoutError: the grid transposed, or one of another group size."""
    groups = -(-inputs // scheme.group_size) if scheme.group_size else 1
    rows_first = scheme.method in (PACKED, STORED)
    expected = (outputs, groups) if rows_first else (groups, outputs)
    found = tuple(scales.shape)
    if found == expected:
        return
    said = (f"its scales have shape {list(found)} for a [{outputs}, {inputs}] weight; config.json's group_size "
            f"{scheme.group_size or -1} calls for {list(expected)}")
    if found == tuple(reversed(expected)):
        raise layout_error(where, name, f"{said}: they are that grid transposed", "group_scales_transposed")
    if len(found) != 2:
        raise layout_error(where, name, f"{said}: a grid of {len(found)} dimensions", "group_size_wrong")
    other = found[1] if rows_first else found[0]
    if other and outputs in found:
        size = -(-inputs // other)
        raise layout_error(where, name, f"{said}: {other} groups, those of group_size {size}, not the stated "
                           f"{scheme.group_size or -1}", "group_size_wrong")
    raise layout_error(where, name, f"{said}", "group_size_wrong")
