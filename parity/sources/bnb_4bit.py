"""bitsandbytes' serialized 4-bit checkpoints (what ``save_pretrained`` writes for a model loaded with transformers'
``BitsAndBytesConfig(load_in_4bit=True)``): config.json says ``quantization_config = {quant_method: "bitsandbytes",
load_in_4bit: true, bnb_4bit_quant_type: "nf4" | "fp4", bnb_4bit_use_double_quant, llm_int8_skip_modules, ...}``,
and each quantized linear ``X`` is stored as bitsandbytes' ``Linear4bit._save_to_state_dict`` writes it:
``X.weight`` (uint8, two 4-bit codes a byte, [ceil(numel / 2), 1]), and its ``QuantState.as_dict(packed=True)``
under ``X.weight.``: ``absmax`` (one per block of ``blocksize`` consecutive values of the flattened matrix; uint8 codes
when double-quantized), ``quant_map`` (the 16 levels of the code book), ``nested_absmax`` / ``nested_quant_map``
(double quant: the absmax codes' own blockwise 8-bit scale and map) and ``quant_state.bitsandbytes__nf4`` (or
``__fp4``): a JSON blob, as uint8, holding quant_type, blocksize, dtype, shape and the nested offset.  Modules in
``llm_int8_skip_modules`` are stored unquantized and read as stored.  An 8-bit checkpoint (LLM.int8, ``load_in_8bit``)
stores ``X.weight`` (int8, [out, in]) beside ``X.SCB`` (float32, each row's largest magnitude) and ``X.weight_format``
(uint8 0: row-major), as ``Linear8bitLt._save_to_state_dict`` writes them; each value is code x SCB / 127, read here as
the same code book view (255 evenly spaced levels, one block per row) and dequantized by bitsandbytes'
``int8_vectorwise_dequant``.

``read`` returns each quantized matrix dequantized (float32) by bitsandbytes itself (``QuantState.from_dict`` and
``dequantize_4bit``: the extra ``bnb``), imported only when a checkpoint needs it. One thing is done differently
from calling ``dequantize_4bit`` with the stored shape: the matrix is dequantized as one flat vector, then reshaped.
Why: bitsandbytes 0.50's CPU kernel, on some CPUs, reads some [rows, columns] matrices whose rows are not a whole
number of blocks with other blocks' absmax (measured, blocksize 64: a [64, 96] NF4 matrix of normal values read up
to 2.03 off; the [200, 160] FFN matrices of tests/test_quantized_bnb.py 3.8 to 3.9 code steps from A's values, where
their flat read lies within half a step plus double quant's absmax rounding, as rounding to the nearest level does;
[160, 200] and [64, 172] read right either way; on an AMD EPYC without AVX-512 the fixture's [200, 160] ones read
right too, 0.52). The blocks are runs of the flattened matrix on every device (bitsandbytes' own reference
implementation, ``backends/default``, reads them so), so the flat read is the format's.

The layout must be the one the quant state states: ``absmax`` one per block, ``quant_map`` the code book of the
stated quant_type (``dequantize_4bit`` decodes with the stated type's own table, whatever ``quant_map`` holds); else
a ``QuantizedLayoutError`` a compare reports on the layer holding it.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path

from parity.definitions.distribution import install_command
from parity.definitions.files import shown
from parity.errors import CheckpointError, QuantizedLayoutError
from parity.sources.checkpoint import Checkpoint, check_converted, dequantized_on_read, split_companions
from parity.sources.config_check import stated_modules

QUANT_METHOD = "bitsandbytes"
SKIP_KEY = "llm_int8_skip_modules"  # BitsAndBytesConfig's modules left unquantized
EXTRA = "bnb"  # pyproject.toml's extra that installs bitsandbytes
# what QuantState.as_dict(packed=True) writes beside X.weight (prefixed "X.weight.")
COMPANIONS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map", "quant_state.bitsandbytes__nf4",
              "quant_state.bitsandbytes__fp4")
BLOB = "quant_state.bitsandbytes__"
INT8 = ("SCB", "weight_format")  # what Linear8bitLt writes beside X.weight (prefixed "X.")


@dataclass(frozen=True)
class BnbScheme:
    """What config.json's quantization_config states: the 4-bit code book, double quant, what stays unquantized."""

    quant_type: str  # "nf4", "fp4" or "int8" (LLM.int8)
    double_quant: bool
    not_converted: tuple[str, ...] = ()

    def describe(self) -> str:
        if self.quant_type == "int8":
            return "bitsandbytes 8-bit (LLM.int8, one scale per row)"
        return (f"bitsandbytes 4-bit {self.quant_type.upper()}" + (", double-quantized absmax" if self.double_quant
                                                                      else ""))


@dataclass
class Packed4bit:
    """One 4-bit matrix as its file stores it: each value's code (0..15, flat), its block's absmax (float32, double
    quant undone by bitsandbytes), the code book's 16 levels, the block size and the quant type."""

    codes: object  # torch.Tensor int64 [numel]
    absmax: object  # torch.Tensor float32 [ceil(numel / blocksize)]
    levels: object  # torch.Tensor float32 [16]
    blocksize: int
    quant_type: str
    shape: tuple[int, ...]
    nested: bool


def scheme_of(raw_config: dict, where: str) -> BnbScheme | None:
    """The scheme config.json states (4-bit, or 8-bit LLM.int8), None for a checkpoint not quantized by bitsandbytes;
    neither bit width, or an unknown quant type, is a CheckpointError naming the field."""
    config = raw_config.get("quantization_config")
    if not isinstance(config, dict) or config.get("quant_method") != QUANT_METHOD:
        return None
    skipped = stated_modules(config, SKIP_KEY, where)
    if not (config.get("load_in_4bit") or config.get("_load_in_4bit")):
        if config.get("load_in_8bit") or config.get("_load_in_8bit"):
            return BnbScheme("int8", False, skipped)
        raise CheckpointError(f"{where}: config.json's quantization_config (bitsandbytes) has load_in_4bit "
                              f"{config.get('load_in_4bit')!r} and load_in_8bit {config.get('load_in_8bit')!r}; "
                              "bitsandbytes writes one of them true")
    quant_type = config.get("bnb_4bit_quant_type", "fp4")
    if quant_type not in ("nf4", "fp4"):
        raise CheckpointError(f"{where}: config.json's quantization_config.bnb_4bit_quant_type is {quant_type!r}; "
                              "bitsandbytes writes 'nf4' or 'fp4'")
    return BnbScheme(quant_type, bool(config.get("bnb_4bit_use_double_quant")), skipped)


def require_library(where: str):
    """bitsandbytes' functional module (QuantState, quantize_4bit, dequantize_4bit), or a CheckpointError (exit 2)
    naming what to install."""
    import logging

    quiet = logging.getLogger("bitsandbytes.backends.cpu.ops")  # its note on an optional GEMM kernel parity never runs
    level, quiet.level = quiet.level, logging.ERROR
    try:
        import bitsandbytes.functional as functional
    except ImportError:
        raise CheckpointError(
            f"{where}: its weights are 4-bit quantized by bitsandbytes (config.json: quantization_config.quant_method "
            f"'{QUANT_METHOD}'), which parity dequantizes with bitsandbytes, and that is not installed: "
            f"{install_command(EXTRA, fallback='bitsandbytes')} (ffn-parity's extra '{EXTRA}')") from None
    finally:
        quiet.setLevel(level)
    return functional


def code_book(quant_type: str):
    """The 16 levels bitsandbytes decodes ``quant_type`` with (its own table, float32)."""
    return require_library("bitsandbytes 4-bit").get_4bit_type(quant_type, device="cpu").float()


def check_layout(location: str, name: str, packed, state) -> None:
    """The stored tensors are the layout the quant state states, else a QuantizedLayoutError saying what they are:
    ``absmax`` one per block of ``blocksize`` values (another count: the blocks of another size), ``quant_map`` the
    stated type's code book (another type's: the codes were written for it), the packed codes two a byte (counted in
    bytes: ``bnb_4bit_quant_storage`` may hold them as bfloat16 or float32 elements, the same bytes viewed so)."""
    import torch

    numel = math.prod(state.shape)
    blocks = math.ceil(numel / state.blocksize)
    size = packed.numel() * packed.element_size()
    if size != math.ceil(numel / 2):  # two codes a byte, whatever dtype quant_storage views those bytes as
        raise CheckpointError(f"{location}: {name} holds {size} bytes ({str(packed.dtype)[6:]} "
                              f"{list(packed.shape)}) where the {numel} 4-bit codes of its quant_state shape "
                              f"{list(state.shape)} pack into {math.ceil(numel / 2)}")
    if state.absmax.numel() != blocks:
        implied = numel / max(state.absmax.numel(), 1)
        raise QuantizedLayoutError(f"{location}: {name}.absmax has {state.absmax.numel()} entries for the {numel} "
                                   f"values of {name} {list(state.shape)}; its quant_state's blocksize "
                                   f"{state.blocksize} calls for {blocks}: it is the count of {implied:g}-value blocks",
                                   "bnb_block_size_wrong")
    check_nested(location, name, state)
    stated = code_book(state.quant_type)
    if state.code.shape != stated.shape:
        raise CheckpointError(f"{location}: {name}.quant_map has {state.code.numel()} entries; a 4-bit code book "
                              f"holds {stated.numel()}")
    if not torch.equal(state.code.float(), stated):
        other = {"nf4": "fp4", "fp4": "nf4"}[state.quant_type]
        which = f"{other.upper()}'s" if torch.equal(state.code.float(), code_book(other)) else "another"
        raise QuantizedLayoutError(f"{location}: {name}.quant_map is {which} code book where its quant_state says "
                                   f"{state.quant_type}: the codes were written for one table and are read with the "
                                   "other", "bnb_code_book_wrong")


def check_nested(location: str, name: str, state) -> None:
    """A double-quantized absmax (uint8 codes, one per block) beside its own quant state: ``nested_absmax`` one per
    block of ``nested_blocksize`` absmax codes and a 256-entry ``nested_quant_map``, as bitsandbytes'
    ``quantize_blockwise`` writes them, else a CheckpointError naming the tensor: bitsandbytes' native
    dequantizer reads past a short one (an empty nested_absmax ended the process with a segmentation fault)."""
    if not state.nested:
        return
    inner = state.state2
    blocks = math.ceil(state.absmax.numel() / inner.blocksize) if inner.blocksize else -1
    said = (f"{location}: {name}'s double-quantized absmax ({state.absmax.numel()} {str(state.absmax.dtype)[6:]} "
            f"codes) has")
    if state.absmax.dtype.is_floating_point or state.absmax.element_size() != 1:
        raise CheckpointError(f"{said} another dtype than the uint8 codes double quant stores")
    if inner.absmax.numel() != blocks or not inner.absmax.dtype.is_floating_point:
        raise CheckpointError(f"{said} a nested_absmax of {inner.absmax.numel()} {str(inner.absmax.dtype)[6:]} "
                              f"entries; its nested_blocksize {inner.blocksize} calls for {blocks} floats")
    if inner.code.numel() != 256:
        raise CheckpointError(f"{said} a nested_quant_map of {inner.code.numel()} entries; an 8-bit code book "
                              "holds 256")


class Bnb4bitCheckpoint(Checkpoint):
    """An HF folder of bitsandbytes 4-bit weights: ``read`` returns each quantized matrix dequantized (float32) by
    bitsandbytes; the quant state's tensors are kept apart from ``weight_map`` (they are part of their weight's
    storage, not tensors of the model)."""

    scheme: BnbScheme
    companions: dict[str, str]
    as_stored: dict[str, str]

    def state_of(self, name: str):
        """bitsandbytes' QuantState of ``name`` read from its stored companions, None when it has none; the last one
        read is kept (``packed`` and ``read`` each ask for the tensor being judged), one at a time so a sweep's memory
        stays flat."""
        last = getattr(self, "last_state", None)
        if last is not None and last[0] == name:
            return last[1]
        self.last_state = (name, self.read_state(name))
        return self.last_state[1]

    def read_state(self, name: str):
        """``state_of``'s reading, uncached."""
        keys = [f"{name}.{suffix}" for suffix in COMPANIONS if f"{name}.{suffix}" in self.companions]
        if not any(BLOB in key for key in keys):
            return None
        stored = {}
        for key in keys:
            stored.update(self.reader(self.companions[key], [key]))
        functional = require_library(self.location)
        try:
            return functional.QuantState.from_dict({k[len(name) + 1:]: v for k, v in stored.items()}, device="cpu")
        except (ValueError, KeyError, AssertionError, TypeError) as exc:
            raise CheckpointError(f"{self.location}: {name}'s bitsandbytes quant state is not one bitsandbytes reads "
                                  f"({type(exc).__name__}: {exc})") from None

    def row_scales(self, name: str):
        """LLM.int8: the SCB (each row's largest magnitude, float32) stored beside weight ``name``, None without."""
        key = name.removesuffix("weight") + "SCB"
        if not name.endswith(".weight") or key not in self.companions:
            return None
        return self.reader(self.companions[key], [key])[key].float()

    def int8_checked(self, name: str, codes, scb):
        """LLM.int8 codes whose SCB holds one scale per row, else a QuantizedLayoutError saying what it holds."""
        if codes.dim() != 2 or scb.shape != codes.shape[:1]:
            raise QuantizedLayoutError(f"{self.location}: {name.removesuffix('weight')}SCB has shape "
                                       f"{list(scb.shape)} for {name} {list(codes.shape)}; LLM.int8 stores one scale "
                                       "per row (output channel)", "bnb_block_size_wrong")
        return codes

    def packed(self, name: str) -> Packed4bit | None:
        """How tensor ``name`` is stored, when it is quantized: its codes, absmax and code book (LLM.int8: 255 even
        levels, one block per row)."""
        import torch

        scb = self.row_scales(name) if self.has(name) else None
        if scb is not None:
            codes = self.int8_checked(name, self.reader(self.weight_map[name], [name])[name], scb)
            levels = torch.arange(-128, 128, dtype=torch.float32) / 127
            return Packed4bit((codes.long() + 128).reshape(-1), scb, levels, codes.shape[1], "int8",
                              tuple(codes.shape), False)
        state = self.state_of(name) if self.has(name) else None
        if state is None:
            return None
        raw = self.reader(self.weight_map[name], [name])[name].reshape(-1).view(torch.uint8)
        check_layout(self.location, name, raw, state)
        numel = math.prod(state.shape)
        codes = torch.stack([raw >> 4, raw & 0xF], dim=1).reshape(-1)[:numel].long()
        absmax = self.dequantize_absmax(state)
        return Packed4bit(codes, absmax, code_book(state.quant_type), state.blocksize, state.quant_type,
                          tuple(state.shape), state.nested)

    @staticmethod
    def dequantize_absmax(state):
        """Each block's absmax as bitsandbytes' dequantize_4bit uses it: double quant undone (its blockwise 8-bit
        dequantization plus the stored offset)."""
        if not state.nested:
            return state.absmax.float()
        functional = require_library("bitsandbytes 4-bit")
        return (functional.dequantize_blockwise(state.absmax, state.state2) + state.offset).float()

    def stored_dtype(self, name: str) -> str | None:
        """The dtype (or 4-bit quant type) tensor ``name`` had in its file when last read."""
        return self.as_stored.get(name)

    def read(self, names: list[str]):
        out = super().read(names)
        self.as_stored = {name: str(out[name].dtype).removeprefix("torch.") for name in names}
        for name in names:
            scb = self.row_scales(name) if out[name].dtype.itemsize == 1 else None
            state = self.state_of(name) if scb is None else None
            if scb is not None or state is not None:  # stored quantized: transformers must quantize it too
                check_converted(name.rsplit(".", 1)[0], self.scheme.not_converted, self.location, SKIP_KEY)
            if scb is not None:
                codes = self.int8_checked(name, out[name], scb)
                out[name] = require_library(self.location).int8_vectorwise_dequant(codes, scb).float()
                continue
            if state is not None:
                out[name] = self.dequantize(name, out[name], state)
                self.as_stored[name] = state.quant_type
        return out

    def dequantize(self, name: str, packed, state):
        """bitsandbytes' dequantize_4bit (float32) of the matrix read as one flat vector (the module docstring says
        why), reshaped to the quant state's shape; the layout checked first."""
        import torch

        check_layout(self.location, name, packed, state)
        functional = require_library(self.location)
        flat = copy.copy(state)
        flat.shape, flat.dtype = torch.Size([math.prod(state.shape)]), torch.float32
        return functional.dequantize_4bit(packed.reshape(-1).view(torch.uint8), flat).reshape(state.shape).float()

    def describe(self, names: list[str]) -> dict[str, tuple[list[int], str]] | None:
        """Shape and type of these tensors: a quantized one's from its quant state (its codes are packed), the others'
        from the safetensors headers; None for a hub checkpoint (not read ahead)."""
        if self.repo_id is not None:
            return None
        from parity.sources.safetensors_files import describe_local

        out = {}
        for file_name in self.files_for(names):
            members = [n for n in names if self.weight_map[n] == file_name]
            out.update(describe_local(self.fetch(file_name), members))
        for name in names:
            state = self.state_of(name)
            if state is not None:
                out[name] = (list(state.shape), state.quant_type.upper())
        return out


def wrap(checkpoint: Checkpoint, folder: Path | str) -> Checkpoint:
    """``checkpoint`` as a Bnb4bitCheckpoint when its config states bitsandbytes quantization, else unchanged."""
    scheme = scheme_of(checkpoint.raw_config, shown(folder))
    if scheme is None:
        return checkpoint
    require_library(shown(folder))  # before anything is computed: exit 2 naming the extra
    weights, states = split_companions(checkpoint, tuple(f".{s}" for s in COMPANIONS + INT8))
    quantized = sum(1 for n in states if BLOB in n or n.endswith(".SCB"))
    how = ("int8_vectorwise_dequant" if scheme.quant_type == "int8"
           else "dequantize_4bit, each matrix read as one flat run of blocks")
    return dequantized_on_read(checkpoint, Bnb4bitCheckpoint, scheme, weights, states, matrices=quantized,
                               dequantized_with=f"bitsandbytes ({how})")
