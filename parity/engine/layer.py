"""Reading one layer's FFN tensors, exactly as stored, through the mapping's routes.

Only the tensors of the requested layer (one expert of it, for MoE) are read; MoE tensors
stacked over experts (GGUF ``*_exps``) are read once per layer and sliced.  Tensors are
checked here, before any module sees them: a quantized integer tensor or a NaN in the
checkpoint is bad input (exit 2), not a module mismatch.
"""

from __future__ import annotations

import functools
import hashlib
import math
import zlib
from collections.abc import Iterator
from collections.abc import Mapping as MappingABC
from dataclasses import dataclass

import torch

from parity.definitions.mapping import Mapping, TensorRoute, route_key
from parity.engine.reference import ReferenceModel
from parity.errors import CheckpointError, MappingError, MissingTensorError, ShapeMismatchError, WeightDefectError
from parity.sources.checkpoint import Checkpoint

FP8 = {getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                          "float8_e8m0fnu") if hasattr(torch, name)}


@dataclass(frozen=True)
class TensorFacts:
    """What one pass over a stored tensor's bytes tells (read once, asked many times): its range (finite? all
    zero?) and a CRC-32 of its bytes (same weights? two identical matrices?)."""

    low: float
    high: float
    crc: int

    @property
    def all_zero(self) -> bool:
        return self.low == 0.0 and self.high == 0.0


def tensor_facts(tensor: torch.Tensor) -> TensorFacts:
    """aminmax (~12 GB/s, NaN-propagating) and zlib.crc32 (~7 GB/s) over the stored bytes: together cheaper than
    the blake2b hash (~1 GB/s) and the separate isfinite/any passes they replace (scripts/bench.py row (f))."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    if tensor.is_floating_point() and flat.numel():
        low, high = (float(v) for v in torch.aminmax(flat))
    else:
        low = high = 0.0
    return TensorFacts(low, high, zlib.crc32(flat.view(torch.uint8).numpy()) if flat.numel() else 0)


class LayerReader:
    """The checkpoint's tensors for one layer at a time, under names relative to the layer."""

    def __init__(self, mapping: Mapping, checkpoint: Checkpoint, reference: ReferenceModel, num_experts: int | None):
        self.mapping = mapping
        self.checkpoint = checkpoint
        self.reference = reference
        self.num_experts = num_experts
        self._stacked: tuple[str, dict[str, torch.Tensor]] | None = None  # MoE: the last layer's all-expert tensors
        self.facts: dict[str, TensorFacts] = {}  # of the tensors the last ``read`` returned, by relative name

    def reference_routes(self, layer: int) -> list[TensorRoute]:
        """Reference parameter (HF name) <- checkpoint tensor; by default the same name.  For MoE: the
        expert's gate, up and down tensors, which parity.engine.experts puts into transformers' experts module."""
        if self.mapping.experts is not None:
            return self.mapping.experts.routes
        given = {route.target: route for route in self.mapping.reference_tensors}
        names = self.reference.tensor_shapes(self.mapping.reference_path(layer))
        return [given.get(name, TensorRoute(name, name)) for name in names]

    def layer_prefix(self, layer: int, expert: int | None = None) -> str:
        """The checkpoint key prefix under which this layer's (expert's) FFN tensors are stored."""
        sources = [route.source for route in self.reference_routes(layer)]
        block = self.mapping.layer_prefix(layer, expert)
        for prefix in self.mapping.key_prefixes:
            if all(self.checkpoint.has(f"{prefix}{block}.{name}") for name in sources):
                return f"{prefix}{block}."
        hints = self.checkpoint.missing_hint([f"{self.mapping.key_prefixes[0]}{block}.{name}" for name in sources])
        raise MissingTensorError(
            f"{self.checkpoint.location}: layer {layer}'s FFN tensors are missing (tried key prefixes "
            f"{self.mapping.key_prefixes} from {self.mapping.path.name}): {hints}"
        )

    def read(self, layer: int, expert: int | None = None,
             dtype: torch.dtype | None = torch.float32) -> dict[str, torch.Tensor]:
        """The layer's FFN tensors under names relative to the layer, upcast to ``dtype`` (None: as stored)."""
        prefix = self.layer_prefix(layer, expert)
        routes = [*self.reference_routes(layer), *self.mapping.tensors]
        wanted = list(dict.fromkeys(r.source for r in routes
                                    if r.reads and (not r.optional or self.checkpoint.has(prefix + r.source))))
        raw = self._read(prefix, wanted, expert)
        tensors, self.facts = {}, {}
        for name in wanted:
            tensor = raw.pop(prefix + name)
            self.facts[name] = self._check(prefix + name, tensor)
            tensors[name] = tensor
        self._check_routes(routes, tensors, prefix)
        return common_dtype(tensors) if dtype is None else {n: t.to(dtype) for n, t in tensors.items()}

    def will_need(self, layer: int, expert: int | None = None) -> None:
        """Tell the checkpoint that ``read(layer, expert)`` comes soon (its tensors stored apart; a stack over experts
        is read once per layer anyway): a local safetensors file has the kernel read their bytes ahead."""
        try:
            prefix = self.layer_prefix(layer, expert)
        except MissingTensorError:  # the read itself says so, in its turn
            return
        stacked = set(self.mapping.experts.stacked) if self.mapping.experts is not None else set()
        routes = [*self.reference_routes(layer), *self.mapping.tensors]
        self.checkpoint.will_need(list(dict.fromkeys(prefix + r.source for r in routes
                                                     if r.reads and r.source not in stacked)))

    def read_one(self, layer: int, expert: int | None, name: str, dtype: torch.dtype) -> torch.Tensor:
        """One of the layer's FFN tensors (relative name), checked as ``read`` checks it, in ``dtype``."""
        key = self.layer_prefix(layer, expert) + name
        tensor = self._read(key[:-len(name)], [name], expert)[key]
        self._check(key, tensor)
        return tensor.to(dtype)

    def _check_routes(self, routes: list[TensorRoute], tensors: dict[str, torch.Tensor], prefix: str) -> None:
        """A route's chunk must divide its tensor and a transpose needs a matrix: else the mapping does not fit
        this checkpoint (exit 2), which must not pass for a module mismatch (exit 1)."""
        for route in routes:
            tensor = tensors.get(route.source)
            if tensor is None:
                continue
            table = "tensors" if route in self.mapping.tensors else "reference.tensors"
            where = (f"{self.mapping.where(route_key(table, route.target))}: the route to '{route.target}' from "
                     f"'{prefix}{route.source}'")
            if route.chunk is not None and (tensor.dim() == 0 or tensor.shape[0] % route.chunk[1]):
                raise MappingError(f"{where} takes chunk {list(route.chunk)}, but the tensor's shape "
                                   f"{list(tensor.shape)} does not split into {route.chunk[1]} equal parts along "
                                   "dim 0; fix the mapping's chunk")
            if route.transform == "transpose" and tensor.dim() > 2:
                raise MappingError(f"{where} transposes it, but the tensor has shape {list(tensor.shape)}: only a "
                                   "matrix can be transposed; fix the mapping's transform")

    def _check(self, key: str, tensor: torch.Tensor) -> TensorFacts:
        """A float tensor without NaN/Inf, else CheckpointError; returns what the one pass over it found."""
        if tensor.dtype in FP8:
            raise CheckpointError(
                f"{self.checkpoint.location}: tensor '{key}' is stored as {tensor.dtype} (FP8) where config.json "
                "states no FP8 quantization parity reads for it: its true values are these times scale tensors "
                "(weight_scale_inv, per block) that only a stated quantization_config applies (quant_method 'fp8' "
                "or compressed-tensors' float-quantized); comparing raw FP8 values would judge other weights than "
                "the model runs"
            )
        if not tensor.is_floating_point():
            raise CheckpointError(
                f"{self.checkpoint.location}: tensor '{key}' is stored as {tensor.dtype}, not floating "
                "point (a quantized checkpoint?); parity compares float weights: dequantize it first"
            )
        facts = tensor_facts(tensor)
        if not (math.isfinite(facts.low) and math.isfinite(facts.high)):
            bad = int((~torch.isfinite(tensor)).sum())
            raise WeightDefectError(
                f"{self.checkpoint.location}: tensor '{key}' holds {bad} NaN/Inf values: "
                "the checkpoint is defective (not a module mismatch)"
            )
        return facts

    def _read(self, prefix: str, names: list[str], expert: int | None) -> dict[str, torch.Tensor]:
        """checkpoint.read, except that MoE tensors stacked over experts are read once per layer and sliced."""
        stacked = set(self.mapping.experts.stacked) if self.mapping.experts is not None else set()
        plain = [prefix + n for n in names if n not in stacked]
        out = self.checkpoint.read(plain) if plain else {}
        wanted = [prefix + n for n in names if n in stacked]
        if wanted:
            if self._stacked is None or self._stacked[0] != prefix:
                self._stacked = None  # release the previous layer's stack first
                self._stacked = (prefix, self.checkpoint.read(wanted))
            for key in wanted:
                tensor = self._stacked[1][key]
                if self.mapping.experts.flat and tensor.dim() and self.num_experts \
                        and tensor.shape[0] % self.num_experts == 0:  # [E·ff, d]: each expert's ff rows in turn
                    tensor = tensor.view(self.num_experts, -1, *tensor.shape[1:])
                if tensor.dim() == 0 or tensor.shape[0] != self.num_experts:
                    raise ShapeMismatchError(f"{self.checkpoint.location}: '{key}' (shape {list(tensor.shape)}) "
                                             f"stacks {tensor.shape[0] if tensor.dim() else 0} experts, the config "
                                             f"says {self.num_experts}")
                out[key] = tensor[expert].t() if self.mapping.experts.transposed else tensor[expert]
        return out


def route_tensor(route: TensorRoute, stored: torch.Tensor) -> torch.Tensor:
    """Apply a route's chunk and transform to the stored tensor: how a stored tensor becomes the parameter a route
    names, in transformers' module (both flows) and in a check's target alike."""
    tensor = stored
    if route.chunk is not None:
        index, count = route.chunk
        if tensor.shape[0] % count:
            raise ShapeMismatchError(
                f"tensor '{route.source}' {tuple(tensor.shape)}: dim 0 is not divisible into {count} chunks"
            )
        tensor = tensor[index::count] if route.interleaved else tensor.chunk(count, dim=0)[index]
    if route.transform == "transpose":
        tensor = tensor.t()
    return tensor


def common_dtype(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A layer whose FFN tensors are stored in several float dtypes (up_proj F64, the others F32) is computed
    in one: the widest of them (``torch.promote_types``), chosen once here.  Upcasting is exact, so both
    modules see the stored values; the reference then computes as it would on a checkpoint stored wholly in
    that dtype.  A layer stored in one dtype is returned as is (no copy)."""
    dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(dtypes) <= 1:
        return tensors
    wide = functools.reduce(torch.promote_types, sorted(dtypes, key=str))
    return {name: t.to(wide) if t.is_floating_point() else t for name, t in tensors.items()}


def weights_fingerprint(tensors: dict[str, torch.Tensor], facts: dict[str, TensorFacts] | None = None) -> str:
    """A short hash of a layer's stored FFN tensors (names, dtypes, shapes, and each one's CRC-32 of its bytes,
    from ``facts`` when the read computed them): a baseline of other weights must not be compared as if it
    were this checkpoint's.  A fingerprint tells weights apart, it guards against no adversary: CRC-32 at ~7 GB/s
    instead of blake2b's ~1 GB/s over every byte (~70 ms per 1B-model layer before)."""
    facts = facts or {}
    digest = hashlib.blake2b(digest_size=8)
    for name in sorted(tensors):
        tensor = tensors[name]
        crc = facts[name].crc if name in facts else tensor_facts(tensor).crc
        digest.update(f"{name}|{tensor.dtype}|{list(tensor.shape)}|{crc}|".encode())
    return FINGERPRINT_SCHEME + digest.hexdigest()


# Fingerprints before the scheme had a name were blake2b over every byte (16 hex digits): a baseline entry with
# one is compared without confirming its weights (as a format-1 entry), never reported as other weights.
FINGERPRINT_SCHEME = "crc32:"


def all_finite(tensor: torch.Tensor) -> bool:
    """No NaN/Inf (aminmax propagates NaN and returns any Inf: one pass)."""
    facts = tensor_facts(tensor)
    return math.isfinite(facts.low) and math.isfinite(facts.high)


class LayerOnDisk(MappingABC):
    """A layer's stored tensors, each read from the checkpoint when it is asked for and not kept.

    Filling the float32 target of a very large layer (one of Llama-3.1-405B: 10.5 GB) is the floor of
    its check; holding the 5.2 GB of bfloat16 tensors beside it is not needed: they are read again
    one at a time, copied into the target's parameter and dropped.  ``meta`` gives names, shapes and
    dtypes without reading anything.
    """

    def __init__(self, reader: LayerReader, layer: int, expert: int | None, tensors: dict[str, torch.Tensor]):
        self.reader, self.layer, self.expert = reader, layer, expert
        self.meta = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in tensors.items()}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.meta:
            raise KeyError(name)
        return self.reader.read_one(self.layer, self.expert, name, self.meta[name].dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self.meta)

    def __len__(self) -> int:
        return len(self.meta)
