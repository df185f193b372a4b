"""The calibration file: what the cost model knows, and where each figure came from.

A calibration is JSON (``pdserve calibrate --out cal.json`` writes one):

    {"format": "pdserve-calibration/1",
     "kind": "measured" | "analytic" | "synthetic",
     "label": "measured on ..." | "analytic, not measured: ..." | "synthetic, not measured",
     "hardware": {...}, "engine": {...}, "model": {...}, "dtype": "float32",
     "workload": {... the calibration grid, repeats, limits covered ...},
     "prefill": {"chunk": [C..], "context": [P..], "seconds": [[...]], "fit": {...}},
     "decode": {"batch": [B..], "context": [L..], "seconds": [[...]], "fit": {...}},
     "sampling" | "kv_export" | "kv_import": {"x": [...], "seconds": [...], "fit": {...}},
     "overheads": {"prefill_step": {...}, "decode_step": {...}, "decode_join_s": ..},
     "control": {"rpc_s": .., "client_s": .., "idle_wait_s": ..},
     "links": {"inproc": {"latency_s": .., "bytes_per_s": ..}, ...},
     "sources": {"control.rpc_s": "measured: ..." | "assumed: ..."}}

An analytic file has ``profile`` (hardware figures with their sources) and ``model`` but
no tables. Nothing here defaults: a missing entry raises :class:`CalibrationError` naming
it (``cal.json: missing entry 'decode.seconds'``), never a silent zero.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

FORMAT = "pdserve-calibration/1"
KINDS = ("measured", "analytic", "synthetic")
ANALYTIC_LABEL = "analytic, not measured"
SYNTHETIC_LABEL = "synthetic, not measured"


class CalibrationError(ValueError):
    """A cost the calibration cannot give: a missing entry or a query outside its range."""


class Calibration:
    """A loaded calibration file: dotted lookups that fail loudly."""

    def __init__(self, data: Mapping[str, Any], source: str = "<calibration>"):
        self.data = dict(data)
        self.source = source
        fmt = self.data.get("format")
        if fmt != FORMAT:
            raise CalibrationError(f"{source}: format is {fmt!r}, expected {FORMAT!r}")
        if self.kind not in KINDS:
            raise CalibrationError(f"{source}: kind must be one of {KINDS}, got {self.kind!r}")
        must = {"analytic": ANALYTIC_LABEL, "synthetic": SYNTHETIC_LABEL}.get(self.kind)
        if must is not None and must not in self.label:
            raise CalibrationError(f"{source}: a {self.kind} calibration's label must say "
                                   f"{must!r}, got {self.label!r}")

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except OSError as e:
            raise CalibrationError(f"cannot read calibration {path}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise CalibrationError(f"{path}: not JSON: {e}") from None
        if not isinstance(data, dict):
            raise CalibrationError(f"{path}: expected a JSON object")
        return cls(data, source=path.name)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.data, indent=1, allow_nan=False) + "\n",
                        encoding="utf-8")
        return path

    @property
    def kind(self) -> str:
        return str(self.data.get("kind"))

    @property
    def label(self) -> str:
        return str(self.data.get("label", ""))

    def has(self, dotted: str) -> bool:
        try:
            self.get(dotted)
        except CalibrationError:
            return False
        return True

    def get(self, dotted: str) -> Any:
        """The entry at ``a.b.c``; CalibrationError naming it when absent or null."""
        node: Any = self.data
        for part in dotted.split("."):
            if not isinstance(node, Mapping) or node.get(part) is None:
                raise CalibrationError(f"{self.source}: missing entry {dotted!r}")
            node = node[part]
        return node

    def number(self, dotted: str, *, minimum: float = 0.0) -> float:
        """A finite number >= ``minimum`` at ``dotted``."""
        v = self.get(dotted)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) \
                or v < minimum:
            raise CalibrationError(f"{self.source}: entry {dotted!r} must be a finite number "
                                   f">= {minimum:g}, got {v!r}")
        return float(v)

    def source_of(self, dotted: str) -> str:
        """How an entry was obtained ("measured: ...", "assumed: ...", "analytic: ...")."""
        return str(self.data.get("sources", {}).get(dotted, self.kind))

    def header(self) -> dict[str, Any]:
        """Identity of the calibration, carried into every simulation output."""
        keys = ("kind", "label", "hardware", "engine", "model", "dtype", "workload",
                "profile", "created_unix_s")
        out = {k: self.data[k] for k in keys if k in self.data}
        out["file"] = self.source
        assumed = {k: v for k, v in self.data.get("sources", {}).items()
                   if not str(v).startswith("measured")}
        if assumed:
            out["not_measured"] = assumed
        return out
