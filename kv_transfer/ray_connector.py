"""Ray connector (the only kv_transfer module that imports ray).

Delivery: for each frame the sender does ``ref = ray.put(payload bytes)`` (one copy into
the object store; Ray moves it across nodes) and calls, on the receiving actor,
``kv_deliver.remote(msg, ref)``. ``ref`` is a top-level argument, so Ray resolves it
before the method runs and the receiver gets a zero-copy, READ-ONLY numpy view of the
object store (kept alive by the chunk until the owner drops it). The receiving actor is
usually the decode worker and must expose::

    def kv_deliver(self, msg: dict, payload=None) -> list:
        return self.kv_receiver.deliver(msg, payload)      # or inherit KVDeliverMixin

and must be able to run it while its own loop runs (``max_concurrency >= 2``, or an
async actor). ``dest`` names the actor; the sender finds it with ``resolver(dest)``
(default ``ray.get_actor``).

Credits: ``deliver`` returns the acks (owner ``release``s, discards) queued for the
calling sender since its previous call. The sender collects them from the results of
its ``kv_deliver`` calls; while frames are in flight and no call is pending it sends
tiny ``{"k": "poll"}`` calls (backing off 1 -> 20 ms) that only fetch acks, and while
requests are active it polls at least every ``failure_timeout_s / 3`` as a heartbeat.
A call that raises (actor died) or stays unanswered for ``failure_timeout_s`` fails the
link; the receiver fails a sender's incomplete requests after that long without a call.

Links: every message names its sender and its link (one per connection, so a sender that
reconnects to the same actor opens a new link). The actor runs several calls at once, so
an old link's closing "bye" may run after the first frames of its successor: it closes
only its own link, never the requests streaming on the new one.
"""

from __future__ import annotations

import itertools
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import ray
import torch

from kv_transfer.config import TransferConfig
from kv_transfer.receiver import InboxReceiver, RxLink
from kv_transfer.sender import ThreadedSender
from kv_transfer.transport import LinkEvents, LinkTransport
from kv_transfer.wire import Ack, FrameHeader, Piece, WireError, header_for

# object-store views are read-only by design; the receiver never writes into them
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

_POLL_MIN_S, _POLL_MAX_S = 0.001, 0.02
_link_ids = itertools.count(1)
_MAX_GONE = 4096  # closed links remembered, so their late calls do not reopen them


class _RayRxLink(RxLink):
    def __init__(self, name: str) -> None:
        self.name = name
        self.last_seen = time.monotonic()
        self._lock = threading.Lock()
        self._acks: list[Ack] = []

    def send_acks(self, acks: list[Ack]) -> None:
        with self._lock:
            self._acks.extend(acks)

    def take_acks(self) -> list[list]:
        with self._lock:
            acks, self._acks = self._acks, []
        return [list(a) for a in acks]


class RayReceiver(InboxReceiver):
    """Lives inside the receiving actor; ``endpoint`` is that actor's name."""

    def __init__(self, cfg: TransferConfig, *, endpoint: str | None = None) -> None:
        super().__init__(cfg)
        if endpoint is None:
            endpoint = ray.get_runtime_context().get_actor_name()
        if not endpoint:
            raise ValueError("RayReceiver needs endpoint= (the actor name senders resolve)")
        self._endpoint = endpoint
        self._links: dict[tuple[str, int], _RayRxLink] = {}  # (sender id, link id) -> link
        self._gone: OrderedDict[tuple[str, int], None] = OrderedDict()  # closed links

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def deliver(self, msg: dict[str, Any], payload: np.ndarray | None = None) -> list[list]:
        """Entry point of the actor's ``kv_deliver``; returns this sender's pending acks."""
        sender = msg.get("sender") if isinstance(msg, dict) else None
        if not isinstance(sender, str):
            raise WireError("kv_deliver message without a 'sender' id")
        lid = msg.get("link", 0)
        if type(lid) is not int:
            raise WireError(f"kv_deliver message with a bad 'link' id {lid!r}")
        kind, key = msg.get("k"), (sender, lid)
        with self._lock:
            link = self._links.get(key)
            if link is None:
                if kind == "bye" or key in self._gone:
                    # a late call of a closed link: its sender has given up on it
                    self._counters["frames_discarded"] += kind == "kv"
                    return []
                link = self._links[key] = _RayRxLink(f"{sender}/{lid}")
            link.last_seen = time.monotonic()
        if kind == "kv":
            header = FrameHeader.from_wire(msg.get("h") if isinstance(msg.get("h"), dict) else {})
            if not (isinstance(payload, np.ndarray) and payload.dtype == np.uint8
                    and payload.ndim == 1 and payload.size == header.payload_nbytes):
                raise WireError(f"payload of {header.key} does not match its header")
            self._accept(link, header, header.tensor_from(torch.from_numpy(payload)))
        elif kind == "bye":
            with self._lock:
                self._forget_link_locked(key)
            self._link_closed(link, "sender closed")
        elif kind != "poll":
            raise WireError(f"unknown kv_deliver message kind {kind!r}")
        return link.take_acks()

    def poll(self):
        # the receiver has no thread of its own: silent senders are found here
        now = time.monotonic()
        with self._lock:
            dead = [lk for lk in self._links.values()
                    if now - lk.last_seen > self.cfg.failure_timeout_s
                    and any(st.on_link(lk) for st in self._requests.values())]
            for k in [k for k, lk in self._links.items() if lk in dead]:
                self._forget_link_locked(k)
        for lk in dead:
            self._link_closed(lk, f"sender silent for {self.cfg.failure_timeout_s:g}s")
        return super().poll()

    def _forget_link_locked(self, key: tuple[str, int]) -> None:
        self._links.pop(key, None)
        self._gone[key] = None
        if len(self._gone) > _MAX_GONE:
            self._gone.popitem(last=False)

    def close(self) -> None:
        self._close_inbox()


class KVDeliverMixin:
    """Adds ``kv_deliver`` to an actor class that keeps a ``RayReceiver`` in ``kv_receiver``."""

    kv_receiver: RayReceiver

    def kv_deliver(self, msg: dict[str, Any], payload: np.ndarray | None = None) -> list[list]:
        return self.kv_receiver.deliver(msg, payload)


class RayTransport(LinkTransport):
    def __init__(self, dest: str, events: LinkEvents, cfg: TransferConfig, sender_id: str,
                 resolver: Callable[[str], Any]) -> None:
        self._dest, self._events, self._cfg = dest, events, cfg
        self._sid = sender_id
        self._lid = next(_link_ids)  # this connection; a reconnect gets a new one
        self._resolver = resolver
        self._actor: Any = None
        self._cond = threading.Condition()
        self._pending: dict[Any, float] = {}  # kv_deliver ObjectRef -> submit time
        self._closed = False
        self._collector: threading.Thread | None = None

    def connect(self) -> None:
        self._actor = self._resolver(self._dest)
        self._collector = threading.Thread(target=self._collect, daemon=True,
                                           name=f"kv-ray-acks<-{self._dest}")
        self._collector.start()

    def _call(self, msg: dict[str, Any], payload: Any = None) -> None:
        msg["sender"], msg["link"] = self._sid, self._lid
        ref = self._actor.kv_deliver.remote(msg, payload)
        with self._cond:
            self._pending[ref] = time.monotonic()
            self._cond.notify()

    # fault injection (tests; kv_transfer.faults): a replacement payload sent after the
    # header, whose checksum was computed from the real one
    wire_tamper: Callable[[Piece], torch.Tensor | None] | None = None

    def transmit(self, pieces: list[Piece]) -> None:
        for p in pieces:
            header = header_for(p, self._cfg.checksum_algo).to_wire()
            bad = self.wire_tamper(p) if self.wire_tamper is not None else None
            payload = p.chunk.payload if bad is None else bad
            data = payload.reshape(-1).view(torch.uint8).numpy()  # [nbytes] view
            self._call({"k": "kv", "h": header}, ray.put(data))

    def heartbeat(self) -> None:
        self._call({"k": "poll"})

    def _collect(self) -> None:
        delay = _POLL_MIN_S
        while True:
            with self._cond:
                if self._closed:
                    return
                refs = list(self._pending)
            if not refs and self._events.busy()[0] == 0:
                with self._cond:  # nothing in flight: wait for transmit
                    if not self._pending and not self._closed:
                        self._cond.wait(0.05)
                continue
            if not refs:  # frames in flight, no call pending: fetch acks
                time.sleep(delay)
                delay = min(delay * 2, _POLL_MAX_S)
                self._call({"k": "poll"})
                continue
            ready, _ = ray.wait(refs, num_returns=1, timeout=0.05)
            if ready:
                ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            for ref in ready:
                with self._cond:
                    self._pending.pop(ref, None)
                try:
                    acks = [Ack(*a) for a in ray.get(ref)]
                except Exception as e:  # actor died or kv_deliver raised: the link is gone
                    return self._fail(f"kv_deliver on {self._dest!r} failed: {type(e).__name__}: {e}")
                if acks:
                    delay = _POLL_MIN_S
                    self._events.on_acks(acks)
            with self._cond:
                oldest = min(self._pending.values(), default=None)
            if oldest is not None and time.monotonic() - oldest > self._cfg.failure_timeout_s:
                return self._fail(f"kv_deliver on {self._dest!r} unanswered for "
                                  f"{self._cfg.failure_timeout_s:g}s")

    def _fail(self, reason: str) -> None:
        if not self._closed:
            self._events.on_failure(reason)

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        if self._actor is not None:
            try:  # best effort: lets the receiver drop this sender's state now
                self._actor.kv_deliver.remote({"k": "bye", "sender": self._sid,
                                               "link": self._lid}, None)
            except Exception:
                pass

    def release(self) -> None:
        if self._collector is not None and self._collector is not threading.current_thread():
            self._collector.join(timeout=5.0)


def make_ray_sender(cfg: TransferConfig, *, resolver: Callable[[str], Any] | None = None,
                    sender_id: str | None = None, **kwargs) -> ThreadedSender:
    import uuid

    sid = sender_id or f"kv-tx-{uuid.uuid4().hex[:12]}"
    res = resolver or ray.get_actor
    return ThreadedSender(cfg, lambda dest, ev: RayTransport(dest, ev, cfg, sid, res), **kwargs)


def make_ray_receiver(cfg: TransferConfig, **kwargs) -> RayReceiver:
    return RayReceiver(cfg, **kwargs)
