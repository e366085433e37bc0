"""What the hub's answers mean to a user: one ParityError per failure they can act on (offline, gated, not
found, a transport failure), and the timeouts parity asks the network with.

huggingface_hub retries an unreachable hub for over 20 s; parity asks the network once, with a short timeout
(``PARITY_HUB_TIMEOUT``, 3 s), and treats a failure as offline (HF_HUB_OFFLINE=1 skips even that).
"""

from __future__ import annotations

import math
import os

from parity.errors import (
    CheckpointError,
    GatedRepoError,
    ParityError,
    UnknownModelError,
    UsageError,
)

GATED = ("'{repo_id}' is a gated repository: accept its licence on its hub page, then set HF_TOKEN "
         "(or run `hf auth login`) and try again.")

NOT_FOUND = ("'{repo_id}' is neither a mapping name, a local path nor a hub repository that exists "
             "(or it is private: set HF_TOKEN). Run `parity list` for the mapping names.")


def reach_timeout() -> float:
    """PARITY_HUB_TIMEOUT: seconds for the reachability probe and each file's metadata request (default 3)."""
    raw = os.environ.get("PARITY_HUB_TIMEOUT", "3")
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise UsageError(f"PARITY_HUB_TIMEOUT={raw!r}: give the seconds to wait for the hub, a number > 0")
    return value


def download_timeout() -> float:
    """huggingface_hub's HF_HUB_DOWNLOAD_TIMEOUT (default 10 s): the longest wait for data while downloading."""
    from huggingface_hub import constants

    return float(constants.HF_HUB_DOWNLOAD_TIMEOUT)


def offline_help(repo_id: str, why: str | None = None) -> str:
    from huggingface_hub import constants

    why = why or ("HF_HUB_OFFLINE=1 is set (unset it to download)" if constants.HF_HUB_OFFLINE
                  else "the hub is not reachable (set HF_HUB_OFFLINE=1 to skip the network check)")
    return (
        f"'{repo_id}' is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and {why}. Download it once "
        f"with network (`hf download {repo_id}`), point HF_HOME or HF_HUB_CACHE at a cache that holds it, "
        "or pass a local folder with --checkpoint."
    )


def http_status(exc: BaseException | None) -> int | None:
    return getattr(getattr(exc, "response", None), "status_code", None)


def said(exc: BaseException) -> str:
    """An HTTP error in one line: 'HTTP 403 (the server's message)'."""
    status = http_status(exc)
    message = " ".join(str(getattr(exc, "server_message", None) or "").split())
    if status is None:
        return " ".join(str(exc).split()) or type(exc).__name__
    return f"HTTP {status}" + (f" ({message})" if message else "")


def is_transport_error(exc: BaseException) -> bool:
    """A timeout, a refused or dropped connection, a malformed answer: the network, not the request."""
    return isinstance(exc, OSError) or type(exc).__module__.partition(".")[0] in ("httpx", "httpx2", "httpcore", "h11")


def describe_transport(exc: BaseException) -> str:
    name = type(exc).__name__
    if "Timeout" in name or isinstance(exc, TimeoutError):
        return f"no answer within {download_timeout():g} s ({name})"
    return f"{' '.join(str(exc).split()) or 'connection failed'} ({name})"


def hub_error(repo_id: str, exc: BaseException, file_name: str, revision: str | None) -> ParityError:
    """A huggingface_hub HTTP error -> the parity error that says what to do (exit 2)."""
    from huggingface_hub import errors

    if isinstance(exc, errors.GatedRepoError):
        return GatedRepoError(GATED.format(repo_id=repo_id))
    if isinstance(exc, errors.RevisionNotFoundError):
        return CheckpointError(f"'{repo_id}': revision '{revision}' does not exist")
    if isinstance(exc, errors.RepositoryNotFoundError):
        return UnknownModelError(NOT_FOUND.format(repo_id=repo_id))
    if http_status(exc) in (401, 403):
        return CheckpointError(f"'{repo_id}': the hub refused {file_name} ({said(exc)}); set HF_TOKEN to a token "
                               "with read access to the repository")
    return CheckpointError(f"'{repo_id}': the hub answered {file_name} with an error ({said(exc)}); try again later")


def why_not_served(exc: BaseException) -> str | None:
    """Why huggingface_hub fell back to a cache that does not hold the file (None: it was told to stay offline)."""
    cause = exc.__cause__
    if cause is None or type(cause).__name__ == "OfflineModeIsEnabled":
        return None
    from huggingface_hub import constants

    what = said(cause) if http_status(cause) is not None else describe_transport(cause)
    return f"the hub at {constants.ENDPOINT} did not serve it ({what})"
