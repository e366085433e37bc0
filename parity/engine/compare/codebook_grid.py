"""bitsandbytes 4-bit (NF4, FP4; ``parity.sources.bnb_4bit``) judged against its own grid, for ``parity compare``.

A 4-bit value is a level of a code book of 16 (NF4's normal quantiles, FP4's e2m1 values, both in [-1, 1]) times
its block's absmax (``blocksize`` consecutive values of the flattened matrix).  The levels are not evenly spaced, so
each value's step is the wider of the gaps beside its level, times its block's absmax: rounding to the nearest level
puts a value within half of it.  A is re-quantized by bitsandbytes' own ``quantize_4bit`` (same quant type, block
size and double quant as B's quant state) and dequantized by its ``dequantize_4bit``: the conversion deviation.  The
mistakes replayed on A's tensor: the codes of one code book read with the other (NF4 read as FP4, or the reverse),
and the absmax of double quant not undone (its 8-bit blockwise codes dequantized without the stored offset, or the
raw codes taken for the absmax).

Everything here works in the layout the file stores ([out, in]); ``conversion`` routes it to the reference's.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch

from parity.definitions.mapping import TensorRoute
from parity.engine.compare.storage import Storage, level_steps
from parity.engine.layer import route_tensor

# A block's absmax in B's file may exceed its largest magnitude in A by this before the block is grid_too_coarse:
# without double quant the absmax is A's largest magnitude exactly; with it, an 8-bit blockwise code of
# (absmax - mean): measured on tests/test_quantized_bnb.py's tiny LLaMA, every decoder matrix, 0.9923 to 1.0087 x
# (NF4 and FP4 alike).  A block read with another's absmax or a scale twice too large exceeds it.
GRID_FACTOR = 1.1
# With double quant, A's need is its absmax as bitsandbytes' own double quant stores it (quantize_4bit with
# compress_statistics, the 8-bit code of absmax - mean undone): a reviewer's faithful double-quant exports of
# Student-t, log-normal and outlier-row weights held blocks 1.13 to 1.18 x A's largest magnitude, and near-zero ones
# negative (their mean's offset outweighs them), and failed grid_too_coarse on every A.


def stored(checkpoint, key: str, route: TensorRoute) -> Storage | None:
    """How a bitsandbytes 4-bit checkpoint stores ``key`` (``parity.sources.bnb_4bit``): each value's step is its
    code's step in the code book times its block's absmax, read from the file; None for a tensor stored unquantized."""
    packed = getattr(checkpoint, "packed", None)
    held = packed(key) if packed is not None else None
    if held is None:
        return None
    each = steps(held.codes, held.absmax, held.levels, held.blocksize, held.shape)
    bad = ~torch.isfinite(held.absmax)
    problem = (f"block {int(bad.nonzero()[0, 0])} ({key}.absmax): {int(bad.sum())} of {bad.numel()} blocks have a "
               "NaN/Inf absmax") if bool(bad.any()) else None
    return Storage(held.quant_type, True, route_tensor(route, each), "file", route, nonfinite_scale=problem,
                   zeroed=not bool(held.levels[held.codes].any()), codebook=held)


def library():
    from parity.sources.bnb_4bit import require_library

    return require_library("bitsandbytes 4-bit")


def expand(absmax: torch.Tensor, blocksize: int, numel: int) -> torch.Tensor:
    """Each block's absmax at every value of its block (flat, ``numel`` values)."""
    return absmax.float().repeat_interleave(blocksize)[:numel]


def steps(codes: torch.Tensor, absmax: torch.Tensor, levels: torch.Tensor, blocksize: int, shape) -> torch.Tensor:
    """Each stored value's step (``shape``): its code's step in the code book times its block's absmax."""
    return (level_steps(levels.float())[codes] * expand(absmax, blocksize, codes.numel())).reshape(shape)


def unpack(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The 4-bit codes (int64, flat) of bitsandbytes' packed bytes: the high nibble first."""
    raw = packed.reshape(-1).view(torch.uint8)
    return torch.stack([raw >> 4, raw & 0xF], dim=1).reshape(-1)[:numel].long()


def quantize(x: torch.Tensor, quant_type: str, blocksize: int, nested: bool):
    """A's matrix quantized by bitsandbytes' quantize_4bit (flat, as Linear4bit quantizes a weight): its codes (flat)
    and bitsandbytes' QuantState."""
    packed, state = library().quantize_4bit(x.float().reshape(-1).contiguous(), blocksize=blocksize,
                                            compress_statistics=nested, quant_type=quant_type)
    return unpack(packed, x.numel()), packed, state


def absmax_of(state) -> torch.Tensor:
    """Each block's absmax as dequantize_4bit uses it (double quant undone: codes dequantized plus the offset)."""
    if not state.nested:
        return state.absmax.float()
    return (library().dequantize_blockwise(state.absmax, state.state2) + state.offset).float()


def requantize(x: torch.Tensor, book) -> tuple[torch.Tensor, torch.Tensor]:
    """A's matrix (stored layout) as a faithful export holds it, dequantized by bitsandbytes (float32), and each
    value's step; ``book``: B's ``Packed4bit`` (its quant type, block size, double quant)."""
    if book.quant_type == "int8":  # LLM.int8: each row's codes round(127 x / its largest magnitude)
        codes, scb, _ = library().int8_vectorwise_quant(x.float().contiguous())
        values = library().int8_vectorwise_dequant(codes, scb).float()
        return values, steps((codes.long() + 128).reshape(-1), scb, book.levels, book.blocksize, x.shape)
    codes, packed, state = quantize(x, book.quant_type, book.blocksize, book.nested)
    flat = copy.copy(state)
    flat.dtype = torch.float32
    values = library().dequantize_4bit(packed, flat).float().reshape(x.shape)
    return values, steps(codes, absmax_of(state), book.levels, book.blocksize, x.shape)


def reference(x: torch.Tensor, storage: Storage) -> tuple[torch.Tensor, str, torch.Tensor]:
    """A's matrix (stored layout) as B's bitsandbytes storage would hold it (``requantize``), how it was made, and each
    value's step."""
    book = storage.codebook
    values, each = requantize(x, book)
    how = ("int8_vectorwise_quant (one scale per row)" if book.quant_type == "int8" else
           f"quantize_4bit in blocks of {book.blocksize}" + (" (double quant)" if book.nested else ""))
    return values, f"re-quantized to {storage.dtype} with bitsandbytes' {how}", each


def bounds(x: torch.Tensor, book) -> tuple[torch.Tensor | None, dict | None]:
    """What double quant adds to each value's allowed distance (``nested_allowance``; None without it), and B's
    blocks coarser than A's values call for (``coarse_blocks``): A's absmax per block, and as double quant stores it
    (bitsandbytes' own quantize_4bit, run once), shared by both.  ``x``: A in the stored layout."""
    flat = x.float().reshape(-1)
    blocks = math.ceil(flat.numel() / book.blocksize)
    padded = torch.nn.functional.pad(flat.abs(), (0, blocks * book.blocksize - flat.numel()))
    largest = padded.reshape(blocks, book.blocksize).amax(-1)
    if not book.nested or book.quant_type == "int8":
        return None, coarse_blocks(x, book, largest)
    stored = absmax_of(quantize(x, book.quant_type, book.blocksize, True)[2])
    return nested_allowance(x, book, largest, stored), coarse_blocks(x, book, stored.abs())


def nested_allowance(x: torch.Tensor, book, largest: torch.Tensor, stored: torch.Tensor) -> torch.Tensor | None:
    """Double quant: what storing each block's absmax as an 8-bit code (of absmax - mean) moves a value of it: |its
    code's level| x |that absmax (``stored``) - A's largest magnitude there (``largest``)|, plus its code's step on
    A's own absmax, where its code was chosen (stored layout).  A faithful export's values lie that far from A's
    beyond their step: a reviewer's of Student-t weights with near-zero rows up to 3.6 steps, and without bound where
    the stored absmax came out 0 or below.  None where the blocks do not match B's codes."""
    numel = x.numel()
    if stored.shape != largest.shape or book.codes.numel() != numel:
        return None
    moved = expand((stored - largest).abs(), book.blocksize, numel)
    step = level_steps(book.levels.float())[book.codes] * expand(largest, book.blocksize, numel)
    return (book.levels.float()[book.codes].abs() * moved + step).reshape(x.shape)


def coarse_blocks(x: torch.Tensor, book, needed: torch.Tensor) -> dict | None:
    """Blocks whose absmax in B's file exceeds ``GRID_FACTOR`` x A's ``needed`` there (its largest magnitude; with
    double quant, its absmax as double quant stores it, above): None when none does; else how many, and the worst,
    with evidence (the keys ``findings.grid_finding`` words; a block's "step" here is its absmax, the unit its levels
    are multiples of)."""
    blocks = needed.numel()
    if needed.shape != book.absmax.shape:
        return None
    limit = GRID_FACTOR * needed
    over = torch.where(needed > 0, book.absmax.abs() / limit, torch.zeros_like(limit)).nan_to_num(0.0)
    if not bool((over > 1).any()):
        return None
    worst = int(over.argmax())
    first = worst * book.blocksize
    return {"blocks_too_coarse": int((over > 1).sum()), "blocks": blocks, "worst_block": worst,
            "row": first // x.shape[-1], "values": [first % x.shape[-1], (first % x.shape[-1]) + book.blocksize - 1],
            "b_step": float(book.absmax[worst]), "a_step": float(needed[worst]), "limit": float(limit[worst]),
            "times_coarser": float(book.absmax[worst] / needed[worst])}


def mistakes(x: torch.Tensor, book) -> list[tuple[str, str, torch.Tensor]]:
    """The 4-bit conversion mistakes that keep B's layout the stated one, each as (mistake id, detail, A's matrix as
    the broken export reads back; stored layout): A's codes of the other code book read with B's; A's absmax of
    double quant not undone (dequantized without its offset; its 8-bit codes taken for the absmax)."""
    from parity.sources.bnb_4bit import code_book

    if book.quant_type == "int8":  # LLM.int8's scale mistakes (SCB not divided by 127, ...) are tensor_scaled's
        return []
    other = {"nf4": "fp4", "fp4": "nf4"}[book.quant_type]
    numel, levels = x.numel(), code_book(book.quant_type)
    codes, _, state = quantize(x, other, book.blocksize, book.nested)
    found = [("bnb_code_book_wrong", f"quantized to {other.upper()} codes, read with {book.quant_type.upper()}'s "
              "code book", (levels[codes] * expand(absmax_of(state), book.blocksize, numel)).reshape(x.shape))]
    codes, _, state = quantize(x, book.quant_type, book.blocksize, True)
    without = library().dequantize_blockwise(state.absmax, state.state2).float()
    found.append(("bnb_double_quant_not_undone", "double-quantized absmax dequantized without its offset "
                  f"({float(state.offset):.4g})", (levels[codes] * expand(without, book.blocksize, numel))
                  .reshape(x.shape)))
    found.append(("bnb_double_quant_not_undone", "double-quantized absmax: its 8-bit codes taken for the absmax",
                  (levels[codes] * expand(state.absmax.float(), book.blocksize, numel)).reshape(x.shape)))
    return found


def replays(x: torch.Tensor, book, back: Callable[[torch.Tensor], torch.Tensor]) -> list[tuple[str, str, torch.Tensor]]:
    """``mistakes`` with each result put into the reference's layout by ``back``."""
    return [(mistake, detail, back(values)) for mistake, detail, values in mistakes(x, book)]
