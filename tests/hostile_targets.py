"""Targets that misbehave in ways a green light must not hide (for tests/test_trust.py)."""

import sys

import torch
import torch.nn.functional as F

from parity.ffn import SwiGLU


class ZeroesInput(SwiGLU):
    """Computes on its input, then wipes it: the caller's residual stream would be lost."""

    def forward(self, x):
        out = super().forward(x)
        x.zero_()
        return out


class ClampsInput(SwiGLU):
    """Clamps its input in place before computing: passed when the reference saw the clamped input."""

    def forward(self, x):
        x.clamp_(-0.25, 0.25)
        return super().forward(x)


class InplaceSiLU(SwiGLU):
    """F.silu(x, inplace=True) on the input: a real porting bug."""

    def forward(self, x):
        out = super().forward(x.clone())
        F.silu(x, inplace=True)
        return out


class NaNOutput(SwiGLU):
    """Correct but for one NaN, the same in every run."""

    def forward(self, x):
        out = super().forward(x).clone()
        out[0, 2, 7] = float("nan")
        return out


class InfOutput(SwiGLU):
    def forward(self, x):
        out = super().forward(x).clone()
        out[1, 0, 3] = float("inf")
        return out


class ExitsInForward(SwiGLU):
    def forward(self, x):
        sys.exit(0)


class ExitsInInit(SwiGLU):
    def __init__(self, *args, **kwargs):
        sys.exit(0)


class InterruptedInForward(SwiGLU):
    """Stands in for Ctrl-C during a long check."""

    def forward(self, x):
        raise KeyboardInterrupt


class AllZeros(SwiGLU):
    """Computes zero whatever the weights."""

    def forward(self, x):
        return torch.zeros_like(x)
