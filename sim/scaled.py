"""A cost model whose compute is scaled by a measured contention factor.

On a shared machine the same step costs more while other processes run. A calibration
taken at one moment is brought to the load of another by timing a few reference steps
then and there (``contention_probe``) and scaling every compute term -- model steps,
sampling, KV copies, per-step overheads -- by the ratio to the same probe at calibration
time. Links and control-plane latencies are left as measured.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sim.costs import CostModel, Limits, LinkCost

# reference steps of the probe: (prefill chunk C, context P) and (decode batch, context)
PROBE_PREFILL = ((128, 0), (256, 256))
PROBE_DECODE = ((1, 128), (4, 256))


def contention_probe(m) -> float:
    """Seconds of the reference steps with ``m`` (a sim.measure.Measurer), its ``stat``."""
    return (sum(m.prefill_chunks([cp]) for cp in PROBE_PREFILL)
            + sum(m.decode_batch([ctx] * b) for b, ctx in PROBE_DECODE))


class ScaledCosts(CostModel):
    def __init__(self, base: CostModel, factor: float, why: str):
        if not factor > 0:
            raise ValueError(f"contention factor must be > 0, got {factor}")
        self.base, self.factor = base, factor
        self.calibration = base.calibration
        self.label = f"{base.label}; compute x{factor:.2f} ({why})"

    def prefill_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        return self.base.prefill_s(chunks) * self.factor

    def decode_run_s(self, batch: int, context: int, longest: int,
                     steps: int) -> Sequence[float]:
        return np.asarray(self.base.decode_run_s(batch, context, longest, steps)) * self.factor

    def sample_s(self, rows: int) -> float:
        return self.base.sample_s(rows) * self.factor

    def kv_export_s(self, tokens: int) -> float:
        return self.base.kv_export_s(tokens) * self.factor

    def kv_import_s(self, tokens: int) -> float:
        return self.base.kv_import_s(tokens) * self.factor

    def step_overhead_s(self, role: str, items: int) -> float:
        return self.base.step_overhead_s(role, items) * self.factor

    def link(self, name: str) -> LinkCost:
        return self.base.link(name)

    def check_covers(self, limits: Limits) -> None:
        self.base.check_covers(limits)
