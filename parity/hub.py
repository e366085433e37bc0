"""Hub checkpoints through huggingface_hub: the local cache first when offline, and with
network only config.json, the index, and the shards that hold the requested tensors.

huggingface_hub retries an unreachable hub for over 20 s; parity asks the network once,
with a short timeout, and treats a failure as offline (HF_HUB_OFFLINE=1 skips even that).
"""

from __future__ import annotations

import os
import socket
from functools import lru_cache
from pathlib import Path
from urllib.parse import urlparse

from .checkpoint import CONFIG, INDEX, SINGLE, Checkpoint, read_json, weight_map_from_files, weight_map_from_index
from .errors import CheckpointError, GatedRepoError, OfflineError, PickleRefusedError, UnknownModelError

REACH_TIMEOUT_S = float(os.environ.get("PARITY_HUB_TIMEOUT", "3"))


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
    return Checkpoint(location, config_path.parent, raw_config, weight_map, fetch, repo_id=repo_id, revision=revision)


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
