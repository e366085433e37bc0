"""Hub checkpoints through huggingface_hub: the local cache first when offline, and with
network only config.json, the index, and the byte ranges of the requested tensors in the
shards that hold them (shards already cached are read from the cache; tensors read by
range are kept by parity.sources.tensorcache, and read from there even offline).

huggingface_hub retries an unreachable hub for over 20 s; parity asks the network once,
with a short timeout, and treats a failure as offline (HF_HUB_OFFLINE=1 skips even that).
"""

from __future__ import annotations

import os
import re
import socket
import sys
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterator
from urllib.parse import urlparse

from parity.sources.checkpoint import Checkpoint
from parity.sources.safetensors_files import CONFIG, INDEX, SINGLE, read_json, read_safetensors, weight_map_from_files, weight_map_from_index
from parity.errors import CheckpointError, GatedRepoError, OfflineError, PickleRefusedError, UnknownModelError
from parity.sources.ranges import Fetch, RangedReader, read_span
from parity.sources.tensorcache import TensorCache

REACH_TIMEOUT_S = float(os.environ.get("PARITY_HUB_TIMEOUT", "3"))
RANGE_CHUNK = 16 * 2**20  # bytes per HTTP range request (and progress-bar step)


def looks_like_hub_id(text: str) -> bool:
    parts = text.split("/")
    return 1 <= len(parts) <= 2 and all(parts) and not text.startswith((".", "~")) and " " not in text


@lru_cache(maxsize=1)
def hub_reachable() -> bool:
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=REACH_TIMEOUT_S):
            return True
    except OSError:
        return False


def _offline_help(repo_id: str) -> str:
    from huggingface_hub import constants

    why = ("HF_HUB_OFFLINE=1 is set (unset it to download)" if constants.HF_HUB_OFFLINE
           else "the hub is not reachable (set HF_HUB_OFFLINE=1 to skip the network check)")
    return (
        f"'{repo_id}' is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and {why}. Download it once "
        f"with network (`hf download {repo_id}`), point HF_HOME or HF_HUB_CACHE at a cache that holds it, "
        "or pass a local folder with --checkpoint."
    )


def _download(repo_id: str, file_name: str, revision: str | None, offline: bool) -> Path:
    from huggingface_hub import errors, hf_hub_download

    try:
        return Path(hf_hub_download(repo_id, file_name, revision=revision, local_files_only=offline, etag_timeout=REACH_TIMEOUT_S))
    except errors.GatedRepoError:
        raise GatedRepoError(
            f"'{repo_id}' is a gated repository: accept its licence on its hub page, then set HF_TOKEN "
            "(or run `hf auth login`) and try again."
        ) from None
    except errors.RepositoryNotFoundError:
        raise UnknownModelError(
            f"'{repo_id}' is neither a mapping name, a local path nor a hub repository that exists "
            "(or it is private: set HF_TOKEN). Run `parity list` for the mapping names."
        ) from None
    except errors.RevisionNotFoundError:
        raise CheckpointError(f"'{repo_id}': revision '{revision}' does not exist") from None
    except errors.LocalEntryNotFoundError:
        raise OfflineError(_offline_help(repo_id)) from None
    except errors.EntryNotFoundError:
        raise FileNotFoundError(file_name) from None
    except errors.HfHubHTTPError as exc:
        raise CheckpointError(f"'{repo_id}': the hub answered with an error: {exc}") from None
    except OSError as exc:
        raise CheckpointError(f"'{repo_id}': cannot fetch {file_name}: {exc}") from None


def open_hub(repo_id: str, revision: str | None = None) -> Checkpoint:
    """Resolve a hub id to a checkpoint: from the cache when offline, downloading lazily otherwise."""
    offline = not hub_reachable()
    try:
        config_path = _download(repo_id, CONFIG, revision, offline)
    except FileNotFoundError:
        raise CheckpointError(f"'{repo_id}' has no config.json; parity needs a transformers-format repository") from None
    raw_config = read_json(config_path, "config.json")
    try:
        weight_map = weight_map_from_index(_download(repo_id, INDEX, revision, offline))
    except (FileNotFoundError, OfflineError):
        weight_map = _single_file_map(repo_id, revision, offline)

    def fetch(file_name: str) -> Path:
        try:
            return _download(repo_id, file_name, revision, offline)
        except FileNotFoundError:
            raise CheckpointError(f"'{repo_id}': {file_name} is listed in {INDEX} but missing from the repository") from None

    location = repo_id + (f"@{revision}" if revision else "")
    reader = remote_reader(repo_id, _pinned(config_path, revision), fetch, offline=offline)
    return Checkpoint(location, config_path.parent, raw_config, weight_map, fetch, reader=reader,
                      repo_id=repo_id, revision=revision)


def _pinned(config_path: Path, revision: str | None) -> str | None:
    """The commit config.json came from (its snapshot folder), so every range is read from it."""
    commit = config_path.parent.name
    return commit if re.fullmatch(r"[0-9a-f]{40}", commit) else revision


class _RangeFailed(Exception):
    """The hub would not serve a byte range; the whole shard is downloaded instead."""


def hub_range_fetcher(repo_id: str, revision: str | None) -> Fetch:
    """(file, start, end) -> chunks, through HfFileSystem (auth, endpoint and redirects as huggingface_hub does)."""
    from huggingface_hub import HfFileSystem

    fs = HfFileSystem()

    def fetch(file_name: str, start: int, end: int) -> Iterator[bytes]:
        try:  # cache_type "none": every read() is one HTTP range request, nothing is buffered twice
            with fs.open(f"{repo_id}/{file_name}", "rb", revision=revision, block_size=RANGE_CHUNK,
                         cache_type="none") as handle:
                yield from read_span(handle, start, end, RANGE_CHUNK)
        except Exception as exc:  # HTTP, connection and fsspec errors alike
            raise _RangeFailed(f"{type(exc).__name__}: {exc}") from exc

    return fetch


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
    else:
        ranged_read = RangedReader(fetcher or hub_range_fetcher(repo_id, revision), progress=progress_bar).read

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
    from huggingface_hub import errors, get_safetensors_metadata

    try:  # reads the safetensors header over the network; the weights stay remote until needed
        meta = get_safetensors_metadata(repo_id, revision=revision)
    except errors.NotASafetensorsRepoError:
        raise PickleRefusedError(
            f"'{repo_id}' has no safetensors weights (only pickle-based files, which parity does not unpickle); "
            "use a safetensors revision or convert it with save_pretrained(safe_serialization=True)."
        ) from None
    except errors.HfHubHTTPError as exc:
        raise CheckpointError(f"'{repo_id}': cannot read safetensors metadata: {exc}") from None
    return dict(meta.weight_map)
