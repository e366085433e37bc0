"""Integer group-quantized safetensors: compressed-tensors' ``pack-quantized`` (what llm-compressor's GPTQ and AWQ
write) and ``int-quantized`` (its W8A8 schemes: one int8 code per value, unpacked), GPTQ (AutoGPTQ / GPTQModel:
``quant_method "gptq"``) and AWQ (AutoAWQ's GEMM layout: ``quant_method "awq"``).
Each quantized matrix is stored as integer codes packed into int32 beside a scale (and a zero point) per group of
``group_size`` input values; the true weight is ``scale x (code - zero)`` of the code's group (for act-order GPTQ,
the group ``g_idx`` names for each input column).  Modules left unquantized (``modules_to_not_convert``, compressed-
tensors' ``ignore``) have no codes and are read as stored.

The wrapper presents each quantized module as its ``X.weight`` (float32, [out, in] as ``nn.Linear`` holds it),
dequantized on read, one tensor at a time; ``grouped`` returns its codes, scales and zeros for a compare to judge it
against its own grid (``parity.engine.compare.group_grid``).

Who unpacks what, and why:

* ``pack-quantized`` is unpacked and dequantized by compressed-tensors itself (``PackedQuantizationCompressor.
  decompress``: the extra ``quant``); ``int-quantized`` (and ``naive-quantized`` of integer weights) by its
  ``NaiveQuantizationCompressor.decompress``, its codes ``X.weight`` as stored.  compressed-tensors 0.20 no longer
  applies a ``weight_g_idx`` (its act-order "group" mode was removed); a file that holds one is dequantized here with
  each column's scale taken from the group it names, as the releases that wrote it did.
* GPTQ and AWQ are unpacked by the small code below.  The ecosystem's libraries do not install here without
  replacing the project's torch: gptqmodel 7.7.0 requires torch 2.14.1, which pip installs in place of the
  project's 2.13 (in a scratch venv: the CUDA 13 build), and autoawq 0.2.9 (the last release; the project is
  archived) failed in pip's resolver after 32 s in a scratch venv sharing the system's packages.  transformers 5's
  GPTQ and AWQ integrations load through gptqmodel.  The layouts are pinned to those libraries' own code, cited at
  each function, and gptqmodel 7.7.0's own GPTQ (2, 3, 4 and 8 bits) and AWQ GEMM exports, quantized on CPU in that
  venv, read here as it reads them (docs/compare.md, "Checked on the tools' own files").
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
from parity.sources.checkpoint import Checkpoint, check_converted, dequantized_on_read
from parity.sources.compressed_config import check_plain, module_scheme, parsed_config, targets_of, weight_schemes
from parity.sources.config_check import stated_modules

COMPRESSED = "compressed-tensors"
PACKED = "pack-quantized"
# compressed-tensors' unpacked integer codes: llm-compressor's W8A8 schemes write "int-quantized"; "naive-quantized" is
# its fallback compressor's name for the same layout (compressed_tensors.config.CompressionFormat)
STORED, NAIVE = "int-quantized", "naive-quantized"
MIXED = "mixed-precision"  # compressed-tensors' format of a config whose groups each state their own
EXTRA = "quant"  # pyproject.toml's extra that installs compressed-tensors
# AutoAWQ's GEMM packing (awq/modules/linear/gemm.py, WQLinear_GEMM.from_linear): nibble i of each int32 holds output
# column 8 x col + AWQ_ORDER[i]
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
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


def per_block(bits: int) -> tuple[int, int]:
    """(int32 words, codes) of the smallest run of whole words that holds whole codes: one word of 32 / bits codes
    for 2, 4 and 8 bits; three words of 32 codes for 3 bits."""
    words = bits // math.gcd(bits, 32)
    return words, 32 * words // bits


def packed_count(words: int, bits: int) -> int | None:
    """How many codes ``words`` int32 words hold at ``bits`` each; None where they are not whole runs of words
    (``per_block``): another width than the stated one."""
    run, codes = per_block(bits)
    return None if words % run else words // run * codes


def holds(words: int, count: int, bits: int) -> bool:
    """Whether ``words`` int32 words are what ``count`` codes of ``bits`` take: whole runs (``per_block``), or
    ceil(count x bits / 32) words with the last partly filled, as GPTQModel 7.7.0 allocates a dimension that is not
    a multiple of 32 / bits (``_register_gptq_buffers``, ``pack_original``: stories260K's d_ff 172 in 22 words at 4
    bits; its ``dequantize_weight`` drops the tail codes past the scales' outputs and g_idx's inputs)."""
    run, per_run = per_block(bits)
    return words in (-(-count * bits // 32), -(-count // per_run) * run)


def unpack_stream(words, bits: int, count: int | None = None):
    """Codes packed as one little-endian bit stream along the first axis of ``words`` ([words, ...] int32 or int64),
    each run of ``per_block(bits)`` words holding its codes low bits first; a code may straddle two words (GPTQ's
    3 bits: codes 10 and 21 of each 32).  ``count``: the codes meant, where the last run is cut short (``holds``).
    Returns [codes, ...]."""
    import torch

    run, per_run = per_block(bits)
    words = words.to(torch.int64) & 0xFFFFFFFF
    if words.shape[0] % run:  # a last run cut short: its missing words hold nothing
        words = torch.cat([words, words.new_zeros(run - words.shape[0] % run, *words.shape[1:])])
    blocks = words.reshape(-1, run, *words.shape[1:])
    codes = []
    for k in range(per_run):
        word, offset = divmod(k * bits, 32)
        value = blocks[:, word] >> offset
        if offset + bits > 32:  # the code's high bits open the next word
            value = value | (blocks[:, word + 1] << (32 - offset))
        codes.append(value & ((1 << bits) - 1))
    return torch.stack(codes, 1).reshape(-1, *words.shape[1:])[:count]


def unpack_rows(packed, bits: int, count: int | None = None):
    """int32 words packed along their first axis, low bits first (GPTQModel's ``PackableQuantLinear.pack``:
    ``qweight[row] |= code << (bits x j)`` for the j-th input of the row's 32 / bits; at 3 bits, 32 inputs in three
    words as one bit stream, GPTQModel 7.7.0's ``dequantize_weight``): [rows x 32 / bits, columns] of codes in
    [0, 2^bits)."""
    return unpack_stream(packed, bits, count)


def unpack_columns(packed, bits: int, *, order=None, count: int | None = None):
    """int32 words packed along their last axis, low bits first (at 3 bits as one bit stream, as ``unpack_rows``):
    [rows, columns x 32 / bits].  ``order``: the column each field holds within its word (AWQ_ORDER), None for the
    linear order GPTQ's qzeros use."""
    fields = unpack_stream(packed.t(), bits).t()
    if order is not None:  # field i of each word holds column order[i]: put each back in its column
        per_word = len(order)
        fields = fields.reshape(packed.shape[0], -1, per_word)
        placed = fields.clone()
        placed[..., list(order)] = fields
        fields = placed.reshape(packed.shape[0], -1)
    return fields[:, :count]


def layout_error(where: str, name: str, said: str, mistake: str) -> QuantizedLayoutError:
    return QuantizedLayoutError(f"{where}: {name}: {said}", mistake)


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


def check_stray_zeros(where: str, name: str, scheme: IntScheme, parts: dict) -> None:
    """A symmetric compressed-tensors scheme stores no zero points; its ``decompress`` subtracts one it finds in the
    file as stored (packed words and all), where vLLM's symmetric kernels have no place for it: read two ways, or a
    crash in the library (packed words of another shape than the scales).  Nonzero or of another shape than
    ``weight_scale``: a QuantizedLayoutError naming it.  Zero ones of the scales' shape change no reader's values."""
    zero_point = parts.get("weight_zero_point")
    if not scheme.sym or scheme.method not in (PACKED, STORED) or zero_point is None:
        return
    scale = parts.get("weight_scale")
    if scale is not None and zero_point.shape == scale.shape and not bool(zero_point.any()):
        return
    raise layout_error(where, name, f"it stores a weight_zero_point {list(zero_point.shape)} (nonzero, or not of "
                       f"weight_scale's shape) beside the stated {scheme.describe()}, which has none: "
                       "compressed-tensors' decompress subtracts it as stored, vLLM's symmetric kernels ignore it; "
                       "state the scheme asymmetric (symmetric: false) or drop the tensor", "zero_point_off_by_one")


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


def check_zero_groups(where: str, name: str, qzeros, scales) -> None:
    """GPTQ's and AWQ's qzeros hold one row of packed zero points per group, as the scales hold one of scales."""
    if qzeros.shape[0] != scales.shape[0]:
        raise layout_error(where, name, f"its qzeros hold {qzeros.shape[0]} groups of zero points and its scales "
                           f"{scales.shape[0]} groups", "group_size_wrong")


def bits_error(where: str, name: str, scheme: IntScheme, packed: int, values: int, what: str) -> QuantizedLayoutError:
    """``packed`` int32 words hold ``values`` codes: the bits they imply against the stated ones."""
    implied = packed * 32 / values if values else float("nan")
    return layout_error(where, name, f"{packed} packed int32 words hold {values} {what}: {implied:g} bits each, "
                        f"where config.json's quantization_config states {scheme.bits}", "group_bits_mismatched")


def read_gptq(where: str, name: str, scheme: IntScheme, parts: dict) -> GroupQuantized:
    """GPTQ's layout (GPTQModel's ``PackableQuantLinear.pack`` and ``dequantize_weight``, AutoGPTQ's
    ``QuantLinear``): ``qweight`` [in x bits / 32, out] packed along the inputs, ``qzeros`` [groups, out x bits / 32]
    packed along the outputs, ``scales`` [groups, out], ``g_idx`` [in] (each input's group); checkpoint_format
    "gptq" (v1) stores each zero point minus one and its readers add one (GPTQModel's
    ``convert_gptq_v1_to_v2_format_module``)."""
    import torch

    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    g_idx = parts.get("g_idx")
    outputs = qweight.shape[1]
    # the inputs are g_idx's length: GPTQModel pads a dimension that is not a multiple of 32 / bits (``holds``)
    inputs = packed_count(qweight.shape[0], scheme.bits) if g_idx is None else g_idx.numel()
    if g_idx is not None and not holds(qweight.shape[0], inputs, scheme.bits):
        raise bits_error(where, name, scheme, qweight.shape[0], inputs, "input rows (g_idx's length)")
    if inputs is None:
        raise layout_error(where, name, f"its qweight's {qweight.shape[0]} packed rows are not whole runs of "
                           f"{per_block(scheme.bits)[0]} int32 words, as config.json's bits {scheme.bits} packs them",
                           "group_bits_mismatched")
    if not holds(qzeros.shape[-1], outputs, scheme.bits):
        raise bits_error(where, name, scheme, qzeros.shape[-1], outputs, "zero points per group (the outputs)")
    check_groups(where, name, scheme, inputs, outputs, scales)
    check_zero_groups(where, name, qzeros, scales)
    codes = unpack_rows(qweight, scheme.bits, inputs).t()
    zeros = unpack_columns(qzeros, scheme.bits, count=outputs).float() + (1.0 if scheme.v1 else 0.0)
    sequential = torch.arange(inputs) // (scheme.group_size or inputs)
    g_idx = sequential if g_idx is None else g_idx.to(torch.int64)
    if int(g_idx.min()) < 0 or int(g_idx.max()) >= scales.shape[0]:
        raise layout_error(where, name, f"g_idx names groups {int(g_idx.min())} to {int(g_idx.max())}; its scales "
                           f"hold {scales.shape[0]}", "group_size_wrong")
    return GroupQuantized(codes, scales.float().t().contiguous(), zeros.t().contiguous(), g_idx, 0,
                          (1 << scheme.bits) - 1, "gptq", scheme.bits)


def read_awq(where: str, name: str, scheme: IntScheme, parts: dict) -> GroupQuantized:
    """AutoAWQ's GEMM layout (``WQLinear_GEMM.from_linear``; read back by ``awq.utils.packing_utils``'s
    ``unpack_awq`` and ``reverse_awq_order``): ``qweight`` [in, out x bits / 32] and ``qzeros`` [groups, out x bits
    / 32], both packed along the outputs in AWQ_ORDER, ``scales`` [groups, out]; the zero points as they are."""
    import torch

    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    inputs, outputs = qweight.shape[0], qweight.shape[1] * 32 // scheme.bits
    if outputs not in scales.shape:  # the packed words hold another count of outputs than the scales: other bits
        raise bits_error(where, name, scheme, qweight.shape[1], scales.shape[-1],
                         "outputs per input row (scales' columns)")
    check_groups(where, name, scheme, inputs, outputs, scales)
    if qzeros.shape[-1] * 32 // scheme.bits != outputs:
        raise bits_error(where, name, scheme, qzeros.shape[-1], outputs, "zero points per group (the outputs)")
    check_zero_groups(where, name, qzeros, scales)
    order = AWQ_ORDER if scheme.bits == 4 else None
    codes = unpack_columns(qweight, scheme.bits, order=order).t()
    zeros = unpack_columns(qzeros, scheme.bits, order=order).float()
    g_idx = torch.arange(inputs) // (scheme.group_size or inputs)
    return GroupQuantized(codes, scales.float().t().contiguous(), zeros.t().contiguous(), g_idx, 0,
                          (1 << scheme.bits) - 1, "awq", scheme.bits)


def read_packed(where: str, name: str, scheme: IntScheme, parts: dict) -> tuple[GroupQuantized, object]:
    """compressed-tensors' pack-quantized layout, unpacked by compressed-tensors (``unpack_from_int32``) for the grid
    and dequantized by its ``PackedQuantizationCompressor.decompress`` (``weight_packed`` [out, in x bits / 32]
    packed densely along the inputs, ``weight_scale`` [out, groups], ``weight_zero_point`` packed along the outputs,
    ``weight_shape``); a ``weight_g_idx`` (which compressed-tensors 0.20 no longer applies) picks each column's group
    here.  Returns the grid and the dequantized weight (float32)."""
    import torch

    library = require_library(where)
    packed, scales = parts["weight_packed"], parts["weight_scale"]
    outputs, inputs = (int(v) for v in parts["weight_shape"].tolist())
    if packed.shape[0] != outputs or outputs <= 0 or inputs <= 0:
        raise CheckpointError(f"{where}: {name}'s weight_packed holds {packed.shape[0]} rows where its weight_shape "
                              f"states [{outputs}, {inputs}]; pack-quantized stores one row of words per output")
    if packed.shape[-1] != -(-inputs * scheme.bits // 32):
        raise bits_error(where, name, scheme, packed.shape[-1], inputs, "inputs per row (weight_shape)")
    check_groups(where, name, scheme, inputs, outputs, scales)
    codes = library.unpack(packed, scheme.bits, torch.Size([outputs, inputs])).to(torch.int64)
    zeros = torch.zeros(scales.shape, dtype=torch.float32)
    if "weight_zero_point" in parts and not scheme.library.weights.symmetric:
        zero_point = parts["weight_zero_point"]
        words = [-(-scales.shape[0] * scheme.bits // 32), scales.shape[1]]  # packed along the outputs
        if list(zero_point.shape) != words:
            raise layout_error(where, name, f"its weight_zero_point is {list(zero_point.shape)} beside weight_scale "
                               f"{list(scales.shape)}; {scheme.bits}-bit zero points packed along the outputs fill "
                               f"{words}", "group_size_wrong")
        zeros = library.unpack(zero_point, scheme.bits, torch.Size(scales.shape), packed_dim=0).float()
    g_idx = parts.get("weight_g_idx")
    sequential = torch.arange(inputs) // (scheme.group_size or inputs)
    grid = GroupQuantized(codes, scales.float(), zeros, sequential if g_idx is None else g_idx.to(torch.int64),
                          -(1 << (scheme.bits - 1)), (1 << (scheme.bits - 1)) - 1, PACKED, scheme.bits)
    if g_idx is not None:
        return grid, grid.values()
    state = {key: value for key, value in parts.items() if key != "weight_g_idx"}
    weight = library.compressor.decompress(state, scheme.library)["weight"]
    return grid, weight.float()


def narrowest_bits(low: int, high: int) -> int:
    """The fewest bits whose signed codes span ``low`` to ``high``."""
    bits = 1
    while low < -(1 << (bits - 1)) or high > (1 << (bits - 1)) - 1:
        bits += 1
    return bits


def read_stored(where: str, name: str, scheme: IntScheme, parts: dict) -> tuple[GroupQuantized, object]:
    """compressed-tensors' int-quantized layout: ``weight`` the codes as stored (int8 [out, in]), ``weight_scale``
    [out, groups] ([out, 1] per channel, one value per tensor), ``weight_zero_point`` beside it when asymmetric;
    dequantized by its ``NaiveQuantizationCompressor.decompress``.  Returns the grid and the weight (float32)."""
    import torch

    library = require_library(where)
    codes, scales = parts["weight"], parts["weight_scale"]
    if codes.dim() != 2 or codes.dtype.is_floating_point or codes.dtype.itemsize != 1:
        raise layout_error(where, name, f"it is {str(codes.dtype).removeprefix('torch.')} {list(codes.shape)} beside "
                           f"its weight_scale; the stated {scheme.describe()} stores one int8 code per value of a "
                           "matrix", "group_bits_mismatched")
    outputs, inputs = codes.shape
    whole = scales.numel() == 1 and scheme.library.weights.strategy == "tensor"
    if whole:
        scales = scales.reshape(1, 1).expand(outputs, 1)
    check_groups(where, name, scheme, inputs, outputs, scales)
    low, high = -(1 << (scheme.bits - 1)), (1 << (scheme.bits - 1)) - 1
    if int(codes.min()) < low or int(codes.max()) > high:
        raise layout_error(where, name, f"its codes span {int(codes.min())} to {int(codes.max())}; "
                           f"{scheme.bits}-bit codes lie in {low} to {high}", "group_bits_mismatched")
    narrow = narrowest_bits(int(codes.min()), int(codes.max()))
    # min-max scales put every group's extreme value on the stated width's end code: a faithful export reaches it
    if narrow < scheme.bits and bool(codes.any()):
        raise layout_error(where, name, f"its codes span {int(codes.min())} to {int(codes.max())}, those of "
                           f"{narrow}-bit codes, where the stated {scheme.bits}-bit scales put each group's largest "
                           f"value at {-low} or {high}", "group_bits_mismatched")
    zeros = torch.zeros(scales.shape, dtype=torch.float32)
    if "weight_zero_point" in parts and not scheme.sym:
        zero_point = parts["weight_zero_point"]
        if zero_point.shape != parts["weight_scale"].shape:
            raise layout_error(where, name, f"its weight_zero_point is {list(zero_point.shape)} beside weight_scale "
                               f"{list(parts['weight_scale'].shape)}; the stated {scheme.describe()} stores one zero "
                               "point per scale", "group_size_wrong")
        zeros = zero_point.reshape(-1, 1).expand(scales.shape).float() if whole else zero_point.float()
    sequential = torch.arange(inputs) // (scheme.group_size or inputs)
    grid = GroupQuantized(codes.to(torch.int64), scales.float().contiguous(), zeros, sequential, low, high, STORED,
                          scheme.bits, whole)
    state = {key: parts[key] for key in PARTS[STORED] if key in parts}
    weight = library.naive.decompress(state, scheme.library)["weight"]
    return grid, weight.float()


READERS = {"gptq": read_gptq, "awq": read_awq}


class IntGroupCheckpoint(Checkpoint):
    """An HF folder of integer group-quantized weights: each quantized module X appears as ``X.weight`` (float32,
    dequantized on read); its packed tensors are kept apart from ``weight_map``."""

    scheme: IntScheme
    modules: dict[str, str]  # X.weight -> X (the module prefix of its packed tensors)
    companions: dict[str, str]  # packed tensor name -> file
    as_stored: dict[str, str]

    def grouped(self, name: str) -> GroupQuantized | None:
        """How tensor ``name`` is stored, when it is quantized here: its codes, scales, zeros and groups."""
        if name not in self.modules:
            return None
        return self.unpack(name)[0]

    def unpack(self, name: str) -> tuple[GroupQuantized, object]:
        """The module's grid and its dequantized weight (float32)."""
        prefix = self.modules[name]
        scheme = self.scheme.for_module(self.location, prefix)
        names = [f"{prefix}.{part}" for part in PARTS[scheme.method] if f"{prefix}.{part}" in self.companions]
        files: dict[str, list[str]] = {}
        for member in names:
            files.setdefault(self.companions[member], []).append(member)
        parts = {}
        for file_name, members in files.items():
            parts.update({key[len(prefix) + 1:]: value for key, value in self.reader(file_name, members).items()})
        check_parts(self.location, prefix, scheme, parts)
        check_stray_zeros(self.location, name, scheme, parts)
        if scheme.method == PACKED:
            return read_packed(self.location, name, scheme, parts)
        if scheme.method == STORED:
            return read_stored(self.location, name, scheme, parts)
        grid = READERS[scheme.method](self.location, name, scheme, parts)
        return grid, grid.values()

    def describe(self, names: list[str]) -> dict[str, tuple[list[int], str]] | None:
        """Shape and stored type without dequantizing (an inventory's headers): a quantized module as its [out, in]
        and ``INT<bits>``, from its packed tensors' headers; the rest from their own.  None where no quantized
        module is asked for, or the headers cannot be read locally (the caller then reads them as usual)."""
        from parity.sources.safetensors_files import describe_local

        if self.repo_id is not None or self.weights != "real" or not any(n in self.modules for n in names):
            return None
        out: dict[str, tuple[list[int], str]] = {}
        for file_name in sorted({self.weight_map[n] for n in names}):
            members = [n for n in names if self.weight_map[n] == file_name]
            codes = {n: f"{self.modules[n]}.{CODES_PART[self.scheme.method]}" for n in members if n in self.modules}
            plain = [n for n in members if n not in codes]
            described = describe_local(self.fetch(file_name), plain + list(codes.values()))
            out.update({n: described[n] for n in plain})
            out.update({n: (self.logical_shape(n, described[part][0]), f"INT{self.bits_of(n)}")
                        for n, part in codes.items()})
        return out

    def bits_of(self, name: str) -> int:
        """The stated bits of quantized ``name``, for the inventory: the config's first scheme's where its own scheme
        is in question (the layer holding it reports that)."""
        try:
            return self.scheme.for_module(self.location, self.modules[name]).bits
        except QuantizedLayoutError:
            return self.scheme.bits

    def logical_shape(self, name: str, packed: list[int]) -> list[int]:
        """A quantized module's [out, in] from its packed codes' shape (pack-quantized: its weight_shape)."""
        bits = self.bits_of(name)
        if self.scheme.method == "gptq":
            return [packed[1], packed[0] * 32 // bits]
        if self.scheme.method == "awq":
            return [packed[1] * 32 // bits, packed[0]]
        if self.scheme.method == STORED:
            return list(packed)
        shape_name = f"{self.modules[name]}.weight_shape"
        if shape_name not in self.companions:
            return list(packed)
        return [int(v) for v in self.reader(self.companions[shape_name], [shape_name])[shape_name].tolist()]

    def stored_dtype(self, name: str) -> str | None:
        """The dtype tensor ``name`` had in its file when last read (see FP8Checkpoint.stored_dtype)."""
        return self.as_stored.get(name)

    def read(self, names: list[str]):
        self.require(names)
        out = super().read([n for n in names if n not in self.modules])
        if self.scheme.method in (PACKED, STORED):  # a linear its config quantizes, stored plain: the layer's finding
            for name, value in out.items():
                check_plain([t for t, _ in self.scheme.targets], self.scheme.not_converted, name, value,
                            self.location)
        self.as_stored = {n: str(t.dtype).removeprefix("torch.") for n, t in out.items()}
        for name in names:
            if name in self.modules:
                grid, out[name] = self.unpack(name)
                self.as_stored[name] = f"int{grid.bits}"
        return out


def wrap(checkpoint: Checkpoint, folder: Path | str) -> Checkpoint | None:
    """``checkpoint`` as an IntGroupCheckpoint when its config states integer group quantization, else None."""
    scheme = scheme_of(checkpoint.raw_config, shown(folder))
    if scheme is None:
        return None
    codes = CODES_PART[scheme.method]
    parts = {n: f for n, f in checkpoint.weight_map.items() if n.rsplit(".", 1)[-1] in PARTS[scheme.method]}
    if scheme.method == STORED:  # the codes keep the weight's own name: a weight is quantized where it has a scale
        scaled = {n.rsplit(".", 1)[0] for n in parts if n.endswith(".weight_scale")}
        parts = {n: f for n, f in parts.items() if n.rsplit(".", 1)[0] in scaled}
        parts.update({n: f for n, f in checkpoint.weight_map.items() if n.rsplit(".", 1)[-1] in ACTIVATION_PARTS})
    modules = {n.rsplit(".", 1)[0] + ".weight": n.rsplit(".", 1)[0] for n in parts if n.endswith("." + codes)}
    weights = {n: f for n, f in checkpoint.weight_map.items() if n not in parts}
    weights.update({name: parts[prefix + "." + codes] for name, prefix in modules.items()})
    reader = "compressed-tensors" if scheme.method in (PACKED, STORED) else "parity's unpacker (GPTQ/AWQ layouts)"
    wrapped = dequantized_on_read(checkpoint, IntGroupCheckpoint, scheme, weights, parts, matrices=len(modules),
                                  dequantized_with=reader)
    wrapped.modules = modules
    return wrapped
