"""Chaos for tests and soak runs: the worker side of fault injection, and finding and
killing the worker actors of a running service.

Fault injection is OFF unless a plan is given, by `LaunchOptions(fault_injection=...)`
(-> `WorkerSpec.fault_injection`) or by the `PDSERVE_FAULTS` environment variable (a
JSON plan, see kv_transfer/faults.py) in the worker actors' environment, e.g.
`PDSERVE_FAULTS='{"faults": [{"kind": "delay", "probability": 0.1}]}' ray start ...`.
Production never sets either; without a plan no wrapper is installed and nothing runs.

Killing: the launcher names every worker actor `pdserve-<6 hex>-<role>-<n>` in the
job's namespace. `find_worker_actors` lists them over all namespaces of the Ray cluster
this process is connected to (`ray.init(address=...)`), grouped by service tag;
`kill_worker` is `ray.kill(actor, no_restart=False)`, so Ray restarts the actor
(`pools.max_restarts`) and the router re-adopts it.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kv_transfer.faults import ENV_VAR, FaultInjector, FaultPlan

ACTOR_NAME = re.compile(r"^(?P<tag>pdserve-[0-9a-f]+)-(?P<worker>(?P<role>prefill|decode)-\d+)$")


def fault_plan(spec_faults: Mapping[str, Any] | None,
               environ: Mapping[str, str] | None = None) -> FaultPlan:
    """The plan of a worker: its spec's `fault_injection` plus `$PDSERVE_FAULTS`."""
    env = (os.environ if environ is None else environ).get(ENV_VAR, "")
    return FaultPlan.parse(dict(spec_faults or {})).merged(FaultPlan.parse(env))


def worker_fault_injector(spec, environ: Mapping[str, str] | None = None
                          ) -> FaultInjector | None:
    """A FaultInjector for this worker (a WorkerSpec), or None when no fault applies."""
    if not spec.fault_injection and not (os.environ if environ is None else environ).get(ENV_VAR):
        return None  # the production path: no parsing, no wrapper
    plan = fault_plan(spec.fault_injection, environ).for_worker(spec.worker_id)
    return FaultInjector(plan, spec.worker_id) if plan.faults else None


# ---- finding and killing the worker actors of a running service ------------------------
@dataclass(frozen=True)
class WorkerActor:
    name: str  # the Ray actor name, e.g. "pdserve-3fa2c1-decode-0"
    namespace: str
    tag: str  # the service: "pdserve-3fa2c1"
    worker_id: str  # "decode-0"
    role: str  # "prefill" | "decode"

    def handle(self):
        import ray

        return ray.get_actor(self.name, namespace=self.namespace)


def find_worker_actors(tag: str | None = None) -> list[WorkerActor]:
    """The live named worker actors (of service `tag`, else of the only service found)."""
    import ray

    found: list[WorkerActor] = []
    for a in ray.util.list_named_actors(all_namespaces=True):
        m = ACTOR_NAME.match(a["name"])
        if m:
            found.append(WorkerActor(a["name"], a["namespace"], m["tag"], m["worker"],
                                     m["role"]))
    tags = sorted({w.tag for w in found})
    if tag is None:
        if len(tags) > 1:
            raise ValueError(f"several pdserve services in this Ray cluster: {tags}; "
                             "choose one (--actor-tag)")
        return sorted(found, key=lambda w: w.name)
    return sorted((w for w in found if w.tag == tag), key=lambda w: w.name)


def service_tag(actor_handle) -> str:
    """The tag of the service one of whose worker actor handles this is (tests)."""
    import ray

    want = actor_handle._actor_id
    for a in ray.util.list_named_actors(all_namespaces=True):
        m = ACTOR_NAME.match(a["name"])
        if m and ray.get_actor(a["name"], namespace=a["namespace"])._actor_id == want:
            return m["tag"]
    raise LookupError("no named pdserve worker actor has this handle")


def kill_worker(w: WorkerActor) -> None:
    """Kill the actor's process; Ray restarts it (restart allowed)."""
    import ray

    ray.kill(w.handle(), no_restart=False)


def wait_worker_back(w: WorkerActor, timeout_s: float = 180.0) -> float | None:
    """Seconds until the (restarted) actor answers `ping` again; None on timeout."""
    import ray

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            ray.get(w.handle().ping.remote(), timeout=min(30.0, timeout_s))
            return time.monotonic() - t0
        except Exception:  # restarting, or the name is briefly gone
            time.sleep(0.5)
    return None
