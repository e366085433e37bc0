"""Where in the user's code a failure happened: the line a TargetError points at.  A leaf: imports nothing of
parity, so both building and running the target use it without lengthening the import chain."""

from __future__ import annotations

import os
import traceback

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # parity/


def user_frame(error: BaseException) -> str:
    """' (at mymodel.py:42, in forward)': the innermost frame of the traceback in the user's own code (not parity,
    torch or another installed library), so a TargetError points at the line to fix; '' when there is none."""
    found = None
    for frame in traceback.extract_tb(error.__traceback__):
        name = os.path.abspath(frame.filename)
        if name.startswith(PACKAGE_DIR) or "site-packages" in name or "dist-packages" in name or name.startswith("<"):
            continue
        found = frame
    return f" (at {found.filename}:{found.lineno}, in {found.name})" if found is not None else ""
