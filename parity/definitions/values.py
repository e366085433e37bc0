"""The one rule for each number or name a user gives, whatever the front door (CLI option,
project-file key, Python argument).  Each check raises ValueError saying what is wrong; the
caller adds where (an option name, a file and entry) and turns it into its own error.

A tolerance of inf or NaN, a factor below 1 or a negative slack would make a check pass (or
fail) whatever the module computes; an empty string would quietly mean "absent".
"""

from __future__ import annotations

import math
import re
from typing import Any

SEED_LIMIT = 2**40  # torch seeds must fit in 64 bits; a larger one fails deep inside torch
BASELINE_MINIMUM = {"baseline_factor": 1.0, "baseline_slack": 0.0}
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16", "half": "float16"}  # accepted spelling -> the name reports use
DEVICE_PATTERN = re.compile(r"cpu|cuda(:\d+)?|mps")


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"must be a number, not {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"must be a finite number, not {value}")
    return float(value)


def atol_value(value: Any) -> float:
    """--atol / atol: finite and > 0 (0 fails every layer; inf or NaN passes every one)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"must be a positive finite number, not {value!r} (0 or less fails every layer, "
                         "inf or nan passes every one)")
    return float(value)


def seed_value(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not -SEED_LIMIT < value < SEED_LIMIT:
        raise ValueError(f"must be an integer with |seed| < 2**40, not {value!r}")
    return value


def baseline_number(key: str, value: Any) -> float:
    """baseline_factor / baseline_slack: finite and not below BASELINE_MINIMUM.  NaN would pass every
    layer (every comparison with NaN is false), inf likewise."""
    number = _number(value)
    minimum = BASELINE_MINIMUM[key]
    if number < minimum:
        why = ("a factor below 1 fails layers whose deviation did not change" if key == "baseline_factor"
               else "it is the absolute growth always allowed")
        raise ValueError(f"must be >= {minimum:g}, not {number:g} ({why})")
    return number


def nonempty(value: Any) -> Any:
    """A string that is empty or blank: taken as absent it would silently check something else."""
    if isinstance(value, str) and not value.strip():
        raise ValueError(f"is empty ({value!r})")
    return value


def dtype_value(value: Any) -> str:
    """--dtype / dtype: the compute dtype of the target, as torch names it (bf16, fp16, fp32, half accepted)."""
    name = value.strip().lower() if isinstance(value, str) else value
    if name not in DTYPES:
        raise ValueError(f"must be one of float32, bfloat16, float16 (or bf16, fp16), not {value!r}")
    return DTYPES[name]


def device_value(value: Any) -> str:
    """--device / device: cpu, cuda, cuda:N or mps.  Whether this machine has it is the engine's to say."""
    name = value.strip().lower() if isinstance(value, str) else None
    if name is None or not DEVICE_PATTERN.fullmatch(name):
        raise ValueError(f"must be cpu, cuda, cuda:N (N = 0, 1, ...) or mps, not {value!r}")
    return name


def check_compute(device: Any, dtype: Any) -> tuple[str, str]:
    """``device_value`` and ``dtype_value`` for the Python API: a UsageError naming the argument."""
    from parity.errors import UsageError

    for name, rule, value in (("device", device_value, device), ("dtype", dtype_value, dtype)):
        try:
            rule(value)
        except ValueError as exc:
            raise UsageError(f"{name}={value!r}: {exc}") from None
    return device_value(device), dtype_value(dtype)


def check_atol(value: Any, name: str = "atol") -> float:
    """``atol_value`` for the Python API: a UsageError naming the argument."""
    from parity.errors import UsageError

    try:
        return atol_value(value)
    except ValueError as exc:
        raise UsageError(f"{name}={value!r}: {exc} (a tolerance of inf or nan passes anything)") from None
