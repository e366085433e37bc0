"""What each front door does with synthetic weights: one table, read by every door.

Synthetic weights are the stand-in used when a mapping's default hub checkpoint is neither
reachable nor cached: random tensors with the real shapes and on-disk format.  A pass on them
proves the module's shapes and code path, nothing about a real checkpoint, so no door lets one
pass silently: each either refuses it, skips it, or checks it and says SYNTHETIC in every view.
The README's table "Synthetic weights at each entry point" is this table.
"""

from __future__ import annotations

from typing import Literal

Action = Literal["check", "refuse", "skip"]

# door -> what it does by default (the explicit option of each door overrides it)
SYNTHETIC_DEFAULT: dict[str, Action] = {
    "parity MODEL": "check",  # the interactive door: checks them, SYNTHETIC in text/JSON/JUnit/HTML; --require-real
    "parity.check": "check",  # the library: report.synthetic is True; require_real=True raises SyntheticWeightsError
    "parity compare": "check",  # A or B a stand-in: compared, SYNTHETIC in text/JSON/JUnit/HTML; --require-real
    "parity.compare": "check",  # report.synthetic is True; require_real=True raises SyntheticWeightsError
    "parity check": "refuse",  # a project file is CI: exit 2 unless the check (or [[compares]]) says
                               # require_real = false
    "pytest": "skip",  # assert_parity / parity_check: pytest.skip with the reason; require_real=False checks them,
                       # require_real=True, --parity-require-real or PARITY_REQUIRE_REAL=1 fail the test
}


def synthetic_action(door: str, require_real: bool | None = None) -> Action:
    """What ``door`` does with synthetic weights when the user said ``require_real`` (None: nothing)."""
    if require_real is True:
        return "refuse"
    if require_real is False:
        return "check"
    return SYNTHETIC_DEFAULT[door]
