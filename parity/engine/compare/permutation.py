"""A matrix of B holding A's rows (its outputs) or columns (its inputs) in another order (``parity compare``): the
order read off the values, each moved row of B matched to its nearest row of A by cosine, for the replays
(``mistakes``) and the value-level finding (``findings``) to name ``rows_permuted`` / ``columns_permuted``.  Every
storage keeps a row's direction (quantization moves each value less than a step), so a moved row is as close to the
row of A it holds as a row left in place is to its own; an unrelated row is not."""

from __future__ import annotations

import torch

from parity.definitions.mistakes import MistakeId

# A row of B is taken for a moved one where its cosine with A's same row is under half the matrix's median (a storage's
# own rounding moves every row alike: 0.99 at 4 bits, 0.9 at 2; where most rows moved, the median is theirs and every
# row is taken), and for A's row j where its cosine with that row is at least MATCHED x the median of the rows left in
# place (or, where every row moved, of the matched rows) and at least MATCH_FLOOR: an unrelated row's best cosine
# among n rows of d values is about sqrt(2 ln n / d): 0.14 for n = 4864, d = 896; 0.29 for n = 192, d = 128.
# Measured: two rows' FP4 codes exchanged with their scales kept (each row then A's codes under another row's
# scales) match at 0.83 to 0.97 (MXFP4's power-of-two scales the farthest), against 0.994 in place
MOVED, MATCHED, MATCH_FLOOR = 0.5, 0.8, 0.5
MATCH_SAMPLE = 64  # moved rows matched first: where one of them matches no row of A, no order is searched
MATCH_CHUNK = 512  # B rows matched against all of A's at a time (a [512, rows] cosine matrix)
SHOWN = 4  # moved rows named in a detail


def moved_order(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """(for each row of B the row of A it holds, each moved row's cosine with it, the reference cosine) where B's
    rows are A's in another order: the rows that moved (``MOVED``) each matched to the nearest row of A
    (``MATCHED``), no two to the same one.  None where no row moved, a moved row matches no row of A, or two match
    the same one."""
    an, bn = torch.nn.functional.normalize(a, dim=1), torch.nn.functional.normalize(b, dim=1)
    own = (an * bn).sum(1)
    median = float(own.median()) if own.numel() else 0.0
    moved = (own < MOVED * median).nonzero().flatten() if median >= MATCH_FLOOR else torch.arange(a.shape[0])
    if moved.numel() == 0:
        return None
    if bool(((bn[moved[:MATCH_SAMPLE]] @ an.t()).max(1).values < MATCH_FLOOR).any()):
        return None
    matched = [(bn[chunk] @ an.t()).max(1) for chunk in moved.split(MATCH_CHUNK)]
    best, at = torch.cat([m.values for m in matched]), torch.cat([m.indices for m in matched])
    reference = median if median >= MATCH_FLOOR else float(best.median())
    if bool((best < max(MATCH_FLOOR, MATCHED * reference)).any()):
        return None
    order = torch.arange(a.shape[0])
    order[moved] = at
    if order.unique().numel() != order.numel() or not bool((order != torch.arange(order.numel())).any()):
        return None
    cosines = torch.ones(order.numel())
    cosines[moved] = best
    return order, cosines, reference


def permutations(a: torch.Tensor, b: torch.Tensor) -> list[tuple[MistakeId, str, torch.Tensor]]:
    """(mistake, detail, A's matrix in B's order) for B's rows and for its columns, where either is A's in another
    order (``moved_order``); none for a tensor that is not a matrix of A's shape."""
    a, b = a.float(), b.float()
    if a.dim() != 2 or a.shape != b.shape:
        return []
    found = []
    for mistake, axis in ((MistakeId.ROWS_PERMUTED, "rows"), (MistakeId.COLUMNS_PERMUTED, "columns")):
        lines_a, lines_b = (a, b) if axis == "rows" else (a.t(), b.t())
        read = moved_order(lines_a, lines_b)
        if read is None:
            continue
        order, cosines, reference = read
        moved = (order != torch.arange(order.numel())).nonzero().flatten().tolist()
        one = axis[:-1]
        pairs = ", ".join(f"B's {one} {i} is A's {one} {int(order[i])} (cosine {float(cosines[i]):.3f})"
                          for i in moved[:SHOWN])
        detail = (f"{len(moved)} of its {order.numel()} {axis} are A's in another order ({pairs}"
                  f"{', ...' if len(moved) > SHOWN else ''}; {axis} in place: median cosine {reference:.3f})")
        value = lines_a[order] if axis == "rows" else lines_a[order].t()
        found.append((mistake, detail, value.contiguous()))
    return found
