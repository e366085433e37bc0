"""A fused gate/up tensor's two layouts: the halves [gate; up] (most families) and interleaved rows, gate at 0::2
and up at 1::2 (GPT-OSS).  Kept apart from engine.experts, which builds transformers' expert modules, because the
replays of a layout read wrongly (per expert, a streamed block's, a compare's) need only these two rearrangements.
"""

from __future__ import annotations

import torch


def interleave_rows(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """Their rows alternating, first's at 0::2 and second's at 1::2: how GPT-OSS's gate_up_proj holds gate and up."""
    return torch.stack([first, second], dim=1).flatten(0, 1)


def layout_misread(tensors: dict[str, torch.Tensor], *, stored_interleaved: bool) -> dict[str, torch.Tensor]:
    """One expert's gate and up (parity's roles, [units, d], and their biases) as a port reading their fused tensor
    in the other layout gets them: GPT-OSS's interleaved rows taken as halves (``stored_interleaved``), or the
    halves [gate; up] taken as alternate rows.  The per-expert check's replay (engine.check.diagnose) and a
    streamed block's (engine.routing_replays) both build the mistake from it."""
    out = dict(tensors)
    for gate, up in (("gate", "up"), ("gate_bias", "up_bias")):
        if gate in tensors and up in tensors:
            if stored_interleaved:
                out[gate], out[up] = interleave_rows(tensors[gate], tensors[up]).chunk(2, dim=0)
            else:
                fused = torch.cat([tensors[gate], tensors[up]], dim=0)
                out[gate], out[up] = fused[0::2], fused[1::2]
    return out
