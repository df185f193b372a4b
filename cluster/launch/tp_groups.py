"""The Ray side of tensor-parallel workers: one placement group per worker (STRICT_PACK:
all its ranks on one node, one bundle per rank), and the actors of ranks 1..N-1
(runtime.worker.TPRank) in bundles 1..N-1. Rank 0 is the worker actor itself (bundle 0),
created by the launcher as for a one-rank worker; when it starts it has the other ranks
join its group (runtime.worker.WorkerBase).

Faults: a rank that dies fails rank 0's next step; rank 0 then ends its process, Ray
restarts it (`pools.max_restarts`), the router re-dispatches its requests as for any dead
worker, and the restarted rank 0 re-forms the group with the rank actors (a dead one is
restarted by Ray too, and its `join` waits for it).
"""

from __future__ import annotations

import contextlib
import logging

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from cluster.launch.placement import WorkerPlacement, actor_options
from runtime.spec import WorkerSpec
from runtime.worker import RemoteTPRank, rank_actor_name

log = logging.getLogger(__name__)
READY_TIMEOUT_S = 300.0


class TPGroups:
    """Placement groups and rank actors of the service's TP workers (closed together)."""

    def __init__(self) -> None:
        self.placement_groups: list[PlacementGroup] = []
        self.rank_actors: list = []

    def start(self, spec: WorkerSpec, w: WorkerPlacement, max_restarts: int
              ) -> PlacementGroup | None:
        """Reserve `w`'s placement group and start its ranks 1..N-1; the group (whose
        bundle 0 is for the worker actor), or None for a one-rank worker."""
        if w.tp == 1:
            return None
        bundles = w.bundles()
        pg = placement_group(bundles, strategy="STRICT_PACK", name=f"{spec.actor_name}-pg")
        self.placement_groups.append(pg)
        try:
            ray.get(pg.ready(), timeout=READY_TIMEOUT_S)
        except GetTimeoutError:
            raise RuntimeError(
                f"{w.worker_id}: no node can hold its tensor-parallel group of {w.tp} ranks "
                f"({bundles[0]} each, all on one node) within {READY_TIMEOUT_S:.0f}s; the "
                f"cluster has {ray.available_resources()} free") from None
        for r in range(1, w.tp):
            opts = actor_options(w, rank_actor_name(spec.actor_name, r), max_restarts, pg, r)
            self.rank_actors.append(RemoteTPRank.options(**opts).remote(spec, r))
        log.info("%s: tensor-parallel group of %d ranks in placement group %s",
                 w.worker_id, w.tp, pg.id.hex())
        return pg

    def close(self) -> None:
        for a in self.rank_actors:
            with contextlib.suppress(Exception):
                ray.kill(a, no_restart=True)
        for pg in self.placement_groups:
            with contextlib.suppress(Exception):
                remove_placement_group(pg)
        self.rank_actors, self.placement_groups = [], []
