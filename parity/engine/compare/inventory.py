"""The tensors outside the FFN layers, inventoried for ``parity compare A B``: present in both, missing, shape or
dtype changed, after the name map of B's format.  Read from headers only (safetensors headers, GGUF's tensor
index); values are not read and not judged.

Names are compared in one spelling: where one side is a GGUF file and the other uses Hugging Face names, the
Hugging Face side is translated with llama.cpp's own table (``gguf.get_tensor_name_map``), the one its
converter writes GGUF names with.  GGUF stores matrices as [out, in]: a GPT-2 Conv1D weight ([in, out]) whose
shape is the reverse counts as the same shape, in the other layout.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from parity.errors import CheckpointError

LISTED = 20  # names listed per finding; the counts are complete


def ffn_keys(side: Any) -> set[str]:
    """Every layer's FFN tensor keys of one side (``engine.side.Side``: the mapping's routes under each key prefix):
    those are judged as functions, not inventoried."""
    mapping = side.mapping
    sources = {r.source for r in [*side.reader.reference_routes(mapping.first_layer), *mapping.tensors] if r.reads}
    experts = range(side.num_experts) if side.num_experts is not None else [None]
    keys = {f"{p}{mapping.layer_prefix(layer, expert)}.{source}" for layer in range(side.num_layers)
            if mapping.serves(layer) for expert in experts for p in mapping.key_prefixes for source in sources}
    return keys.union(*(ffn_keys(part) for part in getattr(side, "parts", ())))


def headers(checkpoint: Any, names: list[str]) -> dict[str, tuple[list[int], str]] | None:
    """Shape and dtype of each tensor without reading it; None where no header can be read without fetching or
    unpickling (a hub checkpoint, a pickle-based file, the synthetic stand-in)."""
    described = checkpoint.describe(names)
    if described is not None:
        return described
    if checkpoint.repo_id is not None or checkpoint.weights != "real":
        return None
    from parity.sources.safetensors_files import describe_local

    out: dict[str, tuple[list[int], str]] = {}
    try:
        for file_name in checkpoint.files_for(names):
            path = checkpoint.fetch(file_name)
            if path.suffix != ".safetensors":
                return None
            out.update(describe_local(path, [n for n in names if checkpoint.weight_map[n] == file_name]))
    except CheckpointError:
        return None
    return out


def gguf_names(checkpoint: Any, num_layers: int) -> Any | None:
    """llama.cpp's HF -> GGUF name table for a GGUF checkpoint's architecture, or None."""
    header = getattr(checkpoint, "header", None)
    if header is None:
        return None
    import gguf

    arch = header.metadata.get("general.architecture")
    by_name = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}
    return gguf.get_tensor_name_map(by_name[arch], num_layers) if arch in by_name else None


def spelled(names: list[str], table: Any) -> dict[str, str]:
    """name -> its GGUF spelling (unchanged where the table has none)."""
    if table is None:
        return {n: n for n in names}
    return {n: table.get_name(n, try_suffixes=(".weight", ".bias")) or n for n in names}


def inventory(a: Any, b: Any, layers: list[int]) -> dict:
    """Present / missing / shape / dtype of the tensors outside the FFN, A against B (``a``, ``b``: the comparison's
    sides, engine.side.Side)."""
    skip_a, skip_b = ffn_keys(a), ffn_keys(b)
    names_a = [n for n in a.checkpoint.weight_map if n not in skip_a]
    names_b = [n for n in b.checkpoint.weight_map if n not in skip_b]
    table_a, table_b = gguf_names(a.checkpoint, a.num_layers), gguf_names(b.checkpoint, b.num_layers)
    # one side GGUF, the other Hugging Face names: translate the HF side; both alike: compare names as written
    common_a = spelled(names_a, table_b if table_a is None else None)
    common_b = spelled(names_b, table_a if table_b is None else None)
    by_b = {v: k for k, v in common_b.items()}
    both = [n for n in names_a if common_a[n] in by_b]
    record: dict[str, Any] = {
        "tensors_a": len(names_a), "tensors_b": len(names_b), "in_both": len(both),
        "missing_in_b": sorted(n for n in names_a if common_a[n] not in by_b)[:LISTED],
        "missing_in_b_count": sum(common_a[n] not in by_b for n in names_a),
        "only_in_b": sorted(n for n in names_b if common_b[n] not in set(common_a.values()))[:LISTED],
        "only_in_b_count": sum(common_b[n] not in set(common_a.values()) for n in names_b),
        "shape_differs": [], "dtype_changes": {}, "headers_read": False,
    }
    described_a = headers(a.checkpoint, both) if both else {}
    described_b = headers(b.checkpoint, [by_b[common_a[n]] for n in both]) if both else {}
    if described_a is None or described_b is None:
        return record
    record["headers_read"] = True
    changes: Counter[str] = Counter()
    for name in both:
        shape_a, dtype_a = described_a[name]
        shape_b, dtype_b = described_b[by_b[common_a[name]]]
        if list(shape_a) != list(shape_b) and list(shape_a) != list(reversed(shape_b)):
            record["shape_differs"].append({"name": name, "a": list(shape_a), "b": list(shape_b)})
        if str(dtype_a).upper() != str(dtype_b).upper():
            changes[f"{str(dtype_a).upper()} -> {str(dtype_b).upper()}"] += 1
    record["shape_differs"] = record["shape_differs"][:LISTED]
    record["dtype_changes"] = dict(changes)
    return record
