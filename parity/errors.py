"""One exception per failure a user can act on.  Every one maps to exit code 2.

The message says what was wrong, where, and what to do next; the CLI prints it
without a traceback (``--debug`` shows one).
"""

from __future__ import annotations


class ParityError(Exception):
    """Bad input or an unusable checkpoint (exit code 2)."""

    exit_code = 2


class MappingError(ParityError):
    """A mapping file is invalid: names the file, the key and what was expected."""


class UnknownModelError(ParityError):
    """MODEL is neither a mapping name, a local path nor a hub id we can resolve."""


class CheckpointError(ParityError):
    """The checkpoint cannot be opened or read (missing file, corrupt safetensors, ...)."""


class OfflineError(CheckpointError):
    """The hub is unreachable and nothing usable is cached."""


class GatedRepoError(CheckpointError):
    """The hub repository needs an accepted licence and a token."""


class MissingTensorError(CheckpointError):
    """The checkpoint lacks tensors the mapping needs."""


class WeightDefectError(CheckpointError):
    """The checkpoint's weights hold NaN or Inf: a checkpoint defect, not a module mismatch."""


class ShapeMismatchError(ParityError):
    """A checkpoint tensor does not fit the target parameter (``mistake_id`` names the likely cause)."""

    mistake_id = "shape_mismatch"


class TargetError(ParityError):
    """The target module cannot be imported, constructed or loaded."""


class LayerRangeError(ParityError):
    """The requested layer index is outside the model."""


class PickleRefusedError(CheckpointError):
    """A pickle-based file was found and the user did not opt in with --allow-pickle."""


class SyntheticWeightsError(CheckpointError):
    """Real weights were required (--require-real, `parity check`) and only the synthetic stand-in was available."""


class UsageError(ParityError, ValueError):
    """An option or argument value that cannot mean anything (empty, NaN, inf, negative, options that clash)."""
