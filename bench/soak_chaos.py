"""The soak's chaos: kill worker actors through Ray (cluster/launch/faults.py) while traffic runs.

With ``kill_every_s`` a random worker of alternating pools is killed every S seconds
after the previous victim is back, at most ``max_restarts`` times per actor.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass

from bench.soak_plan import SoakConfig

log = logging.getLogger(__name__)


@dataclass
class KillRecord:
    at_s: float
    worker_id: str
    role: str
    actor: str
    back_after_s: float | None  # None: did not come back in restart_timeout_s


async def chaos(cfg: SoakConfig, actors: list, t0: float, traffic_done: asyncio.Event,
                kills: list[KillRecord]) -> None:
    """Kill actors until ``max_kills`` (or, without it, until the traffic is done);
    appends to ``kills`` as it goes (the report reads them)."""
    if not actors:
        return
    from cluster.launch.faults import kill_worker, wait_worker_back

    loop = asyncio.get_running_loop()
    rng = random.Random(cfg.seed + 1)
    offset = rng.randrange(len(cfg.kill_roles))
    kills_of: dict[str, int] = {}
    while cfg.max_kills is None or len(kills) < cfg.max_kills:
        if cfg.max_kills is None and traffic_done.is_set():
            return
        await asyncio.sleep(cfg.kill_every_s)
        roles = [cfg.kill_roles[(len(kills) + offset + k) % len(cfg.kill_roles)]
                 for k in range(len(cfg.kill_roles))]
        victim = None
        for role in roles:
            pool = [a for a in actors if a.role == role
                    and kills_of.get(a.name, 0) < cfg.max_restarts]
            if pool:
                victim = rng.choice(pool)
                break
        if victim is None:
            log.warning("soak: every worker was killed max_restarts times; no more kills")
            return
        at = time.monotonic() - t0
        log.warning("soak: killing %s (%s) at %.1fs", victim.name, victim.role, at)
        await loop.run_in_executor(None, kill_worker, victim)
        kills_of[victim.name] = kills_of.get(victim.name, 0) + 1
        back = await loop.run_in_executor(None, wait_worker_back, victim, cfg.restart_timeout_s)
        kills.append(KillRecord(at, victim.worker_id, victim.role, victim.name, back))
        if back is None:
            return


def find_victims(ray_address: str | None, actor_tag: str | None) -> list:
    """Join the service's Ray cluster (unless this process already is in one) and list
    its worker actors (cluster.launch.faults.find_worker_actors)."""
    import ray

    from cluster.launch.faults import find_worker_actors

    if not ray.is_initialized():
        ray.init(address=ray_address or "auto", namespace="pdserve-soak", log_to_driver=False,
                 configure_logging=False)
    actors = find_worker_actors(actor_tag)
    if not actors:
        raise RuntimeError("no pdserve worker actors (pdserve-<tag>-prefill-N / decode-N) in "
                           f"the Ray cluster at {ray_address!r}")
    return actors
