"""What B's values and config show, named without a replay (``parity compare``): values beyond what their storage
allows (quantization_exceeds_step, value_corrupted), defects of B's quantized blocks read from its file
(nonfinite_scale, zeroed_tensor), a matrix's rows or columns in another order (rows_permuted,
columns_permuted), a grid coarser than the format's quantizer makes of A (grid_too_coarse), and
whether two configured activations are one function.  ``comparison`` decides when each is asked; this
module words them, with their evidence, from the per-tensor rows it made (``tensor_rows``)."""

from __future__ import annotations

import math

import torch

from parity.definitions.mistakes import MistakeId, diagnosis
from parity.definitions.records import Candidate, Diagnosis
from parity.engine.compare import codebook_grid, fp4_grid, fp8_grid, gguf_grid, group_grid, mlx_grid, permutation
from parity.engine.compare.conversion import STEP_SLACK, Storage, step_excess, stored_layout, unstored

ACTIVATION_GRID = (-20.0, 20.0, 4001)  # where two activations are compared, in float64
SAME_FUNCTION = 1e-9  # two activations agreeing within this (relative to their largest output) are one function


def activations_differ(name_a: str | None, name_b: str | None) -> str | None:
    """How two configured activation names differ as functions (None: they are one function): each resolved through
    transformers' ACT2FN and evaluated in float64 on ``ACTIVATION_GRID``; a name ACT2FN does not know differs by
    its name.  Two classes can compute one function (SiLU as "silu" and as "swish"), hence the evaluation."""
    from transformers.activations import ACT2FN

    try:
        fn_a, fn_b = ACT2FN[name_a], ACT2FN[name_b]
    except KeyError as exc:
        return f"{exc.args[0]!r} is no activation transformers knows"
    z = torch.linspace(*ACTIVATION_GRID[:2], ACTIVATION_GRID[2], dtype=torch.float64)
    try:
        with torch.no_grad():
            out_a, out_b = fn_a(z), fn_b(z)
    except Exception:  # an activation that cannot run on a float64 vector: judged by its class
        if type(fn_a) is type(fn_b):
            return None
        return f"transformers runs {type(fn_b).__name__} for it, {type(fn_a).__name__} for A's"
    gap = float((out_a - out_b).abs().max())
    scale = max(1.0, float(out_a.abs().max()))
    if gap <= SAME_FUNCTION * scale:
        return None
    worst = float(z[(out_a - out_b).abs().argmax()])
    return (f"transformers' {type(fn_b).__name__} against {type(fn_a).__name__}: they differ by up to {gap:.3g} "
            f"at z = {worst:.3g}")


def beyond_finding(beyond: list[dict], reference_distance: float, candidates: list[Candidate]) -> Diagnosis:
    """Values of B beyond what their storage allows, no replay explaining them: quantized values beyond their step
    (quantization_exceeds_step), else a cast's or re-save's values beyond one ulp of A's cast (value_corrupted)."""
    stepped = [row for row in beyond if (row.get("steps") or {}).get("values_beyond_step")]
    if stepped:
        detail = "; ".join(f"{row['name']} ({row['storage']}, step from the {row['step_source']}): "
                           f"{row['steps']['values_beyond_step']} values beyond what it allows, worst "
                           f"{row['steps']['max_steps']:.2f} steps at {row['steps']['at']}"
                           f"{allowance(row['steps'])}" for row in stepped)
        return diagnosis(MistakeId.QUANTIZATION_EXCEEDS_STEP, None, reference_distance, detail, candidates)
    detail = "; ".join(f"{row['name']} ({row['a_dtype']} -> {row['storage']}): {row['ulps']['values_beyond_ulp']} of "
                       f"its values beyond one ulp of A's value cast to {row['storage']}, worst at index "
                       f"{row['ulps']['at']}: {row['ulps']['max_ulps']:.4g} ulps (B holds {row['ulps']['b']:.6g}, "
                       f"the cast of A's value is {row['ulps']['a_cast']:.6g})" for row in beyond)
    return diagnosis(MistakeId.VALUE_CORRUPTED, None, reference_distance, detail, candidates)


def allowance(steps: dict) -> str:
    """' (it allows 0.50 steps there)': the worst value's own allowance where it is not one step, and why where it
    is none (a biased group's values: 'beyond one step, worst 0.90 steps' read as a contradiction)."""
    room = steps.get("allowed_steps", 1.0)
    if room == 0:  # only integer groups are held to no move (conversion.quantized_bounds)
        return (" (no value of it is allowed its step: its codes are biased against A's, on no grid of A's or "
                "mostly moved off A's rounding, which no faithful export shows)")
    return "" if 1.0 <= room <= STEP_SLACK else f" (it allows {room:.2f} steps there)"


def named_in_b(row: dict, storage: dict[str, Storage]) -> str:
    """'up_proj.weight (B's blk.1.ffn_up.weight, Q4_K)': a tensor under transformers' name and B's own."""
    store = storage[row["name"]]
    return f"{row['name']} (B's {store.route.source if store.route else row['name']}, {row['storage']})"


def block_finding(rows: list[dict], storage: dict[str, Storage], reference_distance: float | None
                  ) -> Diagnosis | None:
    """A defect of B's quantized blocks that no conversion makes, read from its file: a NaN/Inf block scale
    (nonfinite_scale), every code zero while A's values are not the blocks' minima (zeroed_tensor)."""
    for row in rows:
        store = storage[row["name"]]
        where = named_in_b(row, storage)
        steps, grid = row.get("steps") or {}, row.get("grid")
        if store.nonfinite_scale is not None and row["overflow"]:
            return diagnosis(MistakeId.NONFINITE_SCALE, None, None, f"{where}: {store.nonfinite_scale}")
        if store.zeroed and (steps.get("values_beyond_step") or grid is not None):
            return diagnosis(MistakeId.ZEROED_TENSOR, None, reference_distance,
                             f"{where}: every code is zero; {steps.get('values_beyond_step', 0)} values lie beyond "
                             f"their step from A's, worst {steps.get('max_steps', math.nan):.3g} steps at "
                             f"{steps.get('at')}")
    return None


def outside(factor: float, bounds: list[float]) -> bool:
    return not bounds[0] <= factor <= bounds[1]


def beyond_on_a(found: dict) -> bool:
    """Whether a ``scale`` record's tensor, row or block lies outside its bounds on A itself (not only on A's
    conversion)."""
    return outside(found["tensor"], found["bounds"]) or outside(found["row"], found["bounds"]) or outside(
        found["block"], found["block_bounds"])


def constant_factor(row: dict) -> bool:
    """Whether B is A's conversion and A itself times one factor (within 2 %), which also makes its grid that many
    times coarser (its worst block's ``times_coarser`` within 1.25 x of it, where it has one): a tensor multiplied."""
    found, coarser = row["scale"], row["grid"].get("times_coarser", math.nan)
    factor = found.get("converted")
    if not factor or factor <= 0 or abs(found["tensor"] / factor - 1) > 0.02:
        return False
    # a grid with no step to compare (A's own calls for none: its scales underflowed) says nothing against it
    return not (coarser > 0 and math.isfinite(coarser)) or abs(math.log(coarser / factor)) <= math.log(1.25)


def whole_factor(found: dict, by: str = "") -> str | None:
    """How a ``scale`` record's tensor as a whole lies outside its bounds (``by``: the quantizer whose refit keeps
    them), in words; None where it does not."""
    low, high = found["bounds"]
    if outside(found["tensor"], found["bounds"]):
        how = f"x {found['tensor']:.4g} (least squares over the tensor"
    elif "converted" in found and outside(found["converted"], found["converted_bounds"]):
        low, high = found["converted_bounds"]
        how = (f"x {found['converted']:.4g} over A's conversion (least squares of B on A as a faithful export holds "
               f"it; over A itself x {found['tensor']:.4g}")
    else:
        return None
    return f"{how}; {by} keeps it within {low:g} to {high:g})"


def scale_finding(rows: list[dict], storage: dict[str, Storage], reference_distance: float,
                  candidates: list[Candidate]) -> Diagnosis | None:
    """A tensor whose quantizer moves values by more than a step but refits each block's scale to A's values (an
    importance-weighted GGUF type, ``gguf_grid.importance_scales``; integer groups, ``group_grid.value_scales``) and
    whose least-squares factor on A lies outside what that refit makes: the whole tensor (tensor_scaled; sign_flipped
    near -1), else a row or a block of it (quantization_exceeds_step: values moved together, not by quantization);
    None when none is."""
    # a grid coarser than A's values need (grid_finding) moves B off A's conversion too, but by no factor of its own
    # grid's: that is no tensor multiplied (an NVFP4 global scale x 6 is, and coarsens every block 6.55 x)
    scaled = [row for row in rows if (row.get("scale") or {}).get("beyond") and (
        not row.get("grid") or beyond_on_a(row["scale"]) or constant_factor(row))]
    if not scaled:
        return None
    whole = [row for row in scaled if whole_factor(row["scale"])]
    if whole:
        flipped = all(abs(row["scale"]["tensor"] + 1) < 0.1 for row in whole)
        detail = "; ".join(f"{named_in_b(row, storage)} is A's {whole_factor(row['scale'], refitting(row, storage))}"
                           for row in whole)
        return diagnosis(MistakeId.SIGN_FLIPPED if flipped else MistakeId.TENSOR_SCALED, None, reference_distance,
                         detail, candidates)
    details = []
    for row in scaled:
        found = row["scale"]
        if outside(found["row"], found["bounds"]):
            details.append(f"{named_in_b(row, storage)}: row {found['worst_row']} (as the file stores it) is A's x "
                           f"{found['row']:.4g} (least squares; {refitting(row, storage)} keeps each row within "
                           f"{found['bounds'][0]:g} to {found['bounds'][1]:g})")
        else:
            group, low, high = found["block_values"], *found["block_bounds"]
            details.append(f"{named_in_b(row, storage)}: the block of values {found['worst_block'] * group}-"
                           f"{found['worst_block'] * group + group - 1} (flattened, as the file stores them) is A's x "
                           f"{found['block']:.4g} (least squares; {refitting(row, storage)} refits each block's "
                           f"scale to A's values, within {low:g} to {high:g})")
    return diagnosis(MistakeId.QUANTIZATION_EXCEEDS_STEP, None, reference_distance, "; ".join(details), candidates)


def refitting(row: dict, storage: dict[str, Storage]) -> str:
    """The quantizer whose refit a ``scale`` record's bounds were measured on, in words."""
    store = storage[row["name"]]
    if store.importance is not None:
        return "an importance-weighted quantizer"
    if store.nearest:
        return "round to nearest on its " + ("microscaled groups" if store.microscaled else
                                             "groups" if store.wide_steps else "blocks")
    return "AWQ's clip search" if store.group is not None and group_grid.by_awq(store.group) else "GPTQ"


def grid_finding(rows: list[dict], storage: dict[str, Storage], reference_distance: float,
                 candidates: list[Candidate]) -> Diagnosis | None:
    """B's blocks on a coarser grid than the format's own quantizer chooses for A's values (grid_too_coarse): every
    such tensor, with its worst block, or None."""
    coarse = [row for row in rows if row.get("grid")]
    if not coarse:
        return None
    details = []
    for row in coarse:
        grid = row["grid"]
        if "every" in grid:  # one level in k used throughout a row (gguf_grid.skipped_levels), d unchanged
            details.append(f"{named_in_b(row, storage)}: {grid['rows_skipping']} of {grid['rows']} rows hold their "
                           f"codes on one level in {grid['every']} of their blocks' grids; the worst, row "
                           f"{grid['row']} (as the file stores it), has {grid['share']:.0%} of each block's codes on "
                           f"one residue mod {grid['every']} (a quantizer rounding to the nearest level leaves about "
                           f"{1 / grid['every'] + 0.07:.0%}): a grid {grid['every']} x as coarse as its step")
            continue
        if "levels_skipped" in grid:  # integer groups: a row's codes on one level in k (group_grid.skipped_levels)
            k = grid["one_in"]
            levels = "every other level" if k == 2 else f"one level in {k} left empty"
            details.append(f"{named_in_b(row, storage)}: {grid['levels_skipped']} of {grid['rows']} rows hold their "
                           f"codes on {levels} of their grid; the worst, row {grid['row']} (as the file stores it), "
                           f"holds {grid['b_count']} of its {grid['codes']} codes at a distance from the zero point "
                           f"of {grid['residue']} mod {k}, where A's values rounded to nearest on the same grid put "
                           f"{grid['a_count']} there: a grid {k} x as coarse as its scales state, each value within a "
                           "step of A's")
            continue
        if "rows_too_coarse" in grid:  # integer groups: a row's codes reaching part of its range (group_grid)
            every = grid["rows_too_coarse"] == grid["rows"]
            details.append(f"{named_in_b(row, storage)}: {grid['rows_too_coarse']} of {grid['rows']} rows hold codes "
                           f"reaching less than {group_grid.REACH:.0%} of their group's longer side in every group; "
                           f"the worst, row {grid['row']} (as the file stores it), reaches {grid['reach']:.3g} of "
                           f"{grid['top']:g} codes from its zero point in group {grid['group']} ({grid['columns']} "
                           f"columns): its scale {grid['b_step']:.4g} is "
                           f"{grid['top'] / max(grid['reach'], 1e-30):.2f}x what its own codes need (a quantizer picks "
                           f"each group's scale from its values, so the largest lands at the end), where A's "
                           f"values there call for {grid['a_step']:.4g} by min-max"
                           + (" (every row: a scale chosen for fewer bits than the codes hold)" if every else ""))
            continue
        if "reach" in grid:  # codes reaching part of the block's grid (gguf_grid.short_reach)
            details.append(f"{named_in_b(row, storage)}: {grid['blocks_too_coarse']} of {grid['blocks']} blocks "
                           f"hold codes reaching less than {gguf_grid.REACH:.0%} of their grid; the worst, block "
                           f"{grid['worst_block']} (row {grid['row']}, values {grid['values'][0]}-{grid['values'][1]} "
                           f"as the file stores them), reaches {grid['reach']:.3g} of {grid['top']}: its step "
                           f"{grid['b_step']:.4g} is {grid['top'] / max(grid['reach'], 1e-30):.2f}x what its own "
                           f"values need (a quantizer picks d from the block's largest value, so its codes reach the "
                           f"top), where A's values there call for {grid['a_step']:.4g}")
            continue
        details.append(f"{named_in_b(row, storage)}: {grid['blocks_too_coarse']} of {grid['blocks']} blocks; the "
                       f"worst, block {grid['worst_block']} (row {grid['row']}, values {grid['values'][0]}-"
                       f"{grid['values'][1]} as the file stores them), has step {grid['b_step']:.4g} where A's values "
                       f"there call for {grid['a_step']:.4g} ({grid['times_coarser']:.2f}x; a quantizer of the format "
                       f"chooses at most {grid['limit']:.4g})")
    return diagnosis(MistakeId.GRID_TOO_COARSE, None, reference_distance, "; ".join(details), candidates)


def block_replay_finding(beyond: list[dict], a: dict[str, torch.Tensor], b: dict[str, torch.Tensor],
                         storage: dict[str, Storage], reference_distance: float, candidates: list[Candidate]
                         ) -> Diagnosis | None:
    """Values of an FP8 block-quantized (bitsandbytes 4-bit, MLX, FP4) tensor beyond their step from A's, every one of
    them within its step of a conversion mistake replayed on A's tensor (``fp8_grid.mistakes``, ``codebook_grid``'s,
    ``mlx_grid``'s, ``fp4_grid``'s): that mistake, with the counts as evidence.  Judged value by value, since a
    mistake confined to the partial edge blocks (blocks of another size) may move the layer's function less than FP8
    itself does."""
    for row in beyond:
        name, store = row["name"], storage[row["name"]]
        stored = stored_layout(store.route, a[name].float())
        if store.fp4 is not None:  # FP4 groups: replayed in the reference's layout
            found = fp4_grid.mistakes(a[name].float(), store.fp4)
        elif store.mlx is not None and stored is not None:  # MLX: its own replays
            found = mlx_grid.replays(stored, store.mlx, lambda t, s=store: unstored(s.route, t))
        elif (store.block is None and store.codebook is None) or stored is None or stored.dim() != 2:
            continue
        else:
            found = (fp8_grid.replays(stored, store.block, lambda t, s=store: unstored(s.route, t),
                                      power_of_two=store.power_of_two, scale_dtype=store.scale_dtype)
                     if store.block is not None
                     else codebook_grid.replays(stored, store.codebook, lambda t, s=store: unstored(s.route, t)))
        for mistake, detail, values in found:
            excess = step_excess(values, b[name].float(), store.steps)
            candidates.append(Candidate(mistake, f"{name}: {detail}", excess["max_steps"]))
            if excess["values_beyond_step"] == 0:
                from_a = row["steps"]
                return diagnosis(mistake, None, reference_distance,
                                 f"{named_in_b(row, storage)}: {detail}: every value of B lies within its step of this "
                                 f"replay on A's (worst {excess['max_steps']:.2f} steps), where "
                                 f"{from_a['values_beyond_step']} lie beyond their step from A's own (worst "
                                 f"{from_a['max_steps']:.2f} steps at {from_a['at']})", candidates)
    return None


def permutation_finding(beyond: list[dict], a: dict[str, torch.Tensor], b: dict[str, torch.Tensor],
                        storage: dict[str, Storage], reference_distance: float, candidates: list[Candidate]
                        ) -> Diagnosis | None:
    """Values of a matrix beyond what its storage allows, where its rows (or columns) are A's in another order
    (``permutation``): named with the rows matched and their cosines as evidence, in any storage.  Judged on the
    values, since two rows exchanged may move the layer's function less than the storage's own rounding does, and
    a format whose scales stayed in place (codes exchanged alone) is no value-exact replay of A's order."""
    for row in beyond:
        name = row["name"]
        for mistake, detail, _ in permutation.permutations(a[name], b[name]):
            return diagnosis(mistake, None, reference_distance, f"{named_in_b(row, storage)}: {detail}", candidates)
    return None


def group_replay_finding(beyond: list[dict], a: dict[str, torch.Tensor], b: dict[str, torch.Tensor],
                         storage: dict[str, Storage], reference_distance: float, candidates: list[Candidate]
                         ) -> Diagnosis | None:
    """An integer group-quantized tensor whose values are biased (their mean signed distance from round-to-nearest
    on B's grid beyond ``group_grid.BIAS_LIMIT`` steps, which no faithful export shows) and unbiased against a
    conversion mistake replayed on A's tensor (``group_grid.mistakes``): that mistake, with both means as evidence.
    Judged on the values, since a zero point one code off may move the function less than GPTQ's own error does."""
    for row in beyond:
        name, store = row["name"], storage[row["name"]]
        x = stored_layout(store.route, a[name].float())
        if store.group is None or x is None or x.dim() != 2:
            continue
        held = stored_layout(store.route, b[name].float())
        from_a = group_grid.bias(x, held, store.group)
        if abs(from_a) <= group_grid.BIAS_LIMIT:  # beyond its bound for its grid, no grid of A's: by codes moved
            found = rough_replay(name, row, x, held, store, storage, reference_distance, candidates)
            if found is not None:
                return found
            continue
        for mistake, detail, values in group_grid.mistakes(x, store.group):
            off = group_grid.bias(x, held, store.group, reference=values)
            candidates.append(Candidate(mistake, f"{name}: {detail}", abs(off)))
            if abs(off) <= group_grid.BIAS_LIMIT / 2:
                return diagnosis(mistake, None, reference_distance,
                                 f"{named_in_b(row, storage)}: {detail}: B's values lie {from_a:+.2f} steps on "
                                 f"average from A rounded to nearest on B's grid, {off:+.2f} from this replay",
                                 candidates)
    return None


def rough_replay(name: str, row: dict, x: torch.Tensor, held: torch.Tensor, store: Storage,
                 storage: dict[str, Storage], reference_distance: float, candidates: list[Candidate]
                 ) -> Diagnosis | None:
    """An integer group-quantized tensor on a grid that is no grid of A's (``group_grid.roughness`` beyond SOUND):
    the conversion mistake replayed on A's tensor whose codes B's reproduce, at most half as many of B's codes
    differing from it as from A rounded to nearest on B's grid (GPTQ's own compensation moves 5 to 30 %)."""
    grid = store.group
    own = group_grid.moved(held, group_grid.round_to(x, grid), grid)
    rough = group_grid.roughness(x, grid)
    for mistake, detail, values in group_grid.mistakes(x, grid):
        share = group_grid.moved(held, values, grid)
        candidates.append(Candidate(mistake, f"{name}: {detail}", share))
        if share <= own / 2:
            return diagnosis(mistake, None, reference_distance,
                             f"{named_in_b(row, storage)}: {detail}: B's grid rounds A's values {rough:.2f} x worse "
                             f"(root mean square) than min-max in its groups, so it is no grid of A's; {own:.0%} of "
                             f"B's codes differ from A rounded to nearest on it, {share:.0%} from this replay",
                             candidates)
    return None
