"""AWQ's folded activation scales, read and undone before B's FFN is judged (``parity compare``).

AWQ (AutoAWQ's ``scale_ln_fcs`` and ``scale_fc_fc``, llm-compressor's AWQModifier) multiplies each input channel of
the FFN's first projections by a scale s and divides the norm before them by it; and it divides each output row of
the up projection by s2 and multiplies the matching input column of the down projection by it.  Norm plus FFN compute
what they did, but the FFN alone computes another function of its own input, so a compare of the FFN on A's input
would call a genuine export broken.  Here the scales are read from the checkpoints: s from the norm weights (A's over
B's: the norm is the only place they are stored), s2 per intermediate channel as the least-squares factor of B's up
row on A's.  B's tensors are then put back on A's input (its first projections' columns divided by s, up's rows
times s2 and down's columns divided by s2) together with each value's grid (step times the same factor): B's FFN on
A's input is exactly norm plus FFN of B, whatever s2's estimate, since up's rows and down's columns move together.
"""

from __future__ import annotations

import dataclasses
import math

import torch

# A norm fold is read when A's and B's norm weights differ relatively by more than this (a bfloat16 round trip moves
# them by 2^-8 at most); s2 is undone with it (AWQ folds both, AutoAWQ and llm-compressor alike), or where up and down
# carry it together (``carries_s2``): a least-squares factor of up's rows alone would be read off a quantization
# error, such as a zero point one off.
NORM_DIFFERS = 2.0 ** -7
# the norm before the FFN, by the names transformers' decoder layers give it (LLaMA / Qwen2 / Mistral; Gemma 2 and 3)
FFN_NORMS = ("pre_feedforward_layernorm", "post_attention_layernorm")


def norm_offset(config) -> float:
    """What transformers' RMSNorm of this model adds to its weight (Gemma: 1, ``x * (1 + w)``; LLaMA: 0), asked of
    its own class: the norm built with a zero weight, run on ones.  The modeling module is the one transformers' auto
    mapping names for the model_type (gemma3_text's classes live in transformers.models.gemma3)."""
    import importlib

    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    kind = getattr(config, "model_type", "")
    try:
        named = MODEL_MAPPING_NAMES.get(kind)
        module = (importlib.import_module(getattr(transformers, named).__module__) if named
                  else importlib.import_module(f"transformers.models.{kind}.modeling_{kind}"))
    except (ImportError, AttributeError):
        return 0.0
    norms = [getattr(module, n) for n in dir(module) if n.endswith("RMSNorm") and isinstance(getattr(module, n), type)]
    if not norms:
        return 0.0
    try:
        norm = norms[0](4)
        with torch.no_grad():
            norm.weight.zero_()
            return float(norm(torch.ones(1, 4)).mean())
    except Exception:  # a norm class of another signature: read as LLaMA's
        return 0.0


def norm_scales(a_side, b_side, layer: int) -> tuple[torch.Tensor, str] | None:
    """s per hidden channel (A's norm weight over B's, with the model's offset) and the norm's name, where B's norm
    before the FFN differs from A's; None where they agree or no such norm is stored."""
    prefix = a_side.reader.layer_prefix(layer).rstrip(".").rsplit(".", 1)[0] + "."
    for norm in FFN_NORMS:
        name = f"{prefix}{norm}.weight"
        if not (a_side.checkpoint.has(name) and b_side.checkpoint.has(name)):
            continue
        wa = a_side.checkpoint.read([name])[name].double()
        wb = b_side.checkpoint.read([name])[name].double()
        offset = norm_offset(a_side.config)
        wa, wb = wa + offset, wb + offset
        if wa.shape != wb.shape or float((wa - wb).abs().max()) <= NORM_DIFFERS * float(wa.abs().max()):
            return None
        safe = torch.where(wb != 0, wb, torch.ones_like(wb))
        return torch.where(wb != 0, wa / safe, torch.ones_like(wa)).float(), name
    return None


def roles(names) -> dict[str, str]:
    """gate / up / down of each tensor name of the layer (transformers' names; aliases.toml's roles)."""
    from parity.definitions.aliases import load_aliases

    found = {}
    for name in names:
        kinds = {role for role, kind in load_aliases().roles_of(name) if kind == "weight"}
        for role in ("gate", "up", "down"):
            if role in kinds:
                found[name] = role
                break
    return found


def rescale(side, name: str, factor: torch.Tensor) -> None:
    """B's tensor ``name`` (reference layout) and its grid multiplied by ``factor`` (broadcast over it)."""
    side.routed[name] = side.routed[name].float() * factor
    store = side.storage[name]
    grid = store.group  # undo() reads only tensors stored as the reference holds them: the grid is in that layout
    if grid is not None:
        grid = dataclasses.replace(grid, steps=grid.steps * factor, factor=grid.factor * factor)
    side.storage[name] = dataclasses.replace(store, steps=store.steps * factor.abs(), group=grid)


FOLD_AGREEMENT = 0.1  # the FFN's input columns must carry the norm's s: median |column ratio / s - 1| at most this


def carried(folded, a, b, named: dict) -> tuple | None:
    """``folded`` (s, the norm) where B's gate or up input columns are A's times s, as AWQ's fold makes them (int4
    rounding moves a column's least-squares ratio by well under 10 %); None where they are not: a norm that changed
    alone (a B whose FFN is A's, quantized by GPTQ or round-to-nearest) is outside the FFN and not undone in it."""
    if folded is None:
        return None
    s = folded[0].double()
    inputs = [n for n, role in named.items() if role in ("gate", "up")]
    # each of B's gate and up against A's gate and up: gate and up exchanged in B still carry the fold (the compare is
    # then to name the exchange on A's input, not to judge B's folded tensors as they are)
    for name, other in ((n, m) for n in inputs for m in inputs):
        shape = b.routed[name].shape
        if shape == a.routed[other].shape and shape[1] == s.numel():
            x, y = a.routed[other].double(), b.routed[name].double()
            ratio = (x * y).sum(0) / (x * x).sum(0).clamp_min(1e-300)
            relative = ratio / s
            shaped = relative / relative.median()  # up's rows also carry 1 / s2: its columns follow s up to a constant
            varies = float(s.max() / s.min().clamp_min(1e-300)) > 1 + FOLD_AGREEMENT
            if (float((relative - 1).abs().median()) <= FOLD_AGREEMENT
                    or (varies and float((shaped - 1).abs().median()) <= FOLD_AGREEMENT)):
                return folded  # one is enough: the other may be the broken tensor the compare is to name
    return None


UNRELATED = 0.5  # median cosine of A's and B's up rows below which B's up is not A's up (gate and up exchanged)


def least_squares(x: torch.Tensor, y: torch.Tensor, dim: int) -> torch.Tensor:
    """Per slice along ``dim``, the factor c minimising |x - c y|: A's over B's (1 where B's slice is zero)."""
    denominator = (y * y).sum(dim)
    return torch.where(denominator > 0, (x * y).sum(dim) / denominator.clamp_min(1e-300), 1.0)


def second_scales(up_a, up_b, down_a, down_b) -> torch.Tensor:
    """s2 per intermediate channel: the least-squares factor of B's up row on A's; where B's up rows are not A's at
    all (median cosine under UNRELATED: gate and up exchanged), from down's columns instead (B's column is A's times
    s2), so that the fold is undone on the tensors that carry it and the exchange is what remains to be named."""
    up_a, up_b = up_a.double(), up_b.double()
    cosine = (up_a * up_b).sum(1) / (up_a.norm(dim=1) * up_b.norm(dim=1)).clamp_min(1e-300)
    if float(cosine.median()) >= UNRELATED or down_a.shape != down_b.shape:
        return least_squares(up_a, up_b, 1).float()
    inverse = least_squares(down_a.double(), down_b.double(), 0)
    return torch.where(inverse != 0, 1.0 / inverse, 1.0).float()


# s2 is also undone without a norm fold where B's up rows and down columns carry one factor and its inverse (the
# logs of the two least-squares estimates correlate at least this much) and it moves the typical channel by more than
# rounding does (median |log s2| at least S2_SPREAD): llm-compressor 0.14's AWQ export of the Qwen2.5 0.5B stand-in
# kept layer 0's norm (s = 1) and folded s2 from 0.24 to 4.1 (correlation 0.994-0.998, median |log| 0.35-0.45, every
# layer); a GPTQ export of it: correlation -0.01 to 0, median |log| 0.01.  A mistake in up or down alone (a zero point
# one off, a tensor scaled) moves one of the two, not both.
S2_CORRELATION = 0.9
S2_SPREAD = 0.05


def carries_s2(up_a, up_b, down_a, down_b) -> bool:
    """Whether B's up rows are A's divided by some s2 and B's down columns A's times the same s2 (AWQ's scale_fc_fc),
    s2 beyond rounding: a fold of its own, where the norm shows none."""
    if up_a.shape != up_b.shape or down_a.shape != down_b.shape or down_a.shape[1] != up_a.shape[0]:
        return False
    from_up = least_squares(up_a.double(), up_b.double(), 1)
    from_down = least_squares(down_a.double(), down_b.double(), 0)
    if not bool((from_up > 0).all() and (from_down > 0).all()):
        return False
    logs = torch.stack([from_up.log(), -from_down.log()])
    spread = float(logs[0].abs().median())
    return spread >= S2_SPREAD and float(torch.corrcoef(logs)[0, 1]) >= S2_CORRELATION


def undo(a_side, b_side, layer: int, a, b) -> str | None:
    """B's FFN put back on A's input where AWQ's scales are folded into it (in place: ``b``'s tensors and grids);
    what was undone, in words, or None."""
    if not any(getattr(s, "group", None) is not None for s in b.storage.values()):
        return None
    named = roles(b.routed)
    if any(b.routed[n].dim() != 2 or b.storage[n].route is None or b.storage[n].route.chunk is not None
           or b.storage[n].route.transform == "transpose" for n in named):
        return None  # fused or transposed tensors: not folded by AWQ's known mappings
    if any(n not in a.routed or a.routed[n].shape != b.routed[n].shape for n in named):
        return None  # B's tensors of other shapes than A's: the layer's shape finding says so
    said = []
    folded = carried(norm_scales(a_side, b_side, layer), a, b, named)
    if folded is not None:
        s, norm = folded
        for name, role in named.items():
            if role in ("gate", "up") and b.routed[name].shape[1] == s.numel():
                rescale(b, name, 1.0 / s[None, :])
        said.append(f"{norm} divided by s (from {float(s.min()):.3g} to {float(s.max()):.3g}), the FFN's input "
                    "columns multiplied by it")
    ups = [n for n, r in named.items() if r == "up"]
    downs = [n for n, r in named.items() if r == "down"]
    if len(ups) == 1 and len(downs) == 1 and b.routed[ups[0]].shape == a.routed[ups[0]].shape:
        c = second_scales(a.routed[ups[0]], b.routed[ups[0]], a.routed[downs[0]], b.routed[downs[0]])
        spread = float(c.clamp_min(1e-30).log().abs().max())
        # s2 only where up's rows and down's columns carry it together: a norm fold alone (SmoothQuant's, which
        # scales gate and up only) says nothing of it, and undoing one there hid a row's scale doubled in up
        paired = carries_s2(a.routed[ups[0]], b.routed[ups[0]], a.routed[downs[0]], b.routed[downs[0]])
        if paired and math.isfinite(spread):
            rescale(b, ups[0], c[:, None])
            rescale(b, downs[0], 1.0 / c[None, :])
            said.append(f"up's rows divided by s2 and down's columns multiplied by it (s2 from {float(c.min()):.3g} "
                        f"to {float(c.max()):.3g})")
    text = "; ".join(said) or None
    for name, store in list(b.storage.items()):
        if text and store.group is not None and not isinstance(store.group.factor, float):
            b.storage[name] = dataclasses.replace(store, group=dataclasses.replace(store.group, fold=text))
    return text
