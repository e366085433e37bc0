"""Hub checkpoints through huggingface_hub: the local cache first when offline, and with
network only config.json, the index, and the byte ranges of the requested tensors in the
shards that hold them (shards already cached are read from the cache; tensors read by
range are kept by parity.sources.tensorcache, and read from there even offline).  Every
file after config.json is read from the commit config.json came from.

huggingface_hub retries an unreachable hub for over 20 s; parity asks the network once,
with a short timeout (``PARITY_HUB_TIMEOUT``, 3 s), and treats a failure as offline
(HF_HUB_OFFLINE=1 skips even that).  Byte ranges go through huggingface_hub's own HTTP session
(endpoint, token, redirects to the CDN); each answer is checked (206, a Content-Range that
starts where asked, as many bytes as it declares), and a transfer that fails (a timeout of
HF_HUB_DOWNLOAD_TIMEOUT, a dropped connection, a 5xx, a short body) is resumed where it
stopped, ``RANGE_ATTEMPTS`` tries without progress at most; then the check stops with a
CheckpointError (exit 2).  A server that does not serve ranges gets the whole file downloaded.
"""

from __future__ import annotations

import math
import os
import re
import socket
import sys
import time
from collections.abc import Callable, Iterator
from functools import lru_cache
from pathlib import Path
from urllib.parse import urlparse

from parity.errors import (
    CheckpointError,
    GatedRepoError,
    OfflineError,
    ParityError,
    PickleRefusedError,
    UnknownModelError,
    UsageError,
)
from parity.sources.checkpoint import Checkpoint
from parity.sources.ranges import Fetch, RangedReader
from parity.sources.safetensors_files import (
    CONFIG,
    INDEX,
    SINGLE,
    read_json,
    read_safetensors,
    weight_map_from_files,
    weight_map_from_index,
)
from parity.sources.tensorcache import TensorCache

RANGE_ATTEMPTS = 3  # tries of one byte range in a row that bring no new byte, then parity gives up
RANGE_REQUESTS = 64  # requests for one byte range at most (a server that answers a little at a time)
RETRY_WAIT_S = 0.5  # before the 2nd try; 1 s before the 3rd
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
GATED = ("'{repo_id}' is a gated repository: accept its licence on its hub page, then set HF_TOKEN "
         "(or run `hf auth login`) and try again.")
NOT_FOUND = ("'{repo_id}' is neither a mapping name, a local path nor a hub repository that exists "
             "(or it is private: set HF_TOKEN). Run `parity list` for the mapping names.")


def looks_like_hub_id(text: str) -> bool:
    parts = text.split("/")
    return 1 <= len(parts) <= 2 and all(parts) and not text.startswith((".", "~")) and " " not in text


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


@lru_cache(maxsize=1)
def hub_reachable() -> bool:
    """Can a TCP connection to HF_ENDPOINT's host (huggingface.co by default) be opened?"""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=reach_timeout()):
            return True
    except OSError:
        return False


def _offline_help(repo_id: str, why: str | None = None) -> str:
    from huggingface_hub import constants

    why = why or ("HF_HUB_OFFLINE=1 is set (unset it to download)" if constants.HF_HUB_OFFLINE
                  else "the hub is not reachable (set HF_HUB_OFFLINE=1 to skip the network check)")
    return (
        f"'{repo_id}' is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and {why}. Download it once "
        f"with network (`hf download {repo_id}`), point HF_HOME or HF_HUB_CACHE at a cache that holds it, "
        "or pass a local folder with --checkpoint."
    )


def _status(exc: BaseException | None) -> int | None:
    return getattr(getattr(exc, "response", None), "status_code", None)


def _said(exc: BaseException) -> str:
    """An HTTP error in one line: 'HTTP 403 (the server's message)'."""
    status = _status(exc)
    message = " ".join(str(getattr(exc, "server_message", None) or "").split())
    if status is None:
        return " ".join(str(exc).split()) or type(exc).__name__
    return f"HTTP {status}" + (f" ({message})" if message else "")


def _is_transport_error(exc: BaseException) -> bool:
    """A timeout, a refused or dropped connection, a malformed answer: the network, not the request."""
    return isinstance(exc, OSError) or type(exc).__module__.partition(".")[0] in ("httpx", "httpx2", "httpcore", "h11")


def _describe_transport(exc: BaseException) -> str:
    name = type(exc).__name__
    if "Timeout" in name or isinstance(exc, TimeoutError):
        return f"no answer within {download_timeout():g} s ({name})"
    return f"{' '.join(str(exc).split()) or 'connection failed'} ({name})"


def _hub_error(repo_id: str, exc: BaseException, file_name: str, revision: str | None) -> ParityError:
    """A huggingface_hub HTTP error -> the parity error that says what to do (exit 2)."""
    from huggingface_hub import errors

    if isinstance(exc, errors.GatedRepoError):
        return GatedRepoError(GATED.format(repo_id=repo_id))
    if isinstance(exc, errors.RevisionNotFoundError):
        return CheckpointError(f"'{repo_id}': revision '{revision}' does not exist")
    if isinstance(exc, errors.RepositoryNotFoundError):
        return UnknownModelError(NOT_FOUND.format(repo_id=repo_id))
    if _status(exc) in (401, 403):
        return CheckpointError(f"'{repo_id}': the hub refused {file_name} ({_said(exc)}); set HF_TOKEN to a token "
                               "with read access to the repository")
    return CheckpointError(f"'{repo_id}': the hub answered {file_name} with an error ({_said(exc)}); try again later")


def _why_not_served(exc: BaseException) -> str | None:
    """Why huggingface_hub fell back to a cache that does not hold the file (None: it was told to stay offline)."""
    cause = exc.__cause__
    if cause is None or type(cause).__name__ == "OfflineModeIsEnabled":
        return None
    from huggingface_hub import constants

    what = _said(cause) if _status(cause) is not None else _describe_transport(cause)
    return f"the hub at {constants.ENDPOINT} did not serve it ({what})"


def _download(repo_id: str, file_name: str, revision: str | None, offline: bool) -> Path:
    """A whole file through huggingface_hub's cache; one more try after a 5xx or a transfer failure."""
    from huggingface_hub import errors, hf_hub_download

    for attempt in (1, 2):
        try:
            return Path(hf_hub_download(repo_id, file_name, revision=revision, local_files_only=offline,
                                        etag_timeout=reach_timeout()))
        except errors.LocalEntryNotFoundError as exc:
            raise OfflineError(_offline_help(repo_id, None if offline else _why_not_served(exc))) from None
        except errors.EntryNotFoundError:
            raise FileNotFoundError(file_name) from None
        except errors.HfHubHTTPError as exc:
            if attempt == 2 or _status(exc) not in RETRY_STATUSES:
                raise _hub_error(repo_id, exc, file_name, revision) from None
        except Exception as exc:  # the connection, or a body whose size is not the one announced
            if not _is_transport_error(exc):
                raise
            if attempt == 2:
                raise CheckpointError(f"'{repo_id}': cannot fetch {file_name}: {_describe_transport(exc)}; "
                                      "try again") from None
        time.sleep(RETRY_WAIT_S)
    raise AssertionError("unreachable")


def open_hub(repo_id: str, revision: str | None = None) -> Checkpoint:
    """Resolve a hub id to a checkpoint: from the cache when offline, downloading lazily otherwise."""
    offline = not hub_reachable()
    try:
        config_path = _download(repo_id, CONFIG, revision, offline)
    except FileNotFoundError:
        raise CheckpointError(f"'{repo_id}' has no config.json; "
                              "parity needs a transformers-format repository") from None
    raw_config = read_json(config_path, "config.json")
    commit = _pinned(config_path, revision)  # every other file from the commit config.json came from
    try:
        weight_map = weight_map_from_index(_download(repo_id, INDEX, commit, offline))
    except (FileNotFoundError, OfflineError):
        weight_map = _single_file_map(repo_id, commit, offline)

    def fetch(file_name: str) -> Path:
        try:
            return _download(repo_id, file_name, commit, offline)
        except FileNotFoundError:
            raise CheckpointError(f"'{repo_id}': {file_name} is listed in {INDEX} "
                                  "but missing from the repository") from None

    location = repo_id + (f"@{revision}" if revision else "")
    reader = remote_reader(repo_id, commit, fetch, offline=offline)
    return Checkpoint(location, config_path.parent, raw_config, weight_map, fetch, reader=reader,
                      repo_id=repo_id, revision=revision)


def _pinned(config_path: Path, revision: str | None) -> str | None:
    """The commit config.json came from (its snapshot folder), so every range is read from it."""
    commit = config_path.parent.name
    return commit if re.fullmatch(r"[0-9a-f]{40}", commit) else revision


class _RangeFailed(Exception):
    """The hub would not serve a byte range; the whole shard is downloaded instead."""


class _Transient(Exception):
    """A transfer failure another try may cure: a timeout, a dropped connection, a 5xx, a body cut short."""


def hub_range_fetcher(repo_id: str, revision: str | None) -> Fetch:
    """(file, start, end) -> chunks: one HTTP range request through huggingface_hub's session (its endpoint,
    token and redirects), resumed where it stopped after a failure; gives up with a CheckpointError."""
    from huggingface_hub import constants, hf_hub_url

    def fetch(file_name: str, start: int, end: int) -> Iterator[bytes]:
        url = hf_hub_url(repo_id, file_name, revision=revision)
        position, failures, why, tries = start, 0, "", 0
        while position < end and failures < RANGE_ATTEMPTS and tries < RANGE_REQUESTS:
            if failures:
                time.sleep(RETRY_WAIT_S * failures)
            before, tries = position, tries + 1
            try:
                for chunk in _range_response((repo_id, revision, file_name), url, position, end):
                    position += len(chunk)
                    yield chunk
                why = "the hub sent no bytes"
            except _Transient as exc:
                why = str(exc)
            failures = 0 if position > before else failures + 1
        if position < end:
            raise CheckpointError(
                f"'{repo_id}': could not read bytes {start}-{end} of {file_name} from {constants.ENDPOINT} "
                f"({tries} requests, {position - start} bytes received): {why}. Nothing of it was cached; try again "
                f"(a slow connection may need a longer HF_HUB_DOWNLOAD_TIMEOUT, now {download_timeout():g} s)")

    return fetch


def _range_response(where: tuple[str, str | None, str], url: str, start: int, end: int) -> Iterator[bytes]:
    """The bytes one range request brings from ``start`` (no further than ``end``).  Raises _Transient for what
    another try may cure, _RangeFailed when the server does not serve ranges, a ParityError for an HTTP error."""
    from huggingface_hub.utils import build_hf_headers, get_session

    headers = {**build_hf_headers(), "Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}
    try:
        with get_session().stream("GET", url, headers=headers, timeout=download_timeout(),
                                  follow_redirects=True) as response:
            _check_answer(where, response, start)
            yield from _body(response, start, min(_served_end(response, start), end))
    except (_Transient, _RangeFailed, ParityError):
        raise
    except Exception as exc:
        if not _is_transport_error(exc):
            raise
        raise _Transient(_describe_transport(exc)) from None


def _check_answer(where: tuple[str, str | None, str], response, start: int) -> None:
    from huggingface_hub import errors
    from huggingface_hub.utils import hf_raise_for_status

    repo_id, revision, file_name = where
    status = response.status_code
    if status in RETRY_STATUSES:
        raise _Transient(f"the hub answered HTTP {status}")
    if status == 416:
        raise _RangeFailed(f"HTTP 416 for bytes from {start}: the file is shorter than its header says")
    if status >= 400:
        try:
            hf_raise_for_status(response)
        except errors.EntryNotFoundError:
            raise CheckpointError(f"'{repo_id}': {file_name} is listed in {INDEX} but missing from the "
                                  f"repository at commit {revision}") from None
        except errors.HfHubHTTPError as exc:
            raise _hub_error(repo_id, exc, file_name, revision) from None
        raise _RangeFailed(f"HTTP {status}")


def _served_end(response, start: int) -> int:
    """Where the bytes of a 206 answer end (exclusive); anything else is not a usable range answer."""
    if response.status_code == 200:
        raise _RangeFailed("the server ignored the Range header and sent the whole file")
    if response.status_code != 206:
        raise _RangeFailed(f"HTTP {response.status_code} to a Range request")
    declared = response.headers.get("Content-Range", "")
    m = CONTENT_RANGE.fullmatch(declared.strip())
    if m is None or int(m[1]) != start or int(m[2]) < start:
        raise _RangeFailed(f"Content-Range '{declared}' does not answer a request for bytes from {start}")
    return int(m[2]) + 1


def _body(response, start: int, stop: int) -> Iterator[bytes]:
    """The body's bytes up to ``stop``; _Transient if it ends before."""
    got, want = 0, stop - start
    for chunk in response.iter_bytes():  # as they arrive: a chunk size would hold back bytes a drop then loses
        chunk = chunk[:want - got]
        if chunk:
            got += len(chunk)
            yield chunk
        if got >= want:
            return
    raise _Transient(f"the answer ended after {got} of the {want} bytes its Content-Range declared")


def progress_bar(description: str, total: int):
    """A byte progress bar on stderr; silent after huggingface_hub.utils.disable_progress_bars()."""
    from huggingface_hub.utils import tqdm

    return tqdm(total=total, desc=description, unit="B", unit_scale=True, unit_divisor=1024)


def remote_reader(repo_id: str, revision: str | None, download: Callable[[str], Path],
                  fetcher: Fetch | None = None, offline: bool = False) -> Callable[[str, list[str]], dict]:
    """Read tensors from the cached shard when there is one, else from parity's cache of
    tensors read by range, else (online) only their byte ranges."""
    from huggingface_hub import try_to_load_from_cache

    kept = TensorCache(repo_id, revision)
    if offline:
        def ranged_read(file_name: str, names: list[str]) -> dict:
            raise OfflineError(_offline_help(repo_id))
    else:  # max_gap 0: the bytes of the tensors asked for, never those between them
        ranged_read = RangedReader(fetcher or hub_range_fetcher(repo_id, revision), progress=progress_bar,
                                   max_gap=0).read

    def read(file_name: str, names: list[str]) -> dict:
        cached = try_to_load_from_cache(repo_id, file_name, revision=revision)
        if isinstance(cached, str):
            return read_safetensors(Path(cached), names)
        try:
            return kept.read_through(file_name, names, ranged_read)
        except _RangeFailed as exc:
            print(f"parity: reading byte ranges of {repo_id}/{file_name} failed ({exc}); downloading the whole file",
                  file=sys.stderr)
            return read_safetensors(download(file_name), names)

    return read


def _single_file_map(repo_id: str, revision: str | None, offline: bool) -> dict[str, str]:
    if offline:
        try:
            return weight_map_from_files([_download(repo_id, SINGLE, revision, True)])
        except FileNotFoundError:
            raise OfflineError(_offline_help(repo_id)) from None
    from huggingface_hub import HfApi, errors

    try:  # reads the safetensors header over the network; the weights stay remote until needed
        meta = HfApi().get_safetensors_metadata(repo_id, revision=revision)  # HfApi(): HF_ENDPOINT as it is now
    except errors.NotASafetensorsRepoError:
        raise PickleRefusedError(
            f"'{repo_id}' has no safetensors weights (only pickle-based files, which parity does not unpickle); "
            "use a safetensors revision or convert it with save_pretrained(safe_serialization=True)."
        ) from None
    except errors.HfHubHTTPError as exc:
        raise _hub_error(repo_id, exc, SINGLE, revision) from None
    except Exception as exc:
        if not _is_transport_error(exc):
            raise
        raise CheckpointError(f"'{repo_id}': cannot read the safetensors header of {SINGLE}: "
                              f"{_describe_transport(exc)}; try again") from None
    return dict(meta.weight_map)
