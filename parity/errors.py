"""One exception per failure a user can act on; the message says what was wrong, where, and
what to do next.  Every ParityError maps to exit code 2 (the CLI prints it without a
traceback; ``--debug`` shows one).  Each also derives from the standard exception a library
user would catch for that kind of problem where one fits: ValueError for values and files that
say something invalid, LookupError for names that are not there.

Nothing here imports anything: every layer of parity may raise these.
"""

from __future__ import annotations


class ParityError(Exception):
    """Bad input or an unusable checkpoint (exit code 2)."""

    exit_code = 2


# -- values and options --------------------------------------------------------------------------

class UsageError(ParityError, ValueError):
    """An option or argument value that cannot mean anything (empty, NaN, inf, negative, options that clash)."""


class EmptyValueError(UsageError):
    """An empty MODEL, checkpoint, mapping or revision: it names nothing."""


class DestinationError(UsageError):
    """An output path that would overwrite one of the run's inputs or another output, or that cannot be written:
    found before anything is computed, and then no report is written anywhere."""


class LayerRangeError(ParityError, ValueError):
    """The requested layer (or expert) selection is outside the model or selects nothing."""


class ProjectConfigError(ParityError, ValueError):
    """The project's parity table is missing or one of its entries is invalid."""


class ShardError(UsageError):
    """--shard is not K/N with 1 <= K <= N."""


class MappingError(ParityError, ValueError):
    """A mapping file is invalid: names the file, the key and what was expected."""


# -- what is checked -------------------------------------------------------------------------------

class UnknownModelError(ParityError, LookupError):
    """MODEL is neither a mapping name, a local path nor a hub id we can resolve."""


class CheckpointError(ParityError):
    """The checkpoint cannot be opened or read (missing file, corrupt safetensors, ...).  Deliberately
    not an OSError: code that handles a failed read (``except OSError``) must not swallow it."""


class OfflineError(CheckpointError):
    """The hub is unreachable and nothing usable is cached."""


class GatedRepoError(CheckpointError):
    """The hub repository needs an accepted licence and a token."""


class MissingTensorError(CheckpointError, LookupError):
    """The checkpoint lacks tensors the mapping needs."""


class WeightDefectError(CheckpointError):
    """The checkpoint's weights hold NaN or Inf: a checkpoint defect, not a module mismatch."""


class QuantizedLayoutError(CheckpointError):
    """A quantized tensor is not stored as its config states (its scales transposed or of another block size, the
    module not one the config quantizes): ``mistake_id`` names the conversion mistake and ``kind`` the table's
    "stored as" cell, for a compare to report on the layer holding it."""

    def __init__(self, message: str, mistake_id: str, *, kind: str = "scales unreadable in B"):
        super().__init__(message)
        self.mistake_id = mistake_id  # a parity.definitions.mistakes.MistakeId value (errors.py imports nothing)
        self.kind = kind


class UnstatedModuleError(QuantizedLayoutError):
    """A module B stores quantized that its own config leaves unquantized (``why``), with what its loader then does
    (``consequence``): the finding quantized_module_not_stated, reported on the layer holding it."""

    def __init__(self, where: str, module: str, why: str, consequence: str):
        super().__init__(f"{where}: {module} is stored quantized, but config.json leaves it unquantized: {why}; "
                         f"{consequence}", "quantized_module_not_stated", kind="config: not quantized")


class PickleRefusedError(CheckpointError):
    """A pickle-based file was found and the user did not opt in with --allow-pickle."""


class SyntheticWeightsError(CheckpointError):
    """Real weights were required (--require-real, `parity check`) and only the synthetic stand-in was available."""


class ShapeMismatchError(ParityError, ValueError):
    """A checkpoint tensor does not fit the target parameter (``mistake_id`` names the likely cause)."""

    mistake_id = "shape_mismatch"  # a parity.definitions.mistakes.MistakeId value (errors.py imports nothing)


class TargetError(ParityError):
    """The target module cannot be imported, constructed, loaded or run."""


# -- outputs ---------------------------------------------------------------------------------------

class BaselineError(ParityError, ValueError):
    """The baseline file cannot be read or is not a parity baseline."""


# -- the test-suite front door ---------------------------------------------------------------------

class ParityAssertionError(AssertionError):
    """``assert_parity``: a layer deviates, cannot be verified, or nothing was checked; ``.report``
    holds the full report.  An AssertionError, so a test framework reports a failed test."""

    def __init__(self, message: str, report: object):
        super().__init__(message)
        self.report = report
