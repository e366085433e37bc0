"""Pickle-based checkpoints, opened only on request (--allow-pickle / allow_pickle=True).

Two layouts: an HF folder with ``config.json`` and ``pytorch_model*.bin`` (optionally
sharded by ``pytorch_model.bin.index.json``), and Meta's original release: ``params.json``
with ``consolidated.00.pth``.  Unpickling can run code, so files are loaded only with
``torch.load(weights_only=True)`` (a restricted unpickler: tensors and plain containers) and
``mmap=True`` (tensor data stays on disk; reading a layer copies out just its tensors).
"""

from __future__ import annotations

import pickle
from pathlib import Path

from parity.definitions.files import not_regular, shown
from parity.errors import CheckpointError
from parity.sources.checkpoint import PICKLE_PATTERNS, Checkpoint, refuse_pickle
from parity.sources.config_check import MAX_LENGTH, MAX_WIDTH, float_problem, int_problem, short
from parity.sources.safetensors_files import CONFIG, INDEX, check_shards, read_json, weight_map_from_index

BIN_INDEX = "pytorch_model.bin.index.json"
META_PARAMS = "params.json"
META_FFN = "layers.0.feed_forward.w1.weight"  # used to check params.json's d_ff against the weights


def load_state(path: Path) -> dict:
    """The file's tensors, memory-mapped; only tensors and plain containers are unpickled."""
    import torch

    why = not_regular(path)
    if why is not None:  # torch.load would block on a FIFO
        raise CheckpointError(f"{shown(path)}: {why}; expected a pickle-based weights file")
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{path}: holds objects other than tensors, which torch.load(weights_only=True) refuses to unpickle "
            f"({str(exc).splitlines()[0]}). Convert it to safetensors in an environment you trust."
        ) from None
    except (RuntimeError, OSError, EOFError, ValueError, MemoryError) as exc:
        raise CheckpointError(
            f"{path}: cannot be memory-mapped by torch.load ({str(exc).splitlines()[0]}); files written before "
            "torch 1.6 (non-zip format) must be re-saved with torch.save, or converted to safetensors"
        ) from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]  # training checkpoints wrap the weights
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise CheckpointError(f"{path}: does not hold a state dict (tensor name -> tensor)")
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


class PickleCheckpoint(Checkpoint):
    """Same interface as Checkpoint; ``read`` copies the asked tensors out of the mapped file."""

    def __init__(self, location: str, config_dir: Path | None, raw_config: dict, weight_map: dict[str, str],
                 folder: Path, notes: list[str], opened: tuple[str, dict] | None = None):
        super().__init__(location, config_dir, raw_config, weight_map, lambda name: folder / name, notes=notes)
        self._opened = opened  # the one file kept mapped: (file name, state)

    def _state(self, file_name: str) -> dict:
        if self._opened is None or self._opened[0] != file_name:
            self._opened = None  # drop the previous file's mapping first
            path = self.fetch(file_name)
            if not path.is_file():
                raise CheckpointError(f"{path}: listed in {BIN_INDEX} but missing on disk")
            self._opened = (file_name, load_state(path))
        return self._opened[1]

    def read(self, names: list[str]):
        self.require(names)
        out = {}
        for file_name in self.files_for(names):
            state = self._state(file_name)
            for name in names:
                if self.weight_map[name] == file_name:
                    out[name] = state[name].clone()  # off the mapped file: nothing keeps it alive after the layer
        return out


def open_pickle(path: Path) -> Checkpoint:
    """A pickle-based HF folder or Meta folder (or a .bin/.pth file in one)."""
    folder = path if path.is_dir() else path.parent
    if _present(folder / META_PARAMS) and not _present(folder / CONFIG):
        return open_meta(folder)
    if not _present(folder / CONFIG):
        raise CheckpointError(f"{folder}: no config.json (HF) or params.json (Meta) next to the pickle-based weights")
    raw_config = read_json(folder / CONFIG, "config.json")
    note = ["pickle-based weights, read with torch.load(weights_only=True, mmap=True) as --allow-pickle asked"]
    if path.is_file():
        state = load_state(path)
        return PickleCheckpoint(str(path), folder, raw_config, dict.fromkeys(state, path.name), folder, note,
                                (path.name, state))
    if (folder / BIN_INDEX).exists() or (folder / BIN_INDEX).is_symlink():
        weight_map = weight_map_from_index(folder / BIN_INDEX, BIN_INDEX)
        check_shards(folder / BIN_INDEX, weight_map)
        return PickleCheckpoint(str(folder), folder, raw_config, weight_map, folder, note)
    files = sorted(folder.glob("pytorch_model*.bin"))
    if len(files) != 1:
        raise CheckpointError(f"{folder}: expected one pytorch_model.bin or a {BIN_INDEX}, found "
                              f"{', '.join(f.name for f in files) or 'none'}")
    state = load_state(files[0])
    return PickleCheckpoint(str(folder), folder, raw_config, dict.fromkeys(state, files[0].name), folder, note,
                            (files[0].name, state))


def open_meta(folder: Path) -> Checkpoint:
    """Meta's release format: params.json + consolidated.00.pth -> an equivalent LlamaConfig."""
    from parity.definitions.families import llama_intermediate_size

    shards = sorted(folder.glob("consolidated*.pth"))
    if not shards:
        raise CheckpointError(f"{folder}: has params.json but no consolidated.*.pth weights")
    if len(shards) > 1:
        raise CheckpointError(
            f"{folder}: holds {len(shards)} model-parallel shards ({', '.join(s.name for s in shards)}), each with a "
            "slice of every matrix; parity reads single-file checkpoints. Convert the model with transformers' "
            "convert_llama_weights_to_hf.py and check the HF folder."
        )
    params = read_json(folder / META_PARAMS, "params.json")
    meta = meta_params(folder / META_PARAMS, params)
    dim, multiple_of, multiplier = meta["dim"], meta["multiple_of"], meta["ffn_dim_multiplier"]
    d_ff = llama_intermediate_size(dim, multiple_of, multiplier)
    state = load_state(shards[0])
    if meta["n_layers"] > len(state):
        raise CheckpointError(f"{shown(folder / META_PARAMS)}: 'n_layers' = {meta['n_layers']}: more layers than the "
                              f"{len(state)} tensors of {shards[0].name} could hold; the params.json does not belong "
                              "to these weights")
    stored = state.get(META_FFN)
    if stored is not None and (stored.dim() != 2 or stored.shape[0] != d_ff):
        raise CheckpointError(
            f"{shown(folder)}: params.json gives d_ff = llama_intermediate_size({dim}, multiple_of={multiple_of}, "
            f"ffn_dim_multiplier={multiplier}) = {d_ff}, but {META_FFN} has shape {list(stored.shape)}; "
            "the params.json does not belong to these weights"
        )
    vocab = meta["vocab_size"]
    embedding = state.get("tok_embeddings.weight")
    if vocab <= 0 and embedding is not None and embedding.dim() == 2:
        vocab = int(embedding.shape[0])
    raw_config = {
        "model_type": "llama", "hidden_size": dim, "intermediate_size": d_ff, "num_hidden_layers": meta["n_layers"],
        "num_attention_heads": meta["n_heads"], "num_key_value_heads": meta["n_kv_heads"] or meta["n_heads"],
        "rms_norm_eps": float(meta["norm_eps"]), "vocab_size": vocab if vocab > 0 else 32000,
        "rope_theta": float(meta["rope_theta"]), "hidden_act": "silu",
        # kept as stated: a Meta-style FeedForward(dim, hidden_dim, multiple_of, ffn_dim_multiplier) reads them
        "multiple_of": multiple_of, "ffn_dim_multiplier": multiplier,
    }
    notes = [
        f"Meta checkpoint: params.json read as a LlamaConfig, d_ff = llama_intermediate_size({dim}, "
        f"multiple_of={multiple_of}, ffn_dim_multiplier={multiplier}) = {d_ff}",
        "pickle-based weights, read with torch.load(weights_only=True, mmap=True) as --allow-pickle asked",
    ]
    return PickleCheckpoint(str(shards[0]), None, raw_config, dict.fromkeys(state, shards[0].name), folder, notes,
                            (shards[0].name, state))


# params.json key -> (default, kind, minimum, maximum); kind "int", "int?" (null allowed) or "number"
META_KEYS = {
    "dim": (None, "int", 1, MAX_WIDTH), "n_layers": (None, "int", 1, MAX_WIDTH), "n_heads": (None, "int", 1, MAX_WIDTH),
    "n_kv_heads": (None, "int?", 1, MAX_WIDTH), "multiple_of": (256, "int", 1, MAX_WIDTH),
    "ffn_dim_multiplier": (None, "number?", 1e-3, 1e3), "norm_eps": (1e-5, "number", 0.0, 1.0),
    "rope_theta": (10000.0, "number", 1e-300, 1e300), "vocab_size": (-1, "int", -1, MAX_LENGTH),
}


def meta_params(path: Path, params: dict) -> dict:
    """params.json's values, each checked for type and range (a message names the file, the key and the value)."""
    values = {}
    for key, (default, kind, minimum, maximum) in META_KEYS.items():
        if key not in params and default is None and not kind.endswith("?"):
            raise CheckpointError(f"{shown(path)}: needs '{key}' (an integer); is this Meta's params.json?")
        value = params.get(key, default)
        if value is None and kind.endswith("?"):
            values[key] = None
            continue
        if kind.startswith("int"):
            why = int_problem(value, minimum, maximum)
        else:
            why = float_problem(value, minimum) or (f"expected at most {maximum:g}" if value > maximum else None)
        if why is not None:
            raise CheckpointError(f"{shown(path)}: '{key}' = {short(value)}: {why}; fix params.json or use the one "
                                  "that came with these weights")
        values[key] = value
    return values


def _present(path: Path) -> bool:
    """There is something by that name (a FIFO too: read_json then refuses it by name)."""
    return path.exists() or path.is_symlink()


PICKLE_SUFFIXES = (".bin", ".pth", ".pt", ".ckpt")


def claims(path: Path) -> bool:
    """A .bin/.pth/.pt/.ckpt file, or a folder whose only weights are pickle-based."""
    if path.is_file():
        return path.suffix in PICKLE_SUFFIXES
    return (path.is_dir() and not any(path.glob("*.safetensors")) and not (path / INDEX).is_file()
            and ((path / BIN_INDEX).exists()
                 or any(next(path.glob(pattern), None) is not None for pattern in PICKLE_PATTERNS)))


def open_path(path: Path, allow_pickle: bool = False) -> Checkpoint:
    """Unpickling can run code: refused unless the user opted in (then weights_only=True)."""
    if not allow_pickle:
        folder = path if path.is_dir() else path.parent
        refuse_pickle(folder, [path.name] if path.is_file() else None)
        if (folder / BIN_INDEX).exists():  # an index of pickle shards, none of them present: still pickle
            refuse_pickle(folder, [BIN_INDEX])
    return open_pickle(path)
