"""What ``parity compare A B`` reports: a check's Report and LayerResult, plus what each layer's conversion is and
what it may change (the JSON's ``comparison`` and ``layers[].conversion``; parity/schema/report.schema.json)."""

from __future__ import annotations

from dataclasses import dataclass, field

from parity.definitions.records import Diagnosis
from parity.engine.compare.storage import Storage
from parity.engine.results import LayerResult, Report


@dataclass
class CompareLayer(LayerResult):
    """A layer of B judged against A's: a check's verdict and metrics, plus what the conversion changed."""

    # {kind, tolerance_rule, conversion_deviation, ratio_to_conversion, identical, tensors: [...]}
    conversion: dict | None = None


@dataclass
class CompareReport(Report):
    """The report of ``parity compare A B``: a check's Report (``target`` names B), plus ``comparison``."""

    # {reference, candidate, mappings, inventory, outside_ffn}: see parity/schema/report.schema.json
    comparison: dict = field(default_factory=dict)

    def __str__(self) -> str:
        """The comparison's text table (``parity.outputs.compare_text`` registers it when imported)."""
        from parity.engine import results

        renderer = results._RENDERERS.get("compare")
        return renderer(self) if renderer is not None else super().__str__()


def unloadable(layer: int, found: Diagnosis, rows: list[dict], weights: str) -> CompareLayer:
    """A layer of B that A's MLP cannot hold: failed, with the shape finding."""
    result = CompareLayer(layer=layer, passed=False, max_abs_diff=None, max_rel_diff=None, mean_abs_diff=None,
                          max_at=None, noise_floor=None, tolerance=None, ratio_to_noise=None, preactivation_range=None,
                          weights=weights, diagnosis=found)
    result.conversion = {"kind": "shape differs", "tolerance_rule": None, "conversion_deviation": None,
                         "ratio_to_conversion": None, "identical": False, "tensors": plain_rows(rows)}
    return result


def conversion_record(rows: list[dict], storage: dict[str, Storage], conv_dev: float, max_abs: float | None,
                      factor: float, changed: bool, *, why: str | None = None) -> dict:
    """What the layer's conversion is and what it may change (the JSON's ``layers[].conversion``)."""
    kinds = sorted({f"{row['a_dtype']} -> {row['storage']}" for row in rows if row["a_dtype"] != row["storage"]})
    quantized = any(s.quantized for s in storage.values())
    kind = ("quantized " if quantized else "cast ") + ", ".join(kinds) if kinds else "same dtype"
    rule = ("16 x noise floor (same dtype: only float32 noise may differ)" if not changed else
            f"max(16 x noise floor, {factor:g} x the deviation of A's tensors "
            f"{'re-quantized' if quantized else 'rounded'} as B stores them)" + (f"; {why}" if why else ""))
    identical = all(row["identical"] for row in rows)
    return {"kind": kind, "tolerance_rule": rule, "conversion_deviation": conv_dev,
            "ratio_to_conversion": (max_abs / conv_dev if conv_dev else None) if max_abs is not None else None,
            "identical": identical, "tensors": plain_rows(rows)}


def plain_rows(rows: list[dict]) -> list[dict]:
    """The rows as JSON holds them (the overflow text is the diagnosis's)."""
    return [{k: v for k, v in row.items() if k != "overflow"} for row in rows]
