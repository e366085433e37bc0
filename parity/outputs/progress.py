"""A progress bar for multi-layer sweeps, on stderr, only where a person watches.

Off when stderr is not a terminal (CI logs would fill with carriage returns), under
--quiet, and with --json - (stdout is then the report and the table goes to stderr).
Lines printed while the bar runs go through the bar so they do not tear it.
"""

from __future__ import annotations

import sys
from typing import TextIO


def bar_wanted(quiet: bool, json_to_stdout: bool, stream: TextIO | None = None) -> bool:
    stream = stream if stream is not None else sys.stderr
    return not quiet and not json_to_stdout and bool(getattr(stream, "isatty", lambda: False)())


def silence_downloads() -> None:
    """huggingface_hub draws its own download bars; --quiet means none."""
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()


class Progress:
    """Counts checked layers; a no-op when disabled or when there is at most one layer."""

    def __init__(self, total: int, enabled: bool):
        self.bar = None
        if enabled and total > 1:
            from tqdm import tqdm

            self.bar = tqdm(total=total, file=sys.stderr, unit="layer", leave=False, dynamic_ncols=True,
                             mininterval=0)  # one update per layer: slow enough to draw each

    def say(self, text: str, file: TextIO | None = None) -> None:
        file = file if file is not None else sys.stdout
        if self.bar is not None:
            self.bar.write(text, file=file)
        else:
            print(text, file=file)

    def step(self, label: str) -> None:
        if self.bar is not None:
            self.bar.set_description(label, refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
