"""Liveness of the router's workers: a lost control channel (or one that cannot open)
marks a worker dead (its legs are re-dispatched on a healthy pair); once Ray restarts its
actor (max_restarts) the worker is adopted again, with a fresh channel.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Protocol

from cluster.router.channel import ChannelActor, WorkerChannel
from cluster.router.flight import Flight, RouterCore
from cluster.router.pool import WorkerHandle

log = logging.getLogger(__name__)
REVIVE_INTERVAL_S = 0.5


class Pump(Protocol):
    """What liveness needs of the event pump (cluster/router/events.py)."""

    router: RouterCore
    channel_secret: bytes
    stopping: bool

    def on_batch(self, w: WorkerHandle, load, entries: list) -> None: ...

    def redispatch(self, flight: Flight, why: str, *, failed: bool) -> None: ...


class Liveness:
    def __init__(self, pump: Pump):
        self.pump = pump
        self.router = pump.router

    def mark_dead(self, w: WorkerHandle) -> None:
        if not w.alive:
            return
        w.alive = False
        w.outstanding_tokens = 0
        if w.link is not None:  # its watch revives it with a fresh channel
            w.link.close()
        log.warning("worker %s is dead; re-dispatching %d legs", w.worker_id, len(w.legs))
        for leg_id in list(w.legs):
            flight = self.router.legs.get(leg_id)
            w.legs.discard(leg_id)
            if flight is not None and not flight.done and flight.leg_id == leg_id:
                self.pump.redispatch(flight, f"worker {w.worker_id} died", failed=True)

    async def revive(self, w: WorkerHandle) -> None:
        """Wait until Ray restarts the actor (max_restarts), then adopt it again."""
        while not self.pump.stopping:
            try:
                info = await asyncio.wait_for(w.actor.ready.remote(), timeout=30)
                w.refresh(info)
                await self.connect(w)
            except Exception:
                await asyncio.sleep(REVIVE_INTERVAL_S)
                continue
            w.restarts += 1
            w.stats = None
            w.alive = True
            log.warning("worker %s is back (restart %d)", w.worker_id, w.restarts)
            self.router.wake_admission()
            return

    async def connect(self, w: WorkerHandle) -> None:
        name = f"router-{getattr(self.router, 'tag', '')}"
        pump = self.pump
        ch = await WorkerChannel.connect(w.worker_id, w.channel, pump.channel_secret, name,
                                         functools.partial(pump.on_batch, w))
        w.link = ch
        if not hasattr(w.actor, "ray_actor"):  # (a test may have wrapped it since)
            w.actor = ChannelActor(w.actor, w)

    async def watch_channel(self, w: WorkerHandle) -> None:
        """Watch `w`'s channel: its loss marks `w` dead; once back it is re-adopted."""
        while not self.pump.stopping:
            if not w.alive:
                await self.revive(w)
                continue
            why = await asyncio.shield(w.link.lost)
            if not self.pump.stopping and w.alive:
                log.warning("channel to %s lost: %s", w.worker_id, why)
                self.mark_dead(w)
