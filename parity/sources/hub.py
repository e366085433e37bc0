"""Hub checkpoints through huggingface_hub: the local cache first when offline, and with network only
config.json, the index, and the byte ranges of the requested tensors in the shards that hold them (shards
already cached are read from the cache; tensors read by range are kept by parity.sources.tensorcache, and read
from there even offline).  Every file after config.json is read from the commit config.json came from.
The range client is ``hub_ranges``; what failures mean, ``hub_errors``.
"""

from __future__ import annotations

import logging
import re
import socket
import time
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from urllib.parse import urlparse

from parity.errors import (
    CheckpointError,
    OfflineError,
    PickleRefusedError,
)
from parity.sources.checkpoint import Checkpoint
from parity.sources.hub_errors import (
    describe_transport,
    http_status,
    hub_error,
    is_transport_error,
    offline_help,
    reach_timeout,
    why_not_served,
)
from parity.sources.hub_ranges import RETRY_STATUSES, RETRY_WAIT_S, RangeFailed, hub_range_fetcher
from parity.sources.quantized import dequantizing
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

LOG = logging.getLogger("parity")  # the CLI prints its records on stderr; a library user's own logging gets them


def looks_like_hub_id(text: str) -> bool:
    parts = text.split("/")
    return 1 <= len(parts) <= 2 and all(parts) and not text.startswith((".", "~")) and " " not in text


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


def _download(repo_id: str, file_name: str, revision: str | None, offline: bool) -> Path:
    """A whole file through huggingface_hub's cache; one more try after a 5xx or a transfer failure."""
    from huggingface_hub import errors, hf_hub_download

    for attempt in (1, 2):
        try:
            return Path(hf_hub_download(repo_id, file_name, revision=revision, local_files_only=offline,
                                        etag_timeout=reach_timeout()))
        except errors.LocalEntryNotFoundError as exc:
            raise OfflineError(offline_help(repo_id, None if offline else why_not_served(exc))) from None
        except errors.EntryNotFoundError:
            raise FileNotFoundError(file_name) from None
        except errors.HfHubHTTPError as exc:
            if attempt == 2 or http_status(exc) not in RETRY_STATUSES:
                raise hub_error(repo_id, exc, file_name, revision) from None
        except Exception as exc:  # the connection, or a body whose size is not the one announced
            if not is_transport_error(exc):
                raise
            if attempt == 2:
                raise CheckpointError(f"'{repo_id}': cannot fetch {file_name}: {describe_transport(exc)}; "
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
    checkpoint = Checkpoint(location, config_path.parent, raw_config, weight_map, fetch, reader=reader,
                            repo_id=repo_id, revision=revision)
    return dequantizing(checkpoint, f"'{repo_id}'")  # quantized weights: dequantized on read


def _pinned(config_path: Path, revision: str | None) -> str | None:
    """The commit config.json came from (its snapshot folder), so every range is read from it."""
    commit = config_path.parent.name
    return commit if re.fullmatch(r"[0-9a-f]{40}", commit) else revision


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
            raise OfflineError(offline_help(repo_id))
    else:  # max_gap 0: the bytes of the tensors asked for, never those between them
        ranged_read = RangedReader(fetcher or hub_range_fetcher(repo_id, revision), progress=progress_bar,
                                   max_gap=0).read

    def read(file_name: str, names: list[str]) -> dict:
        cached = try_to_load_from_cache(repo_id, file_name, revision=revision)
        if isinstance(cached, str):
            return read_safetensors(Path(cached), names)
        try:
            return kept.read_through(file_name, names, ranged_read)
        except RangeFailed as exc:
            LOG.warning("parity: reading byte ranges of %s/%s failed (%s); downloading the whole file", repo_id,
                        file_name, exc)
            return read_safetensors(download(file_name), names)

    return read


def _single_file_map(repo_id: str, revision: str | None, offline: bool) -> dict[str, str]:
    if offline:
        try:
            return weight_map_from_files([_download(repo_id, SINGLE, revision, True)])
        except FileNotFoundError:
            raise OfflineError(offline_help(repo_id)) from None
    from huggingface_hub import HfApi, errors

    try:  # reads the safetensors header over the network; the weights stay remote until needed
        meta = HfApi().get_safetensors_metadata(repo_id, revision=revision)  # HfApi(): HF_ENDPOINT as it is now
    except errors.NotASafetensorsRepoError:
        raise PickleRefusedError(
            f"'{repo_id}' has no safetensors weights (only pickle-based files, which parity does not unpickle); "
            "use a safetensors revision or convert it with save_pretrained(safe_serialization=True)."
        ) from None
    except errors.HfHubHTTPError as exc:
        raise hub_error(repo_id, exc, SINGLE, revision) from None
    except Exception as exc:
        if not is_transport_error(exc):
            raise
        raise CheckpointError(f"'{repo_id}': cannot read the safetensors header of {SINGLE}: "
                              f"{describe_transport(exc)}; try again") from None
    return dict(meta.weight_map)
