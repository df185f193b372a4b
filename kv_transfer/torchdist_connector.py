"""torch.distributed connector: KV point to point between a prefill rank and a decode
rank over a 2-rank gloo group per link (``torchdist_link`` explains the set-up).

Sender -> receiver on ``DATA_TAG``: KV frames (header validated as on TCP, payload
received into pooled buffers), heartbeats and a closing "bye". Receiver -> sender on
``ACK_TAG``: ack batches (credit), heartbeats and "bye". Whoever gets a "bye" answers
one, which wakes the other side's pending receive, so closing never waits for a
timeout while the peer lives; a dead peer resets the connection, a hung one is found by
the missing heartbeats within ``failure_timeout_s``. Like gloo and NCCL themselves, it
trusts the network it runs on: the link has no HMAC handshake (use tcp across trust
boundaries). Payloads are CPU tensors here; NCCL (GPU to GPU) is not wired yet.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable

import torch

from kv_transfer.ack_writer import AckWriter
from kv_transfer.buffers import BufferPool
from kv_transfer.config import TransferConfig
from kv_transfer.receiver import InboxReceiver, RxLink
from kv_transfer.sender import ThreadedSender
from kv_transfer.tcp_connector import parse_acks
from kv_transfer.torchdist_link import (
    ACK_TAG,
    DATA_TAG,
    LINKS_KEY,
    PREFIX,
    Channel,
    link_prefix,
    new_group,
    parse_endpoint,
    seconds,
)
from kv_transfer.transport import LinkEvents, LinkTransport
from kv_transfer.wire import (
    MAX_HEADER_BYTES,
    PREAMBLE,
    Ack,
    Piece,
    WireError,
    encode_control,
    encode_header,
)
from kv_transfer.wire import header_for as _header_for

log = logging.getLogger(__name__)
_CONTROL_LIMIT = PREAMBLE.size + MAX_HEADER_BYTES
_ACCEPT_POLL_S = 0.02  # how often the receiver looks for new links
HB, BYE = encode_control({"k": "hb"}), encode_control({"k": "bye"})


class TorchDistTransport(LinkTransport):
    """Sender side of one link (group rank 0)."""

    wire_tamper: Callable[[Piece], torch.Tensor | None] | None = None  # kv_transfer.faults

    def __init__(self, dest: str, events: LinkEvents, cfg: TransferConfig, sender_id: str) -> None:
        self._host, self._port = parse_endpoint(dest)
        self._dest, self._events, self._cfg, self._sid = dest, events, cfg, sender_id
        self._chan: Channel | None = None
        self._closed = threading.Event()
        self._bye_sent = False
        self._last_send = time.monotonic()
        self._threads: list[threading.Thread] = []

    def connect(self) -> None:
        from torch.distributed import TCPStore

        t = self._cfg.handshake_timeout_s
        store = TCPStore(self._host, self._port, is_master=False, timeout=seconds(t))
        n = store.add(LINKS_KEY, 1)
        store.set(link_prefix(n) + "hello", self._sid)
        self._chan = Channel(new_group(store, n, 0, t), 0, self._cfg.failure_timeout_s)
        for target, name in ((self._read_acks, "acks"), (self._keepalive, "hb")):
            th = threading.Thread(target=target, daemon=True, name=f"kv-dist-{name}<-{self._dest}")
            th.start()
            self._threads.append(th)
        if self._closed.is_set():  # closed while connecting: end the link the usual way
            self._say_bye()

    def transmit(self, pieces: list[Piece]) -> None:
        assert self._chan is not None
        for p in pieces:
            head = encode_header(_header_for(p, self._cfg.checksum_algo))
            bad = self.wire_tamper(p) if self.wire_tamper is not None else None
            payload = (p.chunk.payload if bad is None else bad).reshape(-1).view(torch.uint8)
            self._chan.send(DATA_TAG, head, payload)
            self._last_send = time.monotonic()

    def heartbeat(self) -> None:
        assert self._chan is not None
        self._chan.send(DATA_TAG, HB)
        self._last_send = time.monotonic()

    def _keepalive(self) -> None:
        """Heartbeats even while idle: the receiver treats failure_timeout_s of silence
        as a dead link (a gloo receive that times out closes the pair)."""
        every = self._cfg.failure_timeout_s / 3
        while not self._closed.wait(every / 2):
            if time.monotonic() - self._last_send >= every:
                try:
                    self.heartbeat()
                except Exception as e:  # noqa: BLE001 - any send failure kills the link
                    return self._fail(f"heartbeat to {self._dest} failed: {e}")

    def _read_acks(self) -> None:
        assert self._chan is not None
        try:
            while True:
                kind, control, _ = self._chan.recv(ACK_TAG, max_frame_bytes=_CONTROL_LIMIT)
                if kind == "ack":
                    self._events.on_acks(parse_acks(control))
                elif kind == "bye":
                    self._say_bye()
                    return self._fail("receiver closed")
                elif kind != "hb":
                    raise WireError(f"unexpected message {kind!r} from receiver")
        except (RuntimeError, WireError) as e:  # gloo: reset, timeout or closed pair
            self._fail(f"{type(e).__name__}: {e}")

    def _fail(self, reason: str) -> None:
        if not self._closed.is_set():
            self._events.on_failure(reason)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._say_bye()  # the receiver answers "bye", which ends our ack reader at once

    def _say_bye(self) -> None:
        if self._chan is None or self._bye_sent:
            return
        self._bye_sent = True
        try:
            self._chan.send(DATA_TAG, BYE)
        except Exception:  # noqa: BLE001 - the link is already broken
            pass

    def release(self) -> None:
        self.close()
        for th in self._threads:
            if th is not threading.current_thread():
                th.join(timeout=self._cfg.failure_timeout_s + 1.0)
        if self._chan is not None:
            self._chan.abort()


class _DistRxLink(RxLink):
    def __init__(self, chan: Channel, name: str, heartbeat_s: float) -> None:
        self.name, self.chan = name, chan
        # a broken group ends the writer only: the reader sees the same failure
        self.acks = AckWriter(name, heartbeat_s, lambda msg: chan.send(ACK_TAG, msg),
                              errors=(RuntimeError,), farewell=BYE).start()

    def send_acks(self, acks: list[Ack]) -> None:
        self.acks.send(acks)


class TorchDistReceiver(InboxReceiver):
    """Hosts the links' TCPStore; one thread per link reads frames into the inbox."""

    def __init__(self, cfg: TransferConfig) -> None:
        from torch.distributed import TCPStore

        super().__init__(cfg)
        host = cfg.bind_host
        self._store = TCPStore(host, cfg.tcp_port, is_master=True, wait_for_workers=False,
                               timeout=seconds(cfg.handshake_timeout_s))
        self._endpoint = f"{PREFIX}{socket.gethostname() if host == '0.0.0.0' else host}:{self._store.port}"
        self._links: set[_DistRxLink] = set()
        self._threads: list[threading.Thread] = []
        self._pool = BufferPool(max_idle_bytes=min(cfg.credit_window_bytes, 256 << 20))
        self._stop = threading.Event()
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True,
                                          name=f"kv-dist-accept:{self._store.port}")
        self._acceptor.start()

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def _accept_loop(self) -> None:
        # polls the link counter (a store.wait that times out logs a warning each time)
        nxt = 1
        while not self._stop.wait(_ACCEPT_POLL_S):
            claimed = self._store.add(LINKS_KEY, 0)
            for n in range(nxt, claimed + 1):
                t = threading.Thread(target=self._serve, args=(n,), daemon=True,
                                     name=f"kv-dist-link:{n}")
                with self._lock:
                    self._threads = [x for x in self._threads if x.is_alive()] + [t]
                t.start()
            nxt = max(nxt, claimed + 1)

    def _serve(self, n: int) -> None:
        cfg = self.cfg
        try:
            self._store.wait([link_prefix(n) + "hello"], seconds(cfg.handshake_timeout_s))
            peer = self._store.get(link_prefix(n) + "hello").decode(errors="replace")[:128]
            chan = Channel(new_group(self._store, n, 1, cfg.handshake_timeout_s), 1,
                           cfg.failure_timeout_s)
        except RuntimeError as e:  # a sender that claimed a link and vanished
            log.warning("kv receiver %s: link %d never came up: %s", self.endpoint, n, e)
            return
        link = _DistRxLink(chan, f"{peer}#{n}", cfg.failure_timeout_s / 3)
        with self._lock:
            self._links.add(link)
        reason, bye = "sender closed the link", True
        try:
            while True:
                kind, header, payload = chan.recv(DATA_TAG, max_frame_bytes=cfg.max_frame_bytes,
                                                  alloc=self._pool.get)
                if kind == "kv":
                    self._accept(link, header, payload)
                elif kind == "bye":  # the sender's, or its answer to ours
                    break
                elif kind != "hb":
                    raise WireError(f"unexpected message {kind!r} from sender")
        except (RuntimeError, WireError) as e:  # reset, silence past the timeout, bad frame
            reason, bye = f"{type(e).__name__}: {e}", False
        if self._stop.is_set():
            reason = "receiver closed"
        with self._lock:
            self._links.discard(link)
        self._link_closed(link, reason)
        log.info("kv receiver %s: link %s closed: %s", self.endpoint, link.name, reason)
        # answer a bye (the sender's ack reader waits for it); after a failure send
        # nothing: a send to a peer that will not receive blocks for the whole timeout
        link.acks.stop(flush=bye)
        link.acks.join(timeout=cfg.failure_timeout_s + 1.0)
        chan.abort()

    def stats(self) -> dict:
        out = super().stats()
        out["buffers_reused"], out["buffers_allocated"] = self._pool.reused, self._pool.allocated
        return out

    def close(self) -> None:
        self._close_inbox()
        self._stop.set()
        with self._lock:
            links, threads = list(self._links), list(self._threads)
        for link in links:
            link.acks.stop(flush=True)  # our "bye": the sender answers it, each link ends
        self._acceptor.join(timeout=2.0)
        for t in threads:
            t.join(timeout=self.cfg.failure_timeout_s + 1.0)


def make_torchdist_sender(cfg: TransferConfig, **kwargs) -> ThreadedSender:
    sid = kwargs.pop("sender_id", None) or f"kv-tx-{uuid.uuid4().hex[:12]}"
    return ThreadedSender(cfg, lambda dest, ev: TorchDistTransport(dest, ev, cfg, sid), **kwargs)


def make_torchdist_receiver(cfg: TransferConfig, **kwargs) -> TorchDistReceiver:
    return TorchDistReceiver(cfg, **kwargs)
