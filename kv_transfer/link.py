"""SenderLink: one destination of a ``ThreadedSender`` and the thread that feeds it.

The caller's ``send`` only appends a ``Handover`` to the link's inbox. The link thread,
beside the caller, does the rest in send order: waits for the chunk's export to finish
(``KVChunk.ready``; outside the lock), admits it (frames it into pieces, queues them in
the ``LinkScheduler``: send policy, queue discipline, credit window, pacer), writes the
batches the scheduler releases, and records what it wrote. ``admit_locked`` also runs
on a thread that reads the scheduler's state (``stats``), so what was sent is always
counted as queued or held there, as if the caller had queued it itself.

    caller:       send -> inbox.append(Handover) -> notify         (O(1), sender.py only)
    link thread:  resolve (wait exports) -> admit (split, enqueue) -> next_batch -> transmit
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Protocol

from kv_transfer.base import FrameRecord, KVChunk
from kv_transfer.config import TransferConfig
from kv_transfer.frames import Ack, Piece, split_chunk
from kv_transfer.link_scheduler import LinkScheduler
from kv_transfer.send_queue import QueuedFrame
from kv_transfer.stats import LinkStats, RequestStats
from kv_transfer.transport import LinkTransport

_EXPORT_PENDING: list[QueuedFrame] = []  # by identity: "wait for an export first"


@dataclass(slots=True)
class Handover:
    """A chunk ``send`` handed to a link, not yet in its scheduler (a plain record: the
    caller runs no code of this module)."""

    chunk: KVChunk
    enqueue_t: float
    stream: list  # the sender's (rid, dest) stream state it belongs to
    resolved: bool  # its payload holds the KV (no ``ready``, or waited for)
    error: str | None = None
    dropped: bool = False  # aborted or failed before admission: never read


class LinkOwner(Protocol):
    """What a link shares with its sender (``sender.ThreadedSender``): the one lock, the
    request and stream state it updates, and the ways to fail a link or a request."""

    cfg: TransferConfig
    _lock: threading.Lock
    _closed: bool
    _shares: dict[str, float]
    _requests: dict[str, RequestStats]
    _streams: dict[tuple[str, str], list]
    _records: deque[FrameRecord]
    _tx: Iterator[int]

    def _clock(self) -> float: ...
    def _on_acks(self, link: SenderLink, acks: list[Ack]) -> None: ...
    def _fail_link(self, link: SenderLink, reason: str) -> None: ...
    def _fail_request_locked(self, rid: str, reason: str) -> None: ...


class SenderLink:
    """Per-destination state; also the ``LinkEvents`` a transport reports to."""

    def __init__(self, sender: LinkOwner, dest: str, stats: LinkStats) -> None:
        self.sender = sender
        self.dest = dest
        self.stats = stats
        self.sched = LinkScheduler(sender.cfg.share_of(sender._shares.get(dest, 1.0)))
        self.cond = threading.Condition(sender._lock)
        self.inbox: deque[Handover] = deque()  # handed over, not yet admitted (send order)
        self.inflight: dict[int, QueuedFrame] = {}  # Piece.tx -> frame awaiting its ack
        self.failed: str | None = None
        self.transport: LinkTransport | None = None
        self.thread: threading.Thread | None = None

    def on_acks(self, acks: list[Ack]) -> None:
        self.sender._on_acks(self, acks)

    def on_failure(self, reason: str) -> None:
        self.sender._fail_link(self, reason)

    def busy(self) -> tuple[int, int]:
        """(frames in flight, active requests): transports poll/heartbeat while busy."""
        with self.sender._lock:
            active = sum(1 for r in self.sender._requests.values() if self.dest in r.dests)
            return len(self.inflight), active

    # ---- handed-over chunks (under the sender's lock unless said otherwise) ----
    def drop_locked(self, request_id: str | None = None) -> None:
        """Forget the request's (or every) handed-over chunk; its payload is never read."""
        keep: deque[Handover] = deque()
        for h in self.inbox:
            if request_id is None or h.chunk.request_id == request_id:
                h.dropped = True
            else:
                keep.append(h)
        self.inbox = keep

    def resolve(self) -> None:
        """Link thread, outside the lock: wait for the exports still in flight."""
        with self.sender._lock:
            todo = [h for h in self.inbox if not h.resolved]
        for h in todo:
            if not h.dropped:
                try:
                    h.chunk = h.chunk.resolved()
                except Exception as e:  # a failed device copy fails its request alone
                    h.error = f"KV export failed: {type(e).__name__}: {e}"
            h.resolved = True

    def admit_locked(self) -> bool:
        """Queue the handed-over chunks whose payload is ready, in send order, in the
        scheduler; returns whether one still waits for its export."""
        s = self.sender
        while self.inbox and self.inbox[0].resolved:
            h = self.inbox.popleft()
            c = h.chunk
            if s._streams.get((c.request_id, self.dest)) is not h.stream:
                continue  # its request ended meanwhile
            if h.error is not None:
                s._fail_request_locked(c.request_id, h.error)
                continue
            pieces = split_chunk(c, s.cfg.max_payload_bytes)
            h.stream[0] += len(pieces) - 1  # send counted the chunk as one frame
            for i, p in enumerate(pieces):
                p = replace(p, tx=next(s._tx))
                qf = QueuedFrame(c.request_id, c.tenant, p.nbytes, h.enqueue_t, item=p,
                                 key=p.key)
                self.sched.enqueue(qf, completes_request=c.is_final and i == len(pieces) - 1)
        return bool(self.inbox)

    # ---- the link thread ----
    def run(self) -> None:
        assert self.transport is not None
        try:
            self._loop(self.transport)
        finally:
            self.transport.close()
            self.transport.release()

    def _loop(self, transport: LinkTransport) -> None:
        s = self.sender
        try:
            transport.connect()
        except Exception as e:  # any failure to reach the peer fails its requests
            s._fail_link(self, f"cannot reach {self.dest}: {type(e).__name__}: {e}")
            return
        with s._lock:
            self.stats.connects += 1
        hb = s.cfg.failure_timeout_s / 3
        last_io = s._clock()
        while True:
            self.resolve()
            with s._lock:
                batch = self._next_locked(last_io, hb)
                if batch is None:
                    return
                for f in batch:
                    self.inflight[f.item.tx] = f
            if batch is _EXPORT_PENDING:
                continue
            t0 = s._clock()
            try:
                if batch:
                    transport.transmit([f.item for f in batch])
                else:
                    transport.heartbeat()
            except Exception as e:
                s._fail_link(self, f"send to {self.dest} failed: {type(e).__name__}: {e}")
                return
            t1 = last_io = s._clock()
            if batch:
                with s._lock:
                    self._record_locked(batch, t0, t1)

    def _next_locked(self, last_io: float, hb: float) -> list[QueuedFrame] | None:
        """Frames to write now; [] for a heartbeat; ``_EXPORT_PENDING`` when an export is
        to be waited for first; None: stop."""
        s = self.sender
        while True:
            if self.failed is not None or s._closed:
                return None
            if self.admit_locked():
                return _EXPORT_PENDING
            now = s._clock()
            batch, wait = self.sched.next_batch(now)
            if batch:
                return batch
            if now - last_io >= hb and any(self.dest in r.dests for r in s._requests.values()):
                return []  # heartbeat
            self.cond.wait(min(wait, hb) if wait is not None else hb)

    def _record_locked(self, batch: list[QueuedFrame], t0: float, t1: float) -> None:
        s = self.sender
        self.stats.on_write(batch, t0, t1)
        for f in batch:
            p: Piece = f.item
            s._records.append(FrameRecord(f.request_id, self.dest, p.chunk.seq_no, p.part,
                                          f.nbytes, f.enqueue_t, t0, t1))
            req = s._requests.get(f.request_id)
            if req is not None:
                req.bytes_sent += f.nbytes
                req.frames_sent += 1
                req.queue_wait_s += t0 - f.enqueue_t
                req.transfer_s += t1 - t0
