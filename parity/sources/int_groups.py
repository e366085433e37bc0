"""Integer group-quantized safetensors: compressed-tensors' ``pack-quantized`` and ``int-quantized``, GPTQ and AWQ's
GEMM layout (their schemes: ``int_schemes``; their readers: ``compressed_int`` and ``gptq_awq``).
Each quantized matrix is stored as integer codes (packed into int32, or one int8 per value) beside a scale (and a
zero point) per group of ``group_size`` input values; the true weight is ``scale x (code - zero)`` of the code's
group (for act-order GPTQ, the group ``g_idx`` names for each input column).  Modules left unquantized
(``modules_to_not_convert``, compressed-tensors' ``ignore``) have no codes and are read as stored.

The wrapper presents each quantized module as its ``X.weight`` (float32, [out, in] as ``nn.Linear`` holds it),
dequantized on read, one tensor at a time; ``grouped`` returns its codes, scales and zeros for a compare to judge it
against its own grid (``parity.engine.compare.group_grid``)."""

from __future__ import annotations

from pathlib import Path

from parity.definitions.files import shown
from parity.errors import QuantizedLayoutError
from parity.sources.checkpoint import Checkpoint, dequantized_on_read
from parity.sources.compressed_config import check_plain
from parity.sources.compressed_int import check_stray_zeros, read_packed, read_stored
from parity.sources.gptq_awq import READERS
from parity.sources.int_schemes import (
    ACTIVATION_PARTS,
    CODES_PART,
    PACKED,
    PARTS,
    STORED,
    GroupQuantized,
    IntScheme,
    check_parts,
    scheme_of,
)


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
