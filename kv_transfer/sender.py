"""ThreadedSender: the transport-independent half of every KVSender.

One thread per destination link (``SenderLink``, below) runs: connect, then
loop { complete handed-over exports, frame and queue them, ask the LinkScheduler for a
batch, write it with the transport, record stats }. The caller's ``send`` only checks
the chunk's place in its stream, counts it and hands it to the link: no framing, no
scheduling, no waiting for its export, so it never blocks and costs O(1). Transports
report acks and failures through the link (``LinkEvents``). One lock guards all sender
state; transports are always called *outside* it, so a transport's callback can never
deadlock with it.

In detail: ``send`` appends a ``Handover`` to the link's inbox, and the link thread,
beside the caller, does the rest in send order: waits for the chunk's export to finish
(``KVChunk.ready``; outside the lock), admits it (frames it into pieces, queues them in
the ``LinkScheduler``: send policy, queue discipline, credit window, pacer), writes the
batches the scheduler releases, and records what it wrote. ``admit_locked`` also runs
on a thread that reads the scheduler's state (``stats``), so what was sent is always
counted as queued or held there, as if the caller had queued it itself.

    caller:       send -> inbox.append(Handover) -> notify         (O(1), ThreadedSender)
    link thread:  resolve (wait exports) -> admit (split, enqueue) -> next_batch -> transmit

What is queued leaves before the link waits again: after a write, ``resolve`` waits for no
export, and a batch is taken even while the inbox's head still waits, so a chunk's frames
(or a layer-wise chunk's ready groups) never sit behind the wait for the next one.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from engine.tombstones import RecentIds
from kv_transfer.base import FrameRecord, KVChunk, KVSender, SendEvents
from kv_transfer.config import TransferConfig
from kv_transfer.emulated_link import EmulatedLink
from kv_transfer.link_scheduler import LinkScheduler
from kv_transfer.pacing import Clock, monotonic_clock
from kv_transfer.send_queue import QueuedFrame
from kv_transfer.stats import LinkStats, RequestStats
from kv_transfer.transport import LinkEvents, LinkTransport
from kv_transfer.wire import Ack, AckStatus, Piece, split_chunk, split_layers

_MAX_RECORDS = 100_000  # frame records kept between polls (oldest dropped first)
_MAX_DEAD = 65_536  # failed/aborted request ids remembered to drop their late chunks
_EXPORT_PENDING: list[QueuedFrame] = []  # by identity: "wait for an export first"


TransportFactory = Callable[[str, LinkEvents], LinkTransport]


class ThreadedSender(KVSender):
    def __init__(self, cfg: TransferConfig, transport_factory: TransportFactory, *,
                 clock: Clock = monotonic_clock, name: str = "kv-sender") -> None:
        self.cfg = cfg
        self._factory = transport_factory
        self._clock = clock
        # send's timestamp, without a Python frame for the default clock
        self._now = time.monotonic if clock is monotonic_clock else clock
        self._name = name
        self._lock = threading.Lock()
        self._links: dict[str, SenderLink] = {}
        self._link_stats: dict[str, LinkStats] = {}
        self._requests: dict[str, RequestStats] = {}
        # (rid, dest) -> [frames out, final queued, seqs]: one stream per receiver of a request
        self._streams: dict[tuple[str, str], list] = {}
        self._shares: dict[str, float] = {}  # dest -> share of the budget its link may use
        self._dead: RecentIds[str] = RecentIds(_MAX_DEAD)
        self._events = SendEvents()
        self._records: deque[FrameRecord] = deque(maxlen=_MAX_RECORDS)
        self._tx = itertools.count(1)  # transmission numbers (Piece.tx), under the lock
        self._closed = False
        self._totals = {"requests_finished": 0, "requests_failed": 0, "link_failures": 0}

    # ---- caller API ----
    def send(self, chunk: KVChunk, *, dest: str) -> None:
        self.send_many([(chunk, dest)])

    def send_many(self, items: list[tuple[KVChunk, str]]) -> None:
        now = self._now()
        with self._lock:
            if self._closed:
                raise RuntimeError("KVSender is closed")
            seen: dict[tuple[str, str], set[int]] = {}
            finals: set[tuple[str, str]] = set()
            for c, dest in items:  # check everything before queueing anything
                self._check_locked(c, dest, seen, finals)
            for c, dest in items:
                if c.request_id not in self._dead:
                    self._queue_locked(c, dest, now)

    def set_link_share(self, dest: str, share: float) -> None:
        """Let the link to ``dest`` use ``share`` of the configured budget (pacing rate,
        credit window): with TP, the rank links between two workers split one budget
        (``kv_transfer.heads.HeadTransfer.share``). Applies from the next (re)connect."""
        self.cfg.share_of(share)  # validates
        with self._lock:
            self._shares[dest] = share

    def _check_locked(self, c: KVChunk, dest: str, seen: dict[tuple[str, str], set[int]],
                      finals: set[tuple[str, str]]) -> None:
        """Raise ``ValueError`` for a chunk that breaks a stream's seq order (``seen`` and
        ``finals``: what this batch queues before it)."""
        rid, key = c.request_id, (c.request_id, dest)
        if rid in self._dead:
            return  # failed or aborted: already reported, late chunks are dropped
        st = self._streams.get(key)
        seqs = seen.setdefault(key, set())  # this batch's; st[2]: those queued before it
        if (st is not None and st[1]) or key in finals:
            raise ValueError(f"request {rid!r}: chunk seq {c.seq_no} after its final chunk")
        if c.seq_no in seqs or (st is not None and c.seq_no in st[2]):
            raise ValueError(f"request {rid!r}: seq_no {c.seq_no} sent twice to {dest!r}")
        req = self._requests.get(rid)
        if st is None and req is not None and any(self._streams[(rid, d)][1] for d in req.dests):
            raise ValueError(f"request {rid!r}: a new receiver {dest!r} after a final chunk "
                             "was queued (send every receiver's chunks in one send_many)")
        seqs.add(c.seq_no)
        if c.is_final:
            finals.add(key)

    def _queue_locked(self, chunk: KVChunk, dest: str, now: float) -> None:
        """Count the chunk in its stream and hand it to the link's thread."""
        rid = chunk.request_id
        req = self._requests.get(rid)
        if req is None:
            req = self._requests[rid] = RequestStats([], chunk.tenant, now)
        st = self._streams.get((rid, dest))
        if st is None:
            st = self._streams[(rid, dest)] = [0, False, set()]
            req.dests.append(dest)
        st[2].add(chunk.seq_no)
        link = self._links.get(dest) or self._open_link(dest)
        link.inbox.append(Handover(chunk, now, st,
                                   chunk.ready is None and chunk.layers_ready is None))
        req.bytes_queued += chunk.nbytes
        st[0] += 1  # one frame per chunk until the link splits it (SenderLink.admit_locked)
        st[1] = chunk.is_final
        link.cond.notify()

    def poll(self) -> SendEvents:
        with self._lock:
            ev, self._events = self._events, SendEvents()
            ev.records = list(self._records)
            self._records.clear()
            return ev

    def abort(self, request_id: str) -> None:
        with self._lock:
            req = self._requests.pop(request_id, None)
            self._mark_dead(request_id)
            for dest in req.dests if req else ():
                self._streams.pop((request_id, dest), None)
                link = self._links.get(dest)
                if link is not None:
                    link.drop_locked(request_id)
                    link.sched.abort(request_id)
                    link.cond.notify()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            links = {}
            for dest, ls in self._link_stats.items():
                link = self._links.get(dest)
                if link is not None:
                    link.admit_locked()  # what was sent counts as queued or held ...
                links[dest] = ls.snapshot(link.sched if link else None)
                # ... except chunks whose export (KVChunk.ready) the link still waits for
                links[dest]["export_wait_bytes"] = (
                    sum(h.chunk.nbytes for h in link.inbox) if link else 0)
            out: dict[str, Any] = dict(self._totals)
            for k in ("bytes_sent", "frames_sent", "queue_wait_s", "transfer_s",
                      "inflight_bytes", "queued_bytes", "held_bytes", "export_wait_bytes",
                      "failures"):
                out[k] = sum(v[k] for v in links.values())
            out["active_requests"] = len(self._requests)
            out["links"] = links
            out["requests"] = {rid: asdict(r) for rid, r in self._requests.items()}
            return out

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            links = list(self._links.values())
            for rid in list(self._requests):
                self._fail_request_locked(rid, "sender closed")
            self._closed = True
            for link in links:
                link.cond.notify_all()
        for link in links:
            self._fail_link(link, "sender closed")
            if link.thread is not None and link.thread is not threading.current_thread():
                link.thread.join(timeout=self.cfg.failure_timeout_s + 1.0)

    def wrap_transports(self, wrap: Callable[[LinkTransport, str, SenderLink], LinkTransport],
                        ) -> None:
        """Links opened from now on use ``wrap(transport, dest, link_events)`` instead of
        the bare transport (fault injection in tests: ``kv_transfer.faults``)."""
        inner = self._factory
        self._factory = lambda dest, link: wrap(inner(dest, link), dest, link)

    # ---- link machinery ----
    def _open_link(self, dest: str) -> SenderLink:
        stats = self._link_stats.setdefault(dest, LinkStats())
        link = self._links[dest] = SenderLink(self, dest, stats)
        cfg = self.cfg
        if cfg.link_emulated:  # the real transport reports to the emulated wire's far end
            emu = EmulatedLink(cfg.link_rate_bytes_per_s, cfg.link_latency_s, link,
                               clock=self._clock, name=f"{self._name}->{dest}")
            link.transport = emu.wrap(self._factory(dest, emu.events))
        else:
            link.transport = self._factory(dest, link)
        link.thread = threading.Thread(target=link.run,
                                       name=f"{self._name}->{dest}", daemon=True)
        link.thread.start()
        return link

    def _on_acks(self, link: SenderLink, acks: list[Ack]) -> None:
        with self._lock:
            for a in acks:
                if a.status == AckStatus.DUPLICATE:
                    continue  # a copy of a transmission: the original's ack carries the credit
                f = link.inflight.get(a.tx)
                if f is None or f.key != a.key:
                    continue  # stale (link already failed) or unknown
                del link.inflight[a.tx]
                link.sched.on_ack(f.nbytes)
                link.stats.bytes_acked += f.nbytes
                if a.request_id not in self._requests:
                    continue  # aborted or failed: the ack only returns credit
                if a.status != AckStatus.OK:
                    what = "discarded" if a.status == AckStatus.DROPPED else "rejected"
                    self._fail_request_locked(a.request_id, f"receiver {what} frame: {a.reason}")
                    continue
                st = self._streams[(a.request_id, link.dest)]
                st[0] -= 1
                req = self._requests[a.request_id]
                if all(self._streams[(a.request_id, d)][:2] == [0, True] for d in req.dests):
                    for d in req.dests:
                        del self._streams[(a.request_id, d)]
                    del self._requests[a.request_id]
                    self._events.finished.append(a.request_id)
                    self._totals["requests_finished"] += 1
            link.cond.notify()

    def _fail_request_locked(self, rid: str, reason: str) -> None:
        req = self._requests.pop(rid, None)
        self._mark_dead(rid)
        if req is None:
            return
        for dest in req.dests:
            self._streams.pop((rid, dest), None)
            link = self._links.get(dest)
            if link is not None:
                link.drop_locked(rid)
                link.sched.abort(rid)
        self._events.failed.append((rid, reason))
        self._totals["requests_failed"] += 1

    def _fail_link(self, link: SenderLink, reason: str) -> None:
        with self._lock:
            if link.failed is not None:
                return
            link.failed = reason
            if self._links.get(link.dest) is link:
                del self._links[link.dest]  # the next send() to dest reconnects
            link.drop_locked()
            link.sched.drain()
            link.inflight.clear()  # no ack can come back on a dead link
            if not self._closed:
                link.stats.failures += 1
                self._totals["link_failures"] += 1
            for rid, req in list(self._requests.items()):
                if link.dest in req.dests:
                    self._fail_request_locked(rid, f"link to {link.dest} failed: {reason}")
            link.cond.notify_all()
        if link.transport is not None:
            try:
                link.transport.close()
            except Exception:  # closing a broken connection may itself fail; nothing to do
                pass

    def _mark_dead(self, rid: str) -> None:
        self._dead.add(rid)


# ---- one destination: its inbox, scheduler and thread ----

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
    # a chunk sent layer group by layer group (``KVChunk.layers_ready``): its pieces with
    # the layer end each needs, how many are admitted, and the layers ready so far
    pieces: list[tuple[int, Piece]] | None = None
    admitted: int = 0
    ready_layers: int = 0


class SenderLink:
    """Per-destination state; also the ``LinkEvents`` a transport reports to."""

    def __init__(self, sender: ThreadedSender, dest: str, stats: LinkStats) -> None:
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

    def resolve(self, block: bool = True) -> None:
        """Link thread, outside the lock: wait for the exports still in flight; for a
        chunk sent by layers, only for its next group (its frames go out meanwhile).
        ``block=False`` (the link just wrote a batch): wait for nothing, so frames already
        queued leave before the next export or layer group is waited for."""
        with self.sender._lock:
            todo = [h for h in self.inbox if not h.resolved]
        if todo and not block:
            return
        for h in todo:
            if not h.dropped:
                try:
                    if self._next_layers(h):
                        return  # admit and send this group before waiting for the next
                    h.chunk = h.chunk.resolved()
                except Exception as e:  # a failed device copy fails its request alone
                    h.error = f"KV export failed: {type(e).__name__}: {e}"
            h.resolved = True

    def _next_layers(self, h: Handover) -> bool:
        """Wait for the next layer group of a chunk sent by layers; False when the chunk
        is not (or no longer) sent that way: its whole payload is then waited for."""
        c, lr = h.chunk, h.chunk.layers_ready
        if lr is None or c.num_tokens == 0:
            return False
        if h.pieces is None:
            h.pieces = split_layers(c, lr.boundaries, self.sender.cfg.max_payload_bytes)
            if h.pieces is None:
                return False
        total = c.payload.shape[0]
        need = next(b for b in lr.boundaries if b > h.ready_layers)
        lr.wait_layers(need)
        with self.sender._lock:
            if need == total:
                h.chunk = c = c.with_late_first_token()
                if c.first_token is not None:  # it goes on the chunk's last piece
                    end, last = h.pieces[-1]
                    h.pieces[-1] = (end, replace(last, chunk=replace(
                        last.chunk, first_token=c.first_token)))
                h.resolved = True
            h.ready_layers = need
        return need < total

    def admit_locked(self) -> bool:
        """Queue the handed-over chunks whose payload is ready, in send order, in the
        scheduler; returns whether one still waits for its export."""
        s = self.sender
        while self.inbox and (self.inbox[0].resolved or self.inbox[0].ready_layers):
            h = self.inbox[0]
            c = h.chunk
            if s._streams.get((c.request_id, self.dest)) is not h.stream:
                self.inbox.popleft()
                continue  # its request ended meanwhile
            if h.error is not None:
                self.inbox.popleft()
                s._fail_request_locked(c.request_id, h.error)
                continue
            if h.pieces is None:
                pieces = split_chunk(c, s.cfg.max_payload_bytes)
                self._enqueue_locked(h, pieces, 0, len(pieces))
                self.inbox.popleft()
                continue
            # by layers: the pieces whose layers are ready, the rest on a later call
            ready = [p for end, p in h.pieces[h.admitted:] if end <= h.ready_layers]
            self._enqueue_locked(h, [p for _, p in h.pieces], h.admitted,
                                 h.admitted + len(ready))
            h.admitted += len(ready)
            if h.admitted < len(h.pieces):
                break  # its next group is still being computed
            self.inbox.popleft()
        return bool(self.inbox)

    def _enqueue_locked(self, h: Handover, pieces: list[Piece], lo: int, hi: int) -> None:
        """Queue ``pieces[lo:hi]`` of ``h``'s chunk (all ``len(pieces)`` count in its stream
        from the first call on)."""
        s, c = self.sender, h.chunk
        if lo == 0 and hi > 0:
            h.stream[0] += len(pieces) - 1  # send counted the chunk as one frame
        for i in range(lo, hi):
            p = replace(pieces[i], tx=next(s._tx))
            qf = QueuedFrame(c.request_id, c.tenant, p.nbytes, h.enqueue_t, item=p, key=p.key)
            self.sched.enqueue(qf, completes_request=c.is_final and i == len(pieces) - 1)

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
        wrote = False  # the last pass wrote a batch: the next waits for no export first
        while True:
            self.resolve(block=not wrote)
            with s._lock:
                batch = self._next_locked(last_io, hb)
                if batch is None:
                    return
                for f in batch:
                    self.inflight[f.item.tx] = f
            wrote = bool(batch) and batch is not _EXPORT_PENDING
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
                # what is queued (earlier chunks, a layer-wise chunk's ready groups) leaves
                # before the next export or layer group is waited for
                batch, _ = self.sched.next_batch(s._clock())
                return batch or _EXPORT_PENDING
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
