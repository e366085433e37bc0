"""Where parity keeps what it made or fetched: ``$PARITY_CACHE``, else ``~/.cache/parity``
(``$XDG_CACHE_HOME/parity``).  Never the user's checkpoint folder."""

from __future__ import annotations

import os
from pathlib import Path


def parity_cache(kind: str) -> Path:
    """``synthetic`` (stand-in checkpoints) or ``ranges`` (tensors read by byte range from the hub)."""
    base = os.environ.get("PARITY_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "parity")
    return Path(base).expanduser() / kind
