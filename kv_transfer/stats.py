"""Counters behind ``KVSender.stats()`` (wired to Prometheus by cluster/metrics.py).

Suggested mapping: ``bytes_sent`` -> ``pdserve:kv_transfer_bytes_total``; the
``FrameRecord``s from ``poll()`` -> ``pdserve:kv_transfer_seconds`` (transfer_s) and
``pdserve:kv_send_queue_seconds`` (queue_wait_s); ``inflight_bytes`` ->
``pdserve:kv_inflight_bytes``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kv_transfer.link_scheduler import LinkScheduler
from kv_transfer.send_queue import QueuedFrame


@dataclass
class LinkStats:
    """Cumulative counters of one destination (they survive reconnects)."""

    bytes_sent: int = 0
    frames_sent: int = 0
    writes: int = 0  # coalesced writes (frames_sent / writes = frames per write)
    queue_wait_s: float = 0.0
    transfer_s: float = 0.0  # time spent inside transport writes
    bytes_acked: int = 0
    failures: int = 0
    connects: int = 0
    first_send_t: float | None = None
    last_send_t: float | None = None

    def on_write(self, frames: list[QueuedFrame], t0: float, t1: float) -> None:
        self.writes += 1
        self.frames_sent += len(frames)
        self.bytes_sent += sum(f.nbytes for f in frames)
        self.queue_wait_s += sum(t0 - f.enqueue_t for f in frames)
        self.transfer_s += t1 - t0
        if self.first_send_t is None:
            self.first_send_t = t0
        self.last_send_t = t1

    def snapshot(self, sched: LinkScheduler | None) -> dict[str, Any]:
        d = asdict(self)
        span = (self.last_send_t or 0.0) - (self.first_send_t or 0.0)
        # achieved: over the span from first to last write; busy: while writing only
        d["achieved_rate_bytes_per_s"] = self.bytes_sent / span if span > 0 else 0.0
        d["busy_rate_bytes_per_s"] = self.bytes_sent / self.transfer_s if self.transfer_s > 0 else 0.0
        d["inflight_bytes"] = sched.inflight_bytes if sched else 0
        d["queued_bytes"] = sched.queued_bytes if sched else 0
        d["held_bytes"] = sched.held_bytes if sched else 0
        d["peak_inflight_bytes"] = sched.peak_inflight_bytes if sched else 0
        d["connected"] = sched is not None
        return d


@dataclass
class RequestStats:
    """One active request on the sender."""

    dests: list[str]  # its receivers (several: one per decode TP rank it streams to)
    tenant: str
    first_enqueue_t: float
    bytes_queued: int = 0
    bytes_sent: int = 0
    frames_sent: int = 0
    queue_wait_s: float = 0.0
    transfer_s: float = 0.0
