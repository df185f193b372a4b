"""InboxReceiver: the transport-independent half of every KVReceiver.

Transport threads call ``_accept`` with a decoded frame; it is checked (checksum,
duplicate, aborted/unknown request) and put in the inbox. The owner thread drains the
inbox with ``poll`` and returns credit with ``release``. Acks go back through the
``RxLink`` the frame came in on, always outside the lock (a transport's ack path may
call into the sender synchronously, e.g. inproc).

Completion: a request arrives as one *stream* per KV-head range (one per sending TP rank;
a single-rank sender's one stream holds every head). Per stream, seq_no runs 0..final and
each chunk arrives as ``num_parts`` frames; the stream is done when every part of every
seq up to its final one is in, and the request is complete when its done streams tile
the heads this receiver serves (``set_head_range``; default: all of the model's). A
stream whose heads overlap another's, or lie outside the served range, fails the request.

Credit: every transmission (``FrameHeader.tx``) gets exactly one ack that returns its
credit: OK on release, DROPPED or FAILED when discarded. DUPLICATE (no credit) only goes
to a copy of a transmission already taken on the same link, whose own ack carries the
credit; a *different* frame for a request that already completed here (a sender reusing
the id) is DROPPED, so its credit comes back and the sender learns why.

Its bookkeeping of one request, above it: a link's identity (``RxLink``), each KV-head
range's stream of frames (``RxStream``: seq 0..final, parts per seq), when a request is
complete (``RxRequest``), and why a closed request id stays closed (``ClosedId``).
"""

from __future__ import annotations

import itertools
import logging
import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from engine.tombstones import RecentIds
from kv_transfer.base import KVChunk, KVReceiver, ReceiveEvents
from kv_transfer.config import TransferConfig
from kv_transfer.heads import HeadRange
from kv_transfer.wire import Ack, AckStatus, ChecksumError, FrameHeader, verify

log = logging.getLogger(__name__)
_MAX_CLOSED = 65_536  # finished/aborted/failed request ids remembered to drop late frames
_link_uids = itertools.count(1)


# ---- a request's streams (under the receiver's lock) ----

class RxLink(ABC):
    """The receiving end of one sender's link: where acks for its frames go."""

    name: str = "?"
    closed: bool = False  # set by ``_link_closed``: frames still arriving on it are dropped
    _uid: int = 0

    @property
    def uid(self) -> int:
        """A number no other link of this process has (ids of dead objects get reused)."""
        if not self._uid:
            self._uid = next(_link_uids)
        return self._uid

    @abstractmethod
    def send_acks(self, acks: list[Ack]) -> None:
        """Queue acks towards the sender; never blocks for long, never raises."""


@dataclass(eq=False)
class RxStream:
    """One head range of a request: its frames come over one link, seq 0..final."""

    link: RxLink
    parts_left: dict[int, int] = field(default_factory=dict)  # seq -> parts still missing
    seen: dict[tuple[int, int], int] = field(default_factory=dict)  # (seq, part) -> tx
    final_seq: int | None = None

    @property
    def done(self) -> bool:
        return self.final_seq is not None and all(
            self.parts_left.get(s, 1) == 0 for s in range(self.final_seq + 1))


@dataclass(eq=False)
class RxRequest:
    """A request's streams by head range; complete when they are all done and tile the
    heads this receiver serves (its ``head_range``, else all ``total`` heads)."""

    total: int
    streams: dict[tuple[int, int], RxStream] = field(default_factory=dict)

    def on_link(self, link: RxLink) -> bool:
        return any(s.link is link for s in self.streams.values())

    def complete(self, want: HeadRange | None) -> bool:
        lo, hi = (want.start, want.end) if want is not None else (0, self.total)
        for (hs, he), s in sorted(self.streams.items()):
            if hs != lo or not s.done:
                return False
            lo = he
        return lo == hi


class ClosedId(NamedTuple):
    """Why a request id is closed; for a completed one, the highest transmission it took
    per link (uid), which tells a late copy from a new frame reusing the id."""

    why: str
    max_tx: dict[int, int] | None = None


class InboxReceiver(KVReceiver):
    def __init__(self, cfg: TransferConfig) -> None:
        self.cfg = cfg
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)  # notified when the inbox grows
        self._hook: Callable[[], None] | None = None  # set_arrival_hook
        self._inbox: deque[KVChunk] = deque()
        self._events = ReceiveEvents()
        self._requests: dict[str, RxRequest] = {}
        # rid -> {(seq, layer_start, token_start, head_start): (link, ack, nbytes)} to release
        self._unreleased: dict[str, dict[tuple[int, int, int], tuple[RxLink, Ack, int]]] = {}
        self._closed_rids: RecentIds[ClosedId] = RecentIds(_MAX_CLOSED)
        self._expected: set[str] = set()
        self._head_range: HeadRange | None = None  # None: every head of the model
        self._closed = False
        self._counters = dict.fromkeys(
            ("bytes_received", "frames_received", "frames_discarded", "duplicates",
             "checksum_failures", "head_range_failures", "requests_completed",
             "requests_failed", "link_drops"), 0)

    # ---- owner API ----
    def poll(self) -> ReceiveEvents:
        with self._lock:
            ev, self._events = self._events, ReceiveEvents()
            ev.chunks = list(self._inbox)
            self._inbox.clear()
            return ev

    def wait(self, timeout_s: float) -> bool:
        """Block the owner until there is something to ``poll`` (or ``timeout_s``)."""
        with self._lock:
            if not (self._inbox or self._events.failed or self._events.completed):
                self._arrived.wait(timeout_s)
            return bool(self._inbox or self._events.failed or self._events.completed)

    def set_arrival_hook(self, hook: Callable[[], None] | None) -> None:
        with self._lock:
            self._hook = hook

    def _notify_locked(self) -> None:
        self._arrived.notify_all()
        if self._hook is not None:
            try:
                self._hook()
            except Exception:  # the owner's wake-up must not end the link that stored
                log.exception("KV arrival hook failed")

    def release(self, chunk: KVChunk) -> None:
        with self._lock:
            entry = self._unreleased.get(chunk.request_id, {}).pop(
                (chunk.seq_no, chunk.layer_start, chunk.token_start, chunk.head_start), None)
            if entry is not None and not self._unreleased[chunk.request_id]:
                del self._unreleased[chunk.request_id]
        if entry is not None:
            entry[0].send_acks([entry[1]])

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._expected.discard(request_id)
            acks = self._close_request_locked(request_id, "aborted by receiver",
                                              AckStatus.DROPPED, report=None)
        self._flush(acks)

    def expect(self, request_id: str) -> None:
        with self._lock:
            self._expected.add(request_id)

    def set_head_range(self, heads: HeadRange) -> None:
        """Serve only these KV heads (a decode TP rank's, ``kv_transfer.heads.rank_heads``):
        a request completes once frames covering exactly them arrived; a frame with other
        heads, or of a model with another head count, fails its request."""
        with self._lock:
            self._head_range = HeadRange(*heads).check()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = dict(self._counters)
            out["inflight_bytes"] = sum(e[2] for d in self._unreleased.values() for e in d.values())
            out["inbox_chunks"] = len(self._inbox)
            out["active_requests"] = len(self._requests)
            return out

    # ---- transport API ----
    def _accept(self, link: RxLink, header: FrameHeader, payload: torch.Tensor,
                digest: int | None = None) -> None:
        """Take one decoded frame from ``link`` (any thread). Verifies the checksum
        (``digest``: the payload's checksum when the transport hashed it on the fly)."""
        rid, key, tx = header.request_id, (header.seq_no, header.part), header.tx
        try:
            verify(header, payload, digest)
            problem = None
        except ChecksumError as e:
            problem, counter = str(e), "checksum_failures"
        if problem is None:
            with self._lock:
                problem, counter = self._head_problem_locked(header), "head_range_failures"
        if problem is not None:
            with self._lock:
                self._counters[counter] += 1
                acks = [(link, Ack(rid, *key, AckStatus.FAILED, problem, tx))]
                if rid not in self._closed_rids:
                    acks += self._close_request_locked(rid, problem, AckStatus.FAILED,
                                                       report=problem)
            self._flush(acks)
            return
        with self._lock:
            if self._is_copy_locked(header, link):
                self._counters["duplicates"] += 1
                ack = Ack(rid, *key, AckStatus.DUPLICATE, "duplicate", tx)
            elif (why := self._discard_reason_locked(header, link)) is not None:
                self._counters["frames_discarded"] += 1
                ack = Ack(rid, *key, AckStatus.DROPPED, why, tx)
            else:
                ack = None
                self._store_locked(link, header, payload)
        if ack is not None:
            link.send_acks([ack])

    def _head_problem_locked(self, h: FrameHeader) -> str | None:
        """Why a frame's KV heads cannot belong to this receiver's request, if they can't."""
        if h.request_id in self._closed_rids:
            return None  # dropped below as a late frame
        want, st = self._head_range, self._requests.get(h.request_id)
        got = f"KV heads [{h.head_start}, {h.head_end}) of {h.num_kv_heads}"
        if want is not None and not (h.num_kv_heads == want.total and want.start <= h.head_start
                                     and h.head_end <= want.end):
            return f"{got} are not this receiver's heads [{want.start}, {want.end}) of {want.total}"
        if st is None or (h.head_start, h.head_end) in st.streams:
            return None
        if h.num_kv_heads != st.total:
            return f"{got} disagree with the request's earlier frames ({st.total} KV heads)"
        for hs, he in st.streams:
            if hs < h.head_end and h.head_start < he:
                return f"{got} overlap heads [{hs}, {he}) the request already streams"
        return None

    def _is_copy_locked(self, h: FrameHeader, link: RxLink) -> bool:
        """A second copy of a transmission this receiver already took from ``link``."""
        st = self._requests.get(h.request_id)
        if st is not None:
            stream = st.streams.get((h.head_start, h.head_end))
            return (stream is not None and stream.link is link
                    and stream.seen.get((h.seq_no, h.part)) == h.tx)
        closed = self._closed_rids.note(h.request_id)
        # a completed request took every frame; the sender numbers frames in queue order,
        # so a frame it queued later (the id reused) has a higher tx than all of them
        return (closed is not None and closed.why == "completed" and closed.max_tx is not None
                and h.tx <= closed.max_tx.get(link.uid, -1))

    def _discard_reason_locked(self, h: FrameHeader, link: RxLink) -> str | None:
        rid = h.request_id
        if self._closed:
            return "receiver closed"
        if link.closed:
            return f"link {link.name} closed"
        if rid in self._closed_rids:
            return f"request {self._closed_rids.note(rid).why}"
        st = self._requests.get(rid)
        if st is None and self.cfg.require_expect and rid not in self._expected:
            return "unknown request (not expected)"
        stream = st.streams.get((h.head_start, h.head_end)) if st is not None else None
        if stream is not None and stream.link is not link:
            return (f"heads [{h.head_start}, {h.head_end}) of the request already streaming "
                    f"on link {stream.link.name}")
        if stream is not None and (h.seq_no, h.part) in stream.seen:
            return (f"frame {(h.seq_no, h.part)} of the request arrived twice as different "
                    "transmissions")
        return None

    def _store_locked(self, link: RxLink, h: FrameHeader, payload: torch.Tensor) -> None:
        st = self._requests.get(h.request_id)
        if st is None:
            st = self._requests[h.request_id] = RxRequest(h.num_kv_heads)
            self._expected.discard(h.request_id)
        stream = st.streams.get((h.head_start, h.head_end))
        if stream is None:
            stream = st.streams[(h.head_start, h.head_end)] = RxStream(link)
        stream.seen[(h.seq_no, h.part)] = h.tx
        stream.parts_left[h.seq_no] = stream.parts_left.get(h.seq_no, h.num_parts) - 1
        if h.is_final:
            stream.final_seq = h.seq_no
        chunk = KVChunk(h.request_id, h.seq_no, h.token_start, h.token_end, payload,
                        h.is_final, h.first_token, h.tenant, h.layer_start,
                        h.head_start, h.num_kv_heads)
        self._inbox.append(chunk)
        self._notify_locked()
        self._unreleased.setdefault(h.request_id, {})[
            (h.seq_no, h.layer_start, h.token_start, h.head_start)] = (
            link, Ack(h.request_id, h.seq_no, h.part, AckStatus.OK, "", h.tx), payload.nbytes)
        self._counters["frames_received"] += 1
        self._counters["bytes_received"] += payload.nbytes
        if stream.done and st.complete(self._head_range):
            del self._requests[h.request_id]
            max_tx: dict[int, int] = {}
            for s in st.streams.values():
                max_tx[s.link.uid] = max(max_tx.get(s.link.uid, -1), *s.seen.values())
            self._remember_closed(h.request_id, ClosedId("completed", max_tx))
            self._events.completed.append(h.request_id)
            self._counters["requests_completed"] += 1

    def _link_closed(self, link: RxLink, reason: str) -> None:
        """The link is gone: its incomplete requests fail, its unreleased credit is void."""
        with self._lock:
            link.closed = True
            self._counters["link_drops"] += 1
            for rid in [r for r, st in self._requests.items() if st.on_link(link)]:
                self._close_request_locked(rid, "failed", None,
                                           report=f"link dropped before final chunk: {reason}")
            for rid, entries in list(self._unreleased.items()):
                for k in [k for k, e in entries.items() if e[0] is link]:
                    del entries[k]
                if not entries:
                    del self._unreleased[rid]

    def _close_request_locked(self, rid: str, why: str, status: AckStatus | None,
                              report: str | None) -> list[tuple[RxLink, Ack]]:
        """Forget ``rid``: drop its undelivered chunks, void or ack its credit."""
        self._requests.pop(rid, None)
        self._remember_closed(rid, ClosedId(why if report is None else "failed"))
        if any(c.request_id == rid for c in self._inbox):
            self._inbox = deque(c for c in self._inbox if c.request_id != rid)
        entries = self._unreleased.pop(rid, {})
        if report is not None:
            self._events.failed.append((rid, report))
            self._counters["requests_failed"] += 1
            self._notify_locked()
        if status is None:
            return []
        return [(link, ack._replace(status=status, reason=why)) for link, ack, _ in entries.values()]

    @staticmethod
    def _flush(acks: list[tuple[RxLink, Ack]]) -> None:
        by_link: dict[int, tuple[RxLink, list[Ack]]] = {}
        for link, ack in acks:
            by_link.setdefault(id(link), (link, []))[1].append(ack)
        for link, batch in by_link.values():
            link.send_acks(batch)

    def _remember_closed(self, rid: str, closed: ClosedId) -> None:
        self._closed_rids.add(rid, closed)

    def _close_inbox(self) -> None:
        with self._lock:
            self._closed = True
