"""The worker side of fault injection (tests and soak runs only).

Fault injection is OFF unless a plan is given, by the launcher
(`LaunchOptions(fault_injection=...)` -> `WorkerSpec.faults`) or by the `PDSERVE_FAULTS`
environment variable (a JSON plan, see kv_transfer/faults.py) in the worker actors'
environment, e.g. `PDSERVE_FAULTS='{"faults": [{"kind": "delay", "probability": 0.1}]}'
ray start ...`. Production sets neither; without a plan no wrapper is installed and
nothing runs. Killing worker actors is cluster/faults.py's job.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from kv_transfer.faults import ENV_VAR, FaultInjector, FaultPlan
from runtime.spec import WorkerSpec


def fault_plan(spec_faults: FaultPlan | None, environ: Mapping[str, str] | None = None
               ) -> FaultPlan:
    """The plan of a worker: its spec's plan plus `$PDSERVE_FAULTS`."""
    env = (os.environ if environ is None else environ).get(ENV_VAR, "")
    return (spec_faults or FaultPlan()).merged(FaultPlan.parse(env))


def worker_fault_injector(spec: WorkerSpec, environ: Mapping[str, str] | None = None
                          ) -> FaultInjector | None:
    """A FaultInjector for this worker, or None when no fault applies."""
    if not spec.faults.faults and not (os.environ if environ is None else environ).get(ENV_VAR):
        return None  # the production path: no parsing, no wrapper
    plan = fault_plan(spec.faults, environ).for_worker(spec.worker_id)
    return FaultInjector(plan, spec.worker_id) if plan.faults else None
