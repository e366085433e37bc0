"""parity: prove a feed-forward module computes what transformers computes on the same checkpoint weights."""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["check", "compare", "load_ffn", "render", "render_html", "__version__"]


def __getattr__(name: str):
    # Lazy: `parity --help` / `parity list` must not import torch or transformers.
    if name in ("check", "compare", "load_ffn", "render", "render_html"):
        from parity import api

        return getattr(api, name)
    raise AttributeError(f"module 'parity' has no attribute {name!r}")
