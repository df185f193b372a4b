"""Chaos for tests and soak runs: finding and killing the worker actors of a running
service (the worker side of fault injection is runtime/spec.py).

The launcher names every worker actor `pdserve-<6 hex>-<role>-<n>` in the job's
namespace. `find_worker_actors` lists them over all namespaces of the Ray cluster this
process is connected to (`ray.init(address=...)`), grouped by service tag; `kill_worker`
is `ray.kill(actor, no_restart=False)`, so Ray restarts the actor (`pools.max_restarts`)
and the router re-adopts it.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

ACTOR_NAME = re.compile(r"^(?P<tag>pdserve-[0-9a-f]+)-(?P<worker>(?P<role>prefill|decode)-\d+)$")


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
