"""The connector contract: what a prefill worker sends and a decode worker receives.

A request's KV travels as ``KVChunk``s addressed by GLOBAL token index, so the two sides
may page their caches with different block sizes. Senders and receivers are chosen by
name (``kv_transfer.registry``); every transport honours the same contract:

* ``KVSender.send`` never blocks the caller: it checks the chunk's place in its stream
  and hands it over; the link's thread completes the export (``KVChunk.ready``), frames,
  paces and writes. The caller must not mutate ``chunk.payload`` after ``send`` (it is
  read later, zero-copy, by that thread).
* ``KVReceiver`` never writes into caller tensors from a foreign thread: the owner polls
  chunks, copies them into its own blocks, then ``release``s them, which returns the
  credit (in-flight bytes) to the sender.
* Per request and receiver (``dest``), ``seq_no`` runs 0, 1, ..., n-1 and the chunk with
  ``is_final`` has the highest ``seq_no``; that is how the receiver knows a request is
  complete. Under tensor parallelism a chunk carries a KV-head range: a prefill rank
  sends each decode rank the heads it needs (``kv_transfer.heads``), a decode rank may
  receive a request from several prefill ranks, one head range each, and completes it
  once every head it serves arrived.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from kv_transfer.heads import HeadRange


class PayloadReady(Protocol):
    """A device-to-host copy in flight (``engine.kv_cache.PendingExport`` is one)."""

    def wait(self) -> object:
        """Block until the chunk's payload holds the KV; raise if the copy failed."""


class LayersReady(Protocol):
    """A chunk's KV still being computed and exported layer by layer (the final chunk of
    a prompt, whose transfer would otherwise start only after its whole forward): the
    sender's link sends each group of layers as soon as it is ready."""

    boundaries: tuple[int, ...]  # ascending layer ends of the groups, relative to the
    # payload's first layer; the last one is ``payload.shape[0]``

    def wait_layers(self, n: int) -> object:
        """Block until ``payload[:n]`` holds the KV (``n`` one of ``boundaries``); raise
        if its computation or copy failed."""

    # optional: ``first_token`` (int | None), read once ``wait_layers`` returned for the
    # last boundary: the token of a final chunk handed over before its step sampled it
    # (``KVChunk.first_token`` None); the sender puts it on the chunk's last piece


@dataclass(frozen=True, eq=False)
class KVChunk:
    """KV of tokens ``[token_start, token_end)`` and layers ``[layer_start, layer_end)``.

    ``payload``: CPU, contiguous, ``[layers, 2 (K,V), tokens, kv_heads, head_dim]``; its
    heads are the model's KV heads ``[head_start, head_start + kv_heads)`` of
    ``num_kv_heads`` (0: the payload holds every head, as a single-rank worker sends).
    A final chunk may be empty (``token_start == token_end``) and carry only
    ``first_token``. A receiver may hand a big sent chunk back as several pieces split
    by layer (``layer_start`` > 0) or token range; only the last piece of the final
    chunk has ``is_final`` and ``first_token`` set. Payloads the receiver returns may
    be read-only views (e.g. of Ray's object store): copy, don't write into them.

    ``ready``: set when ``payload`` is the destination of a copy still in flight (a
    prefill worker's device-to-host export): the sender's link thread calls
    ``ready.wait()`` before it reads the payload, so the caller's ``send`` does not wait
    for the copy. The copy must already be ordered before any later write of the blocks
    it reads (they may be freed and reused at once); a failing ``wait`` fails the request.
    A sender never reads the payload of a chunk dropped (aborted, failed) before then.

    ``layers_ready`` (instead of ``ready``): the payload fills layer group by layer group;
    the link sends each group's frames once ``wait_layers`` returns for it, so the
    receiver may get the chunk as several pieces split by layer (as above), the first
    before the last layers are computed. A final chunk so sent may be handed over before
    its first token is sampled (``first_token`` None): its ``layers_ready.first_token``,
    bound by the last ``wait_layers``, then travels on its last piece. Every connector gets this from the shared sender
    core. A group's frames fit ``max_frame_bytes`` by layer; when one layer does not, the
    link waits for all layers and splits as usual.
    """

    request_id: str
    seq_no: int
    token_start: int
    token_end: int
    payload: torch.Tensor
    is_final: bool = False
    first_token: int | None = None
    tenant: str = "default"
    layer_start: int = 0
    head_start: int = 0
    num_kv_heads: int = 0  # the model's KV heads; 0 = all of them are in the payload
    ready: PayloadReady | None = field(default=None, repr=False)
    layers_ready: LayersReady | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError("KVChunk.request_id must be a non-empty str")
        if self.seq_no < 0:
            raise ValueError(f"KVChunk.seq_no must be >= 0, got {self.seq_no}")
        if not 0 <= self.token_start <= self.token_end:
            raise ValueError(
                f"KVChunk.token_start/token_end must satisfy 0 <= start <= end, "
                f"got [{self.token_start}, {self.token_end})"
            )
        if self.layer_start < 0:
            raise ValueError(f"KVChunk.layer_start must be >= 0, got {self.layer_start}")
        p = self.payload
        if not isinstance(p, torch.Tensor) or p.dim() != 5 or p.shape[1] != 2:
            raise ValueError("KVChunk.payload must be a [layers, 2, tokens, heads, dim] tensor")
        if p.shape[2] != self.token_end - self.token_start:
            raise ValueError(
                f"KVChunk.payload has {p.shape[2]} tokens but the token range "
                f"[{self.token_start}, {self.token_end}) has {self.token_end - self.token_start}"
            )
        if p.device.type != "cpu" or not p.is_contiguous():
            raise ValueError("KVChunk.payload must be a contiguous CPU tensor")
        if self.first_token is not None and not self.is_final:
            raise ValueError("KVChunk.first_token is only set on the final chunk")
        if not isinstance(self.tenant, str) or not self.tenant:
            raise ValueError("KVChunk.tenant must be a non-empty str")
        if self.layers_ready is not None:
            b = tuple(self.layers_ready.boundaries)
            if self.ready is not None:
                raise ValueError("KVChunk takes ready or layers_ready, not both")
            if not b or b[-1] != p.shape[0] or any(x >= y for x, y in zip((0, *b[:-1]), b, strict=True)):
                raise ValueError(f"KVChunk.layers_ready.boundaries {b} must rise strictly "
                                 f"to the payload's {p.shape[0]} layers")
        if self.num_kv_heads or self.head_start:
            if not 0 <= self.head_start < self.head_end <= self.num_kv_heads:
                raise ValueError(
                    f"KVChunk heads [{self.head_start}, {self.head_end}) ({p.shape[3]} in the "
                    f"payload) must lie within the model's {self.num_kv_heads} KV heads")

    def resolved(self) -> KVChunk:
        """This chunk once its payload holds the KV (waits for ``ready`` or every layer of
        ``layers_ready``; then drops it, keeping a first token it bound late)."""
        if self.layers_ready is not None:
            self.layers_ready.wait_layers(self.payload.shape[0])
            return replace(self.with_late_first_token(), layers_ready=None)
        if self.ready is None:
            return self
        self.ready.wait()
        return replace(self, ready=None)

    def with_late_first_token(self) -> KVChunk:
        """This chunk with the first token its ``layers_ready`` bound after it was handed
        over (a final chunk sent before its step sampled it); call after the last layers'
        ``wait_layers``."""
        tok = getattr(self.layers_ready, "first_token", None)
        if tok is None or not self.is_final or self.first_token is not None:
            return self
        return replace(self, first_token=tok)

    @property
    def layer_end(self) -> int:
        return self.layer_start + self.payload.shape[0]

    @property
    def head_end(self) -> int:
        return self.head_start + self.payload.shape[3]

    @property
    def heads(self) -> HeadRange:
        """The model's KV heads this payload holds (all of them unless ``num_kv_heads``)."""
        return HeadRange(self.head_start, self.head_end, self.num_kv_heads or self.head_end)

    @property
    def num_tokens(self) -> int:
        return self.token_end - self.token_start

    @property
    def nbytes(self) -> int:
        return self.payload.numel() * self.payload.element_size()


@dataclass(frozen=True)
class FrameRecord:
    """One frame's trip through a sender (monotonic seconds of the sending process)."""

    request_id: str
    dest: str
    seq_no: int
    part: int
    nbytes: int
    enqueue_t: float
    start_t: float
    end_t: float

    @property
    def queue_wait_s(self) -> float:
        return self.start_t - self.enqueue_t

    @property
    def transfer_s(self) -> float:
        """Duration of the write that carried this frame (coalesced frames share it)."""
        return self.end_t - self.start_t


@dataclass
class SendEvents:
    """What happened since the last ``KVSender.poll``.

    ``finished``: every frame of the request (incl. the final one) was delivered and
    released by the receiving owner. ``failed``: (request_id, reason); the request's
    queued frames were dropped. ``records``: one per frame written (for metrics/traces).
    """

    finished: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)
    records: list[FrameRecord] = field(default_factory=list)


@dataclass
class ReceiveEvents:
    """What arrived since the last ``KVReceiver.poll``.

    ``chunks``: deduplicated, possibly out of order (token ranges are absolute).
    ``failed``: (request_id, reason), e.g. checksum mismatch or link dropped before the
    request completed; no further chunk of it is delivered. ``completed``: requests all
    of whose frames (seq 0..final) have now been delivered in ``chunks`` (this poll or
    an earlier one).
    """

    chunks: list[KVChunk] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)
    completed: list[str] = field(default_factory=list)


class KVSender(ABC):
    """Prefill side. Thread-safe; all I/O happens on background threads."""

    @abstractmethod
    def send(self, chunk: KVChunk, *, dest: str) -> None:
        """Queue ``chunk`` for the receiver at ``dest`` (its ``endpoint``); never blocks."""

    def send_many(self, items: list[tuple[KVChunk, str]]) -> None:
        """``send`` each (chunk, dest), all queued at once: a request that streams to
        several receivers (one per decode TP rank) queues each seq for all of them in one
        call, so it cannot finish on one before the others have its frames."""
        for chunk, dest in items:
            self.send(chunk, dest=dest)

    @abstractmethod
    def poll(self) -> SendEvents:
        """Finished/failed requests and frame records since the last poll."""

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """Drop the request's queued frames; no event is reported for it afterwards."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters: totals, ``links`` (per dest) and ``requests`` (active ones)."""

    @abstractmethod
    def close(self) -> None:
        """Stop threads and connections; unfinished requests are reported failed."""

    def __enter__(self) -> KVSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class KVReceiver(ABC):
    """Decode side. ``poll``/``release``/``abort`` are called by the owner thread."""

    @property
    @abstractmethod
    def endpoint(self) -> str:
        """What a sender passes as ``dest`` to reach this receiver."""

    @abstractmethod
    def poll(self) -> ReceiveEvents:
        """Chunks, failures and completions since the last poll."""

    def wait(self, timeout_s: float) -> bool:
        """Block until ``poll`` would return something or ``timeout_s`` passed; returns
        whether it would. Lets an idle owner sleep instead of spinning on ``poll``."""
        import time

        time.sleep(timeout_s)
        return True

    def set_arrival_hook(self, hook: Callable[[], None] | None) -> None:
        """Run `hook()` after every arrival (a chunk, a completion or a failure to
        ``poll``), on the thread that stored it: the owner's wake-up, with no thread of
        its own between the link and the owner. It runs under the receiver's lock: it
        must be quick and must not call the receiver."""
        raise NotImplementedError(f"{type(self).__name__} has no arrival hook")

    @abstractmethod
    def release(self, chunk: KVChunk) -> None:
        """The owner has copied ``chunk``; return its credit to the sender. Idempotent."""

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """Discard (and credit back) every present and future frame of the request."""

    @abstractmethod
    def expect(self, request_id: str) -> None:
        """Announce a request; with ``require_expect`` unannounced ones are discarded."""

    def set_head_range(self, heads: HeadRange) -> None:
        """Serve only these KV heads (a decode TP rank's); see ``kv_transfer.heads``."""
        raise NotImplementedError(f"{type(self).__name__} cannot serve a KV-head range")

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters: bytes/frames received, discarded, duplicates, failures, links."""

    @abstractmethod
    def close(self) -> None:
        """Stop listening; connected senders see their link fail."""

    def __enter__(self) -> KVReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
