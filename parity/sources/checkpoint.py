"""Checkpoint access: where each tensor lives, and reading only the tensors asked for.

A ``Checkpoint`` knows its config.json and a map tensor-name -> file.  Files are obtained
through ``fetch`` only when a tensor in them is read: a local folder returns its own
files, the synthetic default writes it.  Reading goes through ``safe_open``, so only the
requested tensors are ever materialised; a hub checkpoint with network instead reads the
byte ranges of those tensors of shards it has not cached (``reader``).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from parity.errors import MissingTensorError, PickleRefusedError, UnstatedModuleError

PICKLE_PATTERNS = ("pytorch_model*.bin", "consolidated*.pth", "*.pt", "*.ckpt")


@dataclass
class Checkpoint:
    location: str  # what the reports show: a path, or hub id@revision
    config_dir: Path | None  # folder holding config.json; None: build the config from raw_config (GGUF, Meta)
    raw_config: dict
    weight_map: dict[str, str]  # tensor name -> file name
    fetch: Callable[[str], Path]  # file name -> local path, obtained on first use
    weights: str = "real"  # "real" | "synthetic"
    weights_note: str | None = None
    repo_id: str | None = None  # set for hub checkpoints
    revision: str | None = None
    notes: list[str] = field(default_factory=list)  # how the checkpoint was interpreted (GGUF, Meta), for the report
    # (file name, tensor names in it) -> tensors as stored.  Safetensors formats pass
    # safetensors_files.local_reader(fetch); the hub one that reads byte ranges of uncached shards.
    reader: Callable[[str, list[str]], dict] | None = None

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def closest(self, name: str, n: int = 3) -> list[str]:
        return difflib.get_close_matches(name, list(self.weight_map), n=n, cutoff=0.5)

    def missing_hint(self, names: list[str]) -> str:
        """'name (closest present: a, b)' for each of ``names`` not in the checkpoint."""
        return "; ".join(f"{m} (closest present: {', '.join(self.closest(m)) or 'none'})"
                         for m in names if not self.has(m))

    def require(self, names: list[str]) -> None:
        if not all(self.has(n) for n in names):
            raise MissingTensorError(f"{self.location}: missing tensors: {self.missing_hint(names)}")

    def describe(self, names: list[str]) -> dict[str, tuple[list[int], str]] | None:
        """Shape and stored type of these tensors without reading them, where the format's own
        index holds both (GGUF); None: read them from the safetensors headers instead."""
        return None

    def files_for(self, names: list[str]) -> list[str]:
        return sorted({self.weight_map[n] for n in names})

    def read(self, names: list[str]):
        """Read exactly these tensors (dtype as stored) -> {name: tensor}."""
        self.require(names)
        out = {}
        for file_name in self.files_for(names):
            in_file = [name for name in names if self.weight_map[name] == file_name]
            out.update(self.reader(file_name, in_file))
        return out

    def will_need(self, names: list[str]) -> None:
        """Tell the reader these tensors will be read soon (a local safetensors file: the kernel reads their bytes
        ahead, safetensors_files.will_need); nothing where the reader cannot be told (the hub's reader, which would
        have to download for it; another format's)."""
        known = [name for name in names if name in self.weight_map]
        hint = getattr(self.reader, "will_need", None)
        if hint is None:
            return
        for file_name in self.files_for(known):
            hint(file_name, [name for name in known if self.weight_map[name] == file_name])


def refuse_pickle(folder: Path, pickles: list[str] | None = None) -> None:
    pickles = pickles or [p.name for pattern in PICKLE_PATTERNS for p in sorted(folder.glob(pattern))]
    if pickles:
        raise PickleRefusedError(
            f"{folder}: holds only pickle-based weights ({', '.join(pickles)}). Unpickling can run arbitrary code, "
            "so parity does not open them by default. If you trust the file, pass --allow-pickle "
            "(allow_pickle=True in Python; it is then read with torch.load(weights_only=True)), or convert the "
            "checkpoint to safetensors (model.save_pretrained(..., safe_serialization=True))."
        )


def check_converted(module: str, skipped: tuple[str, ...], where: str, key: str = "modules_to_not_convert") -> None:
    """Refuse quantized ``module`` where the config's skip list (``key``) names it, by transformers' own rule
    (``should_convert_module``: a prefix up to a module boundary, a regex, or a suffix), which its FP8, AWQ,
    bitsandbytes and MXFP4 integrations apply before loading: an unquantized Linear would take the codes."""
    from transformers.quantizers.quantizers_utils import should_convert_module

    if skipped and not should_convert_module(module, list(skipped)):
        named = next(p for p in skipped if not should_convert_module(module, [p]))
        raise UnstatedModuleError(where, module, f"quantization_config.{key} names it ({named!r})",
                                  "transformers would keep it a Linear and load its codes as its weight")


def split_companions(checkpoint: Checkpoint, suffixes: tuple[str, ...]) -> tuple[dict[str, str], dict[str, str]]:
    """``checkpoint``'s weight map as a quantized format reads it: its weights, and the tensors whose names end in one
    of ``suffixes`` (the scales, zero points, quant states the format stores beside a weight: part of its storage,
    not tensors of the model)."""
    companions = {n: f for n, f in checkpoint.weight_map.items() if n.endswith(suffixes)}
    return {n: f for n, f in checkpoint.weight_map.items() if n not in companions}, companions


def dequantized_on_read(checkpoint: Checkpoint, kind: type, scheme, weights: dict[str, str],
                        companions: dict[str, str], *, matrices: int, dequantized_with: str,
                        stated_in: str = "quantization_config") -> Checkpoint:
    """``checkpoint`` as a quantized format's subclass ``kind`` (which dequantizes on read), holding ``weights`` as its
    weight map and ``companions`` (the tensors the format stores beside them) apart, with the ``scheme`` its config
    states; its note says what the report rests on: the scheme, how many ``matrices`` are quantized, what dequantizes
    them, what was left unquantized (a scheme's ``not_converted``), and that target and reference read the same."""
    fields = {f.name: getattr(checkpoint, f.name) for f in dataclasses.fields(Checkpoint)}
    wrapped = kind(**{**fields, "weight_map": weights, "notes": list(checkpoint.notes)})
    wrapped.scheme, wrapped.companions, wrapped.as_stored = scheme, companions, {}
    left = getattr(scheme, "not_converted", ())
    wrapped.notes.append(f"{scheme.describe()} (config.json {stated_in}): {matrices} quantized matrices, dequantized "
                         f"with {dequantized_with}" + (f"; left unquantized: {', '.join(left)}" if left else "")
                         + "; target and reference both get the same dequantized float32 weights")
    return wrapped
