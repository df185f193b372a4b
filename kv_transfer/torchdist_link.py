"""One torch.distributed link: a 2-rank process group between a sender and a receiver.

Why a group per link: prefill and decode ranks live in different Ray actors (often on
different nodes) that share no ``init_process_group`` world, links come and go with
workers, and one broken link must not take others down. So the receiver hosts a
``TCPStore`` (its endpoint ``torchdist://HOST:PORT``); a sender claims a link number
``n`` from it (``store.add``), says hello under ``pdkv/link/n/``, and both build a
``ProcessGroupGloo`` of size 2 (sender rank 0, receiver rank 1) over a ``PrefixStore``
of that key. No default group is ever initialised, so the workers' own TP groups
(``init_process_group`` or new groups) are untouched.

A message on a tag is two or three point-to-point sends, received in the same order:

    int64[2] (head bytes, payload bytes)   head bytes = wire preamble + msgpack header
    uint8[head bytes]                      (kv_transfer.wire: the same validation as TCP)
    uint8[payload bytes]                   only for KV frames

Sizes come first so the receiver checks them against its limits before allocating. Both
directions send a heartbeat every ``failure_timeout_s / 3`` of silence, so a receive that
waits ``failure_timeout_s`` means a dead or hung peer (gloo then closes the pair: the
link is over). A peer process that dies resets the connection at once.
"""

from __future__ import annotations

import datetime
import threading
from typing import Any

import torch

from kv_transfer.wire import MAX_HEADER_BYTES, PREAMBLE, WireError, _check_preamble, _parse

DATA_TAG, ACK_TAG = 1, 2
PREFIX = "torchdist://"
LINKS_KEY = "pdkv/links"


def parse_endpoint(dest: str) -> tuple[str, int]:
    """``torchdist://host:port`` -> (host, port)."""
    host, sep, port = dest[len(PREFIX):].rpartition(":") if dest.startswith(PREFIX) else ("", "", "")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"torchdist dest must look like {PREFIX}HOST:PORT, got {dest!r}")
    return host.strip("[]"), int(port)


def link_prefix(n: int) -> str:
    return f"pdkv/link/{n}/"


def seconds(s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=s)


def new_group(store: Any, n: int, rank: int, timeout_s: float) -> Any:
    """The 2-rank gloo group of link ``n`` (blocks until the peer joins, or raises)."""
    from torch.distributed import PrefixStore, ProcessGroupGloo

    return ProcessGroupGloo(PrefixStore(link_prefix(n) + "pg/", store), rank, 2, seconds(timeout_s))


class Channel:
    """Messages over one group to its other rank; sends are serialised by a lock (a
    message's parts must not interleave with another thread's)."""

    def __init__(self, pg: Any, rank: int, timeout_s: float) -> None:
        self.pg = pg
        self.peer = 1 - rank
        self.timeout = seconds(timeout_s)
        self._send_lock = threading.Lock()

    def send(self, tag: int, head: bytes, payload: torch.Tensor | None = None) -> None:
        """``head``: preamble + header bytes; ``payload``: flat uint8 (may be None)."""
        n = 0 if payload is None else payload.numel()
        parts = [torch.tensor([len(head), n], dtype=torch.int64),
                 torch.frombuffer(bytearray(head), dtype=torch.uint8)]
        if n:
            parts.append(payload)
        with self._send_lock:
            for t in parts:
                self.pg.send([t], self.peer, tag).wait(self.timeout)

    def recv(self, tag: int, *, max_frame_bytes: int, alloc: Any = None) -> tuple[str, Any, Any]:
        """(kind, header or control dict, payload or None) of the next message on ``tag``;
        ``WireError`` for a message that breaks the limits or the wire format."""
        sizes = torch.empty(2, dtype=torch.int64)
        self.pg.recv([sizes], self.peer, tag).wait(self.timeout)
        hlen, plen = (int(x) for x in sizes)
        if not PREAMBLE.size < hlen <= PREAMBLE.size + MAX_HEADER_BYTES or plen < 0:
            raise WireError(f"message sizes ({hlen}, {plen}) outside the limits")
        head = torch.empty(hlen, dtype=torch.uint8)
        self.pg.recv([head], self.peer, tag).wait(self.timeout)
        raw = memoryview(head.numpy())
        h, p = _check_preamble(raw[:PREAMBLE.size], max_frame_bytes, MAX_HEADER_BYTES)
        if PREAMBLE.size + h != hlen or p != plen:
            raise WireError(f"preamble says ({h}, {p}) bytes, the sizes said ({hlen}, {plen})")
        kind, header, control = _parse(raw[PREAMBLE.size:], plen)
        if header is None:
            return kind, control, None
        buf = (alloc or (lambda k: torch.empty(k, dtype=torch.uint8)))(plen)
        if plen:
            self.pg.recv([buf], self.peer, tag).wait(self.timeout)
        return kind, header, header.tensor_from(buf)

    def abort(self) -> None:
        """Close the group's connections (the peer's pending receives fail at once)."""
        try:
            self.pg.abort()
        except Exception:  # already broken; nothing left to close
            pass
