"""A cost model whose compute is scaled by measured contention factors, one per role.

On a shared machine the same step costs more while other processes run -- other users,
and on a small box the service's own workers, router and client. A calibration taken at
one moment is brought to the conditions of a run by a factor per role: a prefill
worker's compute (model steps, KV export, its step overhead) and a decode worker's
(model steps, KV import, sampling, its step overhead). Links and control-plane latencies
are left as measured. bench/sim_validate.py measures the factors on a separate run of the
same configuration and load, as the ratio of the real workers' mean step time to the
simulator's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from sim.costs import ROLES, CostModel, Limits, LinkCost


class ScaledCosts(CostModel):
    def __init__(self, base: CostModel, factors: Mapping[str, float], why: str):
        if set(factors) != set(ROLES) or not all(f > 0 for f in factors.values()):
            raise ValueError(f"contention factors must be > 0 for each of {ROLES}, "
                             f"got {dict(factors)}")
        self.base, self.factors = base, dict(factors)
        self.calibration = base.calibration
        fp, fd = self.factors["prefill"], self.factors["decode"]
        self.label = f"{base.label}; compute x{fp:.2f} prefill, x{fd:.2f} decode ({why})"

    def prefill_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        return self.base.prefill_s(chunks) * self.factors["prefill"]

    def decode_run_s(self, batch: int, context: int, longest: int,
                     steps: int) -> Sequence[float]:
        return (np.asarray(self.base.decode_run_s(batch, context, longest, steps))
                * self.factors["decode"])

    def sample_s(self, rows: int) -> float:  # both roles sample; decode does it every step
        return self.base.sample_s(rows) * self.factors["decode"]

    def kv_export_s(self, tokens: int) -> float:
        return self.base.kv_export_s(tokens) * self.factors["prefill"]

    def kv_import_s(self, tokens: int) -> float:
        return self.base.kv_import_s(tokens) * self.factors["decode"]

    def step_overhead_s(self, role: str, items: int) -> float:
        return self.base.step_overhead_s(role, items) * self.factors[role]

    def link(self, name: str) -> LinkCost:
        return self.base.link(name)

    def check_covers(self, limits: Limits) -> None:
        self.base.check_covers(limits)
