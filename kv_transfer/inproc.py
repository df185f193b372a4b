"""In-process connector: sender and receiver in one process (tests, single-process setups).

Frames go through the same sender machinery (split, queue, pace, credit) and receiver
checks (checksum, dedup, completion) as the network transports, but the payload is
handed over by reference (zero copy), so the caller must not mutate it after ``send``.
Receivers are found by name in a process-wide hub: endpoint ``inproc://NAME``.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

import torch

from kv_transfer.config import TransferConfig
from kv_transfer.receiver import InboxReceiver, RxLink
from kv_transfer.sender import ThreadedSender
from kv_transfer.transport import LinkEvents, LinkTransport
from kv_transfer.wire import Ack, Piece, header_for

_hub: dict[str, InprocReceiver] = {}
_hub_lock = threading.Lock()
_ids = itertools.count()
PREFIX = "inproc://"


class _InprocRxLink(RxLink):
    def __init__(self, events: LinkEvents, name: str) -> None:
        self._events = events  # the sender's link (on_acks / on_failure)
        self.name = name

    def send_acks(self, acks: list[Ack]) -> None:
        self._events.on_acks(acks)  # synchronous; the receiver calls this outside its lock


class InprocReceiver(InboxReceiver):
    def __init__(self, cfg: TransferConfig, *, name: str | None = None) -> None:
        super().__init__(cfg)
        self._name = name or f"kv-rx-{next(_ids)}"
        self._links: list[_InprocRxLink] = []
        with _hub_lock:
            if self._name in _hub:
                raise ValueError(f"inproc receiver {self._name!r} already exists")
            _hub[self._name] = self

    @property
    def endpoint(self) -> str:
        return PREFIX + self._name

    def _connect(self, events: LinkEvents) -> _InprocRxLink:
        with self._lock:
            if self._closed:
                raise ConnectionRefusedError(f"{self.endpoint} is closed")
            link = _InprocRxLink(events, f"inproc-{len(self._links)}")
            self._links.append(link)
            return link

    def _disconnect(self, link: _InprocRxLink) -> None:
        with self._lock:
            if link not in self._links:
                return
            self._links.remove(link)
        self._link_closed(link, "sender disconnected")

    def close(self) -> None:
        with _hub_lock:
            if _hub.get(self._name) is self:
                del _hub[self._name]
        self._close_inbox()
        with self._lock:
            links, self._links = self._links, []
        for link in links:
            self._link_closed(link, "receiver closed")
            link._events.on_failure("receiver closed")


class InprocTransport(LinkTransport):
    def __init__(self, dest: str, events: LinkEvents, cfg: TransferConfig) -> None:
        if not dest.startswith(PREFIX):
            raise ValueError(f"inproc dest must look like {PREFIX}NAME, got {dest!r}")
        self._name = dest[len(PREFIX):]
        self._events = events
        self._algo = cfg.checksum_algo
        self._rx: InprocReceiver | None = None
        self._link: _InprocRxLink | None = None

    def connect(self) -> None:
        with _hub_lock:
            rx = _hub.get(self._name)
        if rx is None:
            raise ConnectionRefusedError(f"no inproc receiver named {self._name!r}")
        self._link = rx._connect(self._events)
        self._rx = rx

    # fault injection (tests; kv_transfer.faults): a replacement payload handed over
    # after the header, whose checksum was computed from the real one
    wire_tamper: Callable[[Piece], torch.Tensor | None] | None = None

    def transmit(self, pieces: list[Piece]) -> None:
        rx, link = self._rx, self._link
        assert rx is not None and link is not None, "transmit before connect"
        for p in pieces:
            if rx._closed:
                raise ConnectionResetError(f"{rx.endpoint} closed")
            header = header_for(p, self._algo)
            bad = self.wire_tamper(p) if self.wire_tamper is not None else None
            rx._accept(link, header, p.chunk.payload if bad is None else bad)

    def close(self) -> None:
        rx, link, self._rx, self._link = self._rx, self._link, None, None
        if rx is not None and link is not None:
            rx._disconnect(link)


def make_inproc_sender(cfg: TransferConfig, **kwargs) -> ThreadedSender:
    return ThreadedSender(cfg, lambda dest, events: InprocTransport(dest, events, cfg), **kwargs)


def make_inproc_receiver(cfg: TransferConfig, **kwargs) -> InprocReceiver:
    return InprocReceiver(cfg, **kwargs)
