"""Per-request trace events and a cheap, thread-safe recorder (docs/design.md §8).

Every component that touches a request (router, prefill and decode workers, KV links)
records :class:`TraceEvent` spans into its own :class:`TraceRecorder`; the bench drains
them (as plain dicts across process boundaries), merges them and exports them with
``bench/trace.py`` as a Chrome/Perfetto trace or a timeline PNG.

Timestamps are WALL-CLOCK seconds (``time.time()``): spans from different processes
and hosts land on one axis (up to clock skew). Latency metrics inside one process use
``time.monotonic()`` elsewhere; these spans are for looking at, not for SLO maths.

Usage::

    rec = TraceRecorder(enabled=True, worker="prefill-0")
    with rec.span("req-1", "prefill_chunk", chunk_id=0, token_start=0, token_end=512) as f:
        run_chunk()
        f["batch_num_seqs"] = 3          # fields known only at the end
    rec.record("req-1", "token", start=time.time())   # instant: end defaults to start
    dicts = rec.drain_dicts()            # msgpack/Ray-friendly
    events = events_from_dicts(dicts)    # on the other side
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

# Phases the bench knows how to draw; other names are accepted and drawn generically.
KNOWN_PHASES: tuple[str, ...] = (
    "request",  # whole lifetime at the router (arrival -> finish)
    "queue",  # waiting before the first chunk is scheduled
    "prefill_chunk",  # one chunk of one request inside one prefill step
    "prefill_step",  # one batched prefill step (request_id "id1,id2,..." or "*")
    "kv_queue",  # send enqueued -> send started (pacer / credits)
    "kv_send",  # bytes on the link (worker = "link:<src>-><dst>")
    "kv_recv",  # receiver writes a token range into its blocks
    "decode_admit",  # WAITING_FOR_KV -> RUNNING (instant or short span)
    "decode_step",  # one decode step with this request (or "*": the whole batch)
    "token",  # instant: one output token reached the router/client
)

_OPTIONAL_INT_FIELDS: tuple[str, ...] = (
    "chunk_id", "token_start", "token_end", "scheduled_tokens", "past_kv_tokens",
    "prefix_hit_tokens", "batch_num_seqs", "batch_num_tokens", "bytes",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class TraceEvent:
    """One span (``end > start``) or instant (``end == start``) of one request.

    ``worker`` names the track: ``"router"``, ``"prefill-0"``, ``"decode-1"`` or a link
    ``"link:prefill-0->decode-0"``. ``start``/``end`` are wall-clock seconds.
    ``[token_start, token_end)`` is the global token range a chunk/send covers.
    Batch-level events (one per step) use ``request_id="id1,id2,..."`` or ``"*"``.
    """

    request_id: str
    phase: str
    worker: str
    start: float
    end: float
    chunk_id: int | None = None
    token_start: int | None = None
    token_end: int | None = None
    scheduled_tokens: int | None = None
    past_kv_tokens: int | None = None
    prefix_hit_tokens: int | None = None
    batch_num_seqs: int | None = None
    batch_num_tokens: int | None = None
    bytes: int | None = None
    tenant: str | None = None
    # a prefill_chunk's step on an emulated device's timeline (wall seconds; the span
    # itself is the host's, from launch to result): where a layer-wise send overlapped it
    device_start: float | None = None
    device_end: float | None = None

    def __post_init__(self) -> None:
        for name in ("request_id", "phase", "worker"):
            value = getattr(self, name)
            if not isinstance(value, str) or (not value and name != "worker"):
                raise ValueError(f"{name} must be a non-empty str, got {value!r}")
        if not self.end >= self.start:  # also rejects NaN
            raise ValueError(f"end ({self.end}) must be >= start ({self.start})")
        for name in _OPTIONAL_INT_FIELDS:
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        ts, te = self.token_start, self.token_end
        if ts is not None and te is not None and te < ts:
            raise ValueError(f"token_end ({te}) < token_start ({ts})")

    @property
    def duration(self) -> float:
        """Span length in seconds (0 for instants)."""
        return self.end - self.start

    @property
    def is_instant(self) -> bool:
        return self.end == self.start

    def to_dict(self) -> dict[str, Any]:
        """Plain dict without the ``None`` fields (compact for msgpack/Ray/JSON)."""
        # not dataclasses.asdict: it deep-copies and is ~10x slower
        return {k: v for k in _FIELD_NAMES if (v := getattr(self, k)) is not None}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TraceEvent:
        """Inverse of :meth:`to_dict`; unknown keys raise ``ValueError``."""
        unknown = set(data).difference(_FIELD_NAMES)
        if unknown:
            raise ValueError(f"unknown TraceEvent fields: {sorted(unknown)}")
        return cls(**data)


_FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in fields(TraceEvent))


def events_to_dicts(events: Iterable[TraceEvent]) -> list[dict[str, Any]]:
    """Serialise events for a process boundary."""
    return [e.to_dict() for e in events]


def events_from_dicts(dicts: Iterable[Mapping[str, Any]]) -> list[TraceEvent]:
    """Rebuild events serialised by :func:`events_to_dicts`."""
    return [TraceEvent.from_dict(d) for d in dicts]


class _Span:
    """Context manager behind :meth:`TraceRecorder.span`; yields a dict of extra fields."""

    __slots__ = ("_rec", "_request_id", "_phase", "_worker", "_fields", "_start")

    def __init__(
        self, rec: TraceRecorder, request_id: str, phase: str, worker: str | None, fields_: dict
    ) -> None:
        self._rec, self._request_id, self._phase = rec, request_id, phase
        self._worker, self._fields = worker, fields_
        self._start = 0.0

    def __enter__(self) -> dict[str, Any]:
        self._start = self._rec.clock()
        return self._fields

    def __exit__(self, *exc: object) -> None:
        self._rec.record(
            self._request_id,
            self._phase,
            start=self._start,
            end=self._rec.clock(),
            worker=self._worker,
            **self._fields,
        )


class _NullSpan:
    __slots__ = ()

    def __enter__(self) -> dict[str, Any]:
        return {}  # a fresh dict: callers may write into it; nothing is kept

    def __exit__(self, *exc: object) -> None:
        return None


_NULL_SPAN = _NullSpan()


class TraceRecorder:
    """Bounded, thread-safe buffer of trace events.

    Disabled (the default) ``record`` returns on its first line and ``span`` hands back
    a shared no-op context manager. Enabled, ``record`` only appends a tuple under a
    lock (no dataclass is built); :meth:`drain` builds and validates the
    :class:`TraceEvent` objects off the hot path. An invalid record never raises inside a worker loop: it
    is skipped at drain time, counted in :attr:`invalid` and kept in :attr:`last_error`.
    When ``capacity`` records are buffered, further ones are dropped (the earliest part
    of a run stays intact) and counted in :attr:`dropped`; drain periodically.
    """

    def __init__(
        self,
        enabled: bool = False,
        *,
        worker: str = "",
        capacity: int = 200_000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.enabled = bool(enabled)
        self.worker = worker
        self.capacity = capacity
        self.clock = clock
        self._buf: list[TraceEvent | tuple] = []
        self._dropped = 0
        self._invalid = 0
        self.last_error: str | None = None
        self._lock = threading.Lock()

    @property
    def dropped(self) -> int:
        """Records discarded because the buffer was full (cumulative)."""
        return self._dropped

    @property
    def invalid(self) -> int:
        """Records skipped at drain time because they failed validation (cumulative)."""
        return self._invalid

    def __bool__(self) -> bool:  # a recorder is truthy even while empty (__len__ == 0)
        return True

    def __len__(self) -> int:
        return len(self._buf)

    def record(
        self,
        request_id: str,
        phase: str,
        start: float | None = None,
        end: float | None = None,
        *,
        worker: str | None = None,
        **fields_: Any,
    ) -> None:
        """Record a span; ``start`` defaults to now and ``end`` to ``start`` (instant)."""
        if not self.enabled:
            return
        if start is None:
            start = self.clock()
        item = (request_id, phase, self.worker if worker is None else worker, start, end, fields_)
        self._append(item)

    def add(self, event: TraceEvent) -> None:
        """Append a ready-made event (ignored while disabled)."""
        if self.enabled:
            self._append(event)

    def _append(self, item: TraceEvent | tuple) -> None:
        with self._lock:
            if len(self._buf) >= self.capacity:
                self._dropped += 1
            else:
                self._buf.append(item)

    def span(
        self, request_id: str, phase: str, *, worker: str | None = None, **fields_: Any
    ) -> _Span | _NullSpan:
        """Time the ``with`` body; the yielded dict takes fields known only at the end."""
        if not self.enabled:
            return _NULL_SPAN
        return _Span(self, request_id, phase, worker, dict(fields_))

    def drain(self) -> list[TraceEvent]:
        """Return and forget the buffered events (the counters are kept)."""
        with self._lock:
            buf, self._buf = self._buf, []
        events = []
        for item in buf:
            if isinstance(item, TraceEvent):
                events.append(item)
                continue
            rid, phase, worker, start, end, fields_ = item
            try:
                events.append(
                    TraceEvent(rid, phase, worker, start, start if end is None else end, **fields_)
                )
            except (TypeError, ValueError) as exc:  # a tracing bug must not kill a worker
                self._invalid += 1
                self.last_error = f"{phase} of {rid!r}: {exc}"
        return events

    def drain_dicts(self) -> list[dict[str, Any]]:
        """:meth:`drain` as plain dicts, ready to cross a process boundary."""
        return events_to_dicts(self.drain())
