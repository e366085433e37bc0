"""Integer group-quantized safetensors: compressed-tensors' ``pack-quantized`` and ``int-quantized``, GPTQ
(``quant_method "gptq"``) and AWQ (AutoAWQ's GEMM layout: ``quant_method "awq"``): what config.json states (the
scheme of each module, GPTQModel's ``dynamic`` rules, what is left unquantized) and the checkpoint that reads through
``int_storage``.  Each quantized matrix is stored as integer codes (packed into int32, or one int8 per value) beside
a scale (and a zero point) per group of ``group_size`` input values; the true weight is ``scale x (code - zero)`` of
the code's group (for act-order GPTQ, the group ``g_idx`` names for each input column).  Modules left unquantized
(``modules_to_not_convert``, compressed-tensors' ``ignore``) have no codes and are read as stored.

The wrapper presents each quantized module as its ``X.weight`` (float32, [out, in] as ``nn.Linear`` holds it),
dequantized on read, one tensor at a time; ``grouped`` returns its codes, scales and zeros for a compare to judge it
against its own grid (``parity.engine.compare.group_grid``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from parity.definitions.files import shown
from parity.errors import CheckpointError, QuantizedLayoutError
from parity.sources.checkpoint import Checkpoint, check_converted, dequantized_on_read
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
from parity.sources.int_storage import (
    ACTIVATION_PARTS,
    CODES_PART,
    NAIVE,
    PACKED,
    PARTS,
    READERS,
    STORED,
    GroupQuantized,
    check_parts,
    check_stray_zeros,
    read_packed,
    read_stored,
    require_library,
)

COMPRESSED = "compressed-tensors"
ANOTHER = "another"  # a module a mixed-precision config gives to one of its FP8 groups (``IntScheme.for_module``)


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
    # a mixed-precision config's FP8 groups' targets (llm-compressor's int4 MLP beside FP8 attention): their modules
    # are read by ``fp8_blocks`` (``wrap``'s ``rest``)
    others: tuple[str, ...] = ()

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
        stated = {**dict.fromkeys(self.others, ANOTHER), **dict(self.targets)}
        found = module_scheme(stated, self.not_converted, module, where)  # no targets: none quantized
        if found == ANOTHER:
            raise QuantizedLayoutError(f"{where}: {module} is stored as integer codes, but config.json's "
                                       "quantization_config gives it an 8-bit float group: compressed-tensors would "
                                       "read its codes as FP8", "quantized_module_not_stated",
                                       kind="config: FP8")
        return found

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
    weights, strategy group or channel (int-quantized: or tensor); groups stating several such schemes, in either
    format (``targets``: each module's found as compressed-tensors finds it); any other is refused naming
    what it is.  None where no group is of integer weights (naive-quantized or mixed-precision floats:
    ``fp8_blocks`` and ``fp4_packed`` read or refuse those)."""
    library = require_library(where)
    parsed = parsed_config(library.QuantizationConfig, config, where)
    schemes = weight_schemes(parsed)
    kind = {key: str(getattr(g.weights.type, "value", g.weights.type)) for key, g in schemes.items()}
    kinds = set(kind.values())
    if config.get("format") in (NAIVE, MIXED) and "int" not in kinds:
        return None
    floats = {key for key, k in kind.items() if k == "float"}
    if floats and (config.get("format") != MIXED
                   or any(group_format(parsed, schemes[key]) in FP4_FORMATS for key in floats)):
        raise CheckpointError(f"{where}: config.json's quantization_config groups state {' and '.join(sorted(kinds))} "
                              "weights; parity reads integer groups beside 8-bit float ones in a mixed-precision "
                              "config, not beside FP4")
    others = tuple(t for t, g in targets_of(parsed).items() if g.weights.model_dump_json() in floats)
    schemes = {key: g for key, g in schemes.items() if key not in floats}
    if not schemes:
        raise CheckpointError(f"{where}: config.json's quantization_config (compressed-tensors) states no weight "
                              "scheme in its config_groups")
    left = tuple(str(n) for n in parsed.ignore or [])
    read = {key: int_scheme(group_format(parsed, group), group, left, where) for key, group in schemes.items()}
    first = next(iter(read.values()))
    targets = tuple((target, read[group.weights.model_dump_json()]) for target, group in targets_of(parsed).items()
                    if group.weights.model_dump_json() in read)
    return dataclasses.replace(first, targets=targets, others=others)


def int_scheme(form: str, group, left: tuple[str, ...], where: str) -> IntScheme:
    """One config group's integer scheme, stored in ``form`` (``compressed_config.group_format``)."""
    args = group.weights
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


class IntGroupCheckpoint(Checkpoint):
    """An HF folder of integer group-quantized weights: each quantized module X appears as ``X.weight`` (float32,
    dequantized on read); its packed tensors are kept apart from ``weight_map``."""

    scheme: IntScheme
    modules: dict[str, str]  # X.weight -> X (the module prefix of its packed tensors)
    codes: dict[str, str]  # X.weight -> the tensor holding its codes (X.qweight, X.weight_packed, X.weight itself)
    others: Checkpoint | None  # a mixed-precision config's FP8 modules (and the plain tensors), read by fp8_blocks
    companions: dict[str, str]  # packed tensor name -> file
    as_stored: dict[str, str]

    def quantized(self, name: str):
        """How an FP8 module of a mixed-precision B is stored (``fp8_blocks.FP8Checkpoint.quantized``)."""
        return self.others.quantized(name) if self.others is not None else None

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
            codes = {n: self.codes[n] for n in members if n in self.modules}
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
        if not self.codes[name].endswith("." + CODES_PART[PACKED]):  # int-quantized: one code per value
            return list(packed)
        shape_name = f"{self.modules[name]}.weight_shape"
        if shape_name not in self.companions:
            return list(packed)
        return [int(v) for v in self.reader(self.companions[shape_name], [shape_name])[shape_name].tolist()]

    def stored_dtype(self, name: str) -> str | None:
        """The dtype tensor ``name`` had in its file when last read (see FP8Checkpoint.stored_dtype)."""
        if self.others is not None and name not in self.modules:
            return self.others.stored_dtype(name)
        return self.as_stored.get(name)

    def read(self, names: list[str]):
        self.require(names)
        plain = [n for n in names if n not in self.modules]
        out = (self.others.read(plain) if plain else {}) if self.others is not None else super().read(plain)
        if self.scheme.method in (PACKED, STORED) and self.others is None:  # a linear its config quantizes, stored
            # plain: the layer's finding (beside FP8 groups, fp8_blocks judges theirs)
            for name, value in out.items():
                check_plain([t for t, _ in self.scheme.targets], self.scheme.not_converted, name, value,
                            self.location)
        self.as_stored = {n: str(t.dtype).removeprefix("torch.") for n, t in out.items()}
        for name in names:
            if name in self.modules:
                grid, out[name] = self.unpack(name)
                self.as_stored[name] = f"int{grid.bits}"
        return out


def wrap(checkpoint: Checkpoint, folder: Path | str, *, rest: Callable[[Checkpoint, Path | str], Checkpoint]
         ) -> Checkpoint | None:
    """``checkpoint`` as an IntGroupCheckpoint when its config states integer group quantization, else None.  A
    mixed-precision compressed-tensors config may store some groups pack-quantized and others int-quantized
    (llm-compressor's int4 + int8 recipe): each module is read in the layout its file holds it; its FP8 groups'
    modules are read by ``rest`` (``fp8_blocks.wrap``, handed in by ``quantized``, which knows every reader), given
    the checkpoint without the integer modules."""
    scheme = scheme_of(checkpoint.raw_config, shown(folder))
    if scheme is None:
        return None
    methods = {scheme.method, *(s.method for _, s in scheme.targets)}
    kept = {part for method in methods for part in PARTS[method]}
    float_modules = fp8_modules(scheme, checkpoint.weight_map, shown(folder))
    parts = {n: f for n, f in checkpoint.weight_map.items() if n.rsplit(".", 1)[-1] in kept
             and n.rsplit(".", 1)[0] not in float_modules}
    packed_codes = CODES_PART[PACKED] if scheme.method in (PACKED, STORED) else CODES_PART[scheme.method]
    packed = {n.rsplit(".", 1)[0] for n in parts if n.endswith("." + packed_codes)}
    layouts = {prefix + ".weight": packed_codes for prefix in packed}  # X.weight -> the part holding its codes
    if STORED in methods:  # the codes keep the weight's own name: a weight is quantized where it has a scale
        scaled = {n.rsplit(".", 1)[0] for n in parts if n.endswith(".weight_scale")}
        parts = {n: f for n, f in parts.items() if n.rsplit(".", 1)[0] in packed
                 or (n.rsplit(".", 1)[0] in scaled and n.rsplit(".", 1)[-1] in PARTS[STORED])}
        parts.update({n: f for n, f in checkpoint.weight_map.items() if n.rsplit(".", 1)[-1] in ACTIVATION_PARTS})
        layouts.update({n: CODES_PART[STORED] for n in parts if n.endswith(".weight")
                        and n.rsplit(".", 1)[0] not in packed})
    modules = {name: name.removesuffix(".weight") for name in layouts}
    weights = {n: f for n, f in checkpoint.weight_map.items() if n not in parts}
    weights.update({name: parts[f"{prefix}.{layouts[name]}"] for name, prefix in modules.items()})
    reader = "compressed-tensors" if scheme.method in (PACKED, STORED) else "parity's unpacker (GPTQ/AWQ layouts)"
    wrapped = dequantized_on_read(checkpoint, IntGroupCheckpoint, scheme, weights, parts, matrices=len(modules),
                                  dequantized_with=reader)
    wrapped.modules = modules
    wrapped.codes = {name: f"{prefix}.{layouts[name]}" for name, prefix in modules.items()}
    wrapped.others = None
    if float_modules:  # the FP8 groups' modules and the plain tensors: a checkpoint of the rest, read by fp8_blocks
        wrapped.others = rest(dataclasses.replace(checkpoint, weight_map={n: f for n, f in checkpoint.weight_map.items()
                                                                          if n not in parts}), folder)
        wrapped.notes.append(wrapped.others.notes[-1])
    return wrapped


def fp8_modules(scheme: IntScheme, weight_map: dict[str, str], where: str) -> set[str]:
    """The modules a mixed-precision config gives to its FP8 groups, among those stored with a scale
    (``IntScheme.others``; compressed-tensors' own ranking of the targets decides, as for every module)."""
    if not scheme.others:
        return set()
    stated = {**dict.fromkeys(scheme.others, ANOTHER), **dict(scheme.targets)}
    found = set()
    for prefix in {n.rsplit(".", 1)[0] for n in weight_map if n.endswith(".weight_scale")}:
        try:
            if module_scheme(stated, scheme.not_converted, prefix, where) == ANOTHER:
                found.add(prefix)
        except QuantizedLayoutError:  # a module no group states: its reader reports it on its layer
            continue
    return found
