"""Byte ranges of a hub file, through huggingface_hub's own HTTP session (endpoint, token, redirects to the CDN).

Each answer is checked (206, a Content-Range that starts where asked, as many bytes as it declares), and a
transfer that fails (a timeout of HF_HUB_DOWNLOAD_TIMEOUT, a dropped connection, a 5xx, a short body) is resumed
where it stopped, ``RANGE_ATTEMPTS`` tries without progress at most; then the check stops with a CheckpointError
(exit 2).  A server that does not serve ranges raises RangeFailed: the caller downloads the whole file.

Why not ``HfFileSystem``: see docs/performance.md (its reads go through fsspec's block cache, which fetches
whole blocks around the tensors asked for; parity reads exactly the tensors' bytes and resumes a cut transfer).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from parity.errors import CheckpointError, ParityError
from parity.sources.hub_errors import describe_transport, download_timeout, hub_error, is_transport_error
from parity.sources.safetensors_files import INDEX

if TYPE_CHECKING:  # the type only: importing ranges would lengthen the import chain
    from parity.sources.ranges import Fetch

RANGE_ATTEMPTS = 3  # tries of one byte range in a row that bring no new byte, then parity gives up

RANGE_REQUESTS = 64  # requests for one byte range at most (a server that answers a little at a time)

RETRY_WAIT_S = 0.5  # before the 2nd try; 1 s before the 3rd

RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})

CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


class RangeFailed(Exception):
    """The hub would not serve a byte range; the whole shard is downloaded instead."""


class Transient(Exception):
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
            except Transient as exc:
                why = str(exc)
            failures = 0 if position > before else failures + 1
        if position < end:
            raise CheckpointError(
                f"'{repo_id}': could not read bytes {start}-{end} of {file_name} from {constants.ENDPOINT} "
                f"({tries} requests, {position - start} bytes received): {why}. Nothing of it was cached; try again "
                f"(a slow connection may need a longer HF_HUB_DOWNLOAD_TIMEOUT, now {download_timeout():g} s)")

    return fetch


def _range_response(where: tuple[str, str | None, str], url: str, start: int, end: int) -> Iterator[bytes]:
    """The bytes one range request brings from ``start`` (no further than ``end``).  Raises Transient for what
    another try may cure, RangeFailed when the server does not serve ranges, a ParityError for an HTTP error."""
    from huggingface_hub.utils import build_hf_headers, get_session

    headers = {**build_hf_headers(), "Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}
    try:
        with get_session().stream("GET", url, headers=headers, timeout=download_timeout(),
                                  follow_redirects=True) as response:
            _check_answer(where, response, start)
            yield from _body(response, start, min(_served_end(response, start), end))
    except (Transient, RangeFailed, ParityError):
        raise
    except Exception as exc:
        if not is_transport_error(exc):
            raise
        raise Transient(describe_transport(exc)) from None


def _check_answer(where: tuple[str, str | None, str], response, start: int) -> None:
    from huggingface_hub import errors
    from huggingface_hub.utils import hf_raise_for_status

    repo_id, revision, file_name = where
    status = response.status_code
    if status in RETRY_STATUSES:
        raise Transient(f"the hub answered HTTP {status}")
    if status == 416:
        raise RangeFailed(f"HTTP 416 for bytes from {start}: the file is shorter than its header says")
    if status >= 400:
        try:
            hf_raise_for_status(response)
        except errors.EntryNotFoundError:
            raise CheckpointError(f"'{repo_id}': {file_name} is listed in {INDEX} but missing from the "
                                  f"repository at commit {revision}") from None
        except errors.HfHubHTTPError as exc:
            raise hub_error(repo_id, exc, file_name, revision) from None
        raise RangeFailed(f"HTTP {status}")


def _served_end(response, start: int) -> int:
    """Where the bytes of a 206 answer end (exclusive); anything else is not a usable range answer."""
    if response.status_code == 200:
        raise RangeFailed("the server ignored the Range header and sent the whole file")
    if response.status_code != 206:
        raise RangeFailed(f"HTTP {response.status_code} to a Range request")
    declared = response.headers.get("Content-Range", "")
    m = CONTENT_RANGE.fullmatch(declared.strip())
    if m is None or int(m[1]) != start or int(m[2]) < start:
        raise RangeFailed(f"Content-Range '{declared}' does not answer a request for bytes from {start}")
    return int(m[2]) + 1


def _body(response, start: int, stop: int) -> Iterator[bytes]:
    """The body's bytes up to ``stop``; Transient if it ends before."""
    got, want = 0, stop - start
    for chunk in response.iter_bytes():  # as they arrive: a chunk size would hold back bytes a drop then loses
        chunk = chunk[:want - got]
        if chunk:
            got += len(chunk)
            yield chunk
        if got >= want:
            return
    raise Transient(f"the answer ended after {got} of the {want} bytes its Content-Range declared")
