"""Fault injection for tests and chaos runs: OFF unless a fault plan is given.

A plan is a list of faults; each names a kind, when it fires and for which requests:

    {"seed": 7, "faults": [
        {"kind": "drop", "request_filter": "^drop-.*#1$"},          # every matching frame
        {"kind": "corrupt", "every_nth": 3, "max_count": 2},         # frames 3 and 6
        {"kind": "delay", "probability": 0.05, "delay_s": 0.2},
        {"kind": "refuse_admission", "worker_filter": "^decode-0$"}]}

KV frame faults act on the sending (prefill) side, between the sender's queue and the
transport, so everything above them (credits, acks, checksums, completion) is the real
code path:

  drop       the frame is lost: it never reaches the receiver, and the sender is told it
             was delivered (its credit returns, the prefill ends normally), so the decode
             side waits for KV that never comes -> ``kv_wait_timeout_s`` -> FAILED.
  delay      the link holds the frame ``delay_s`` before writing it (and all behind it).
  duplicate  the frame is written twice; the receiver acks the copy DUPLICATE.
  reorder    the frame is held back and written after the link's next frame.
  corrupt    a payload byte is flipped AFTER the header's checksum was computed, so the
             receiver's checksum check must reject it (the request fails on both sides).
  stall      the link freezes for ``stall_s`` (no frames, no heartbeats): shorter than
             ``failure_timeout_s`` it is only slow, longer it fails the link.
  refuse_admission  a decode worker answers "no room" to ``reserve`` (decode_worker.engine).

Decisions are seeded: each fault has its own ``random.Random`` and counter of matching
events; ``every_nth`` fires on matching event n, 2n, ...; ``probability`` (default 1)
then applies; ``max_count`` caps how often it fires. Filters are regular expressions
searched in the request id (router legs are ``<request_id>#<n>``, so ``#1$`` hits only a
request's first attempt) and the worker id. Nothing here imports Ray.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
import zlib
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from kv_transfer.transport import LinkEvents, LinkTransport
from kv_transfer.wire import Ack, AckStatus, Piece

KV_FAULTS = ("drop", "delay", "duplicate", "reorder", "corrupt", "stall")
FAULT_KINDS = (*KV_FAULTS, "refuse_admission")
ENV_VAR = "PDSERVE_FAULTS"  # JSON fault plan read by the worker actors (tests only)


@dataclass(frozen=True)
class FaultSpec:
    """One fault: what, when (``every_nth`` / ``probability`` / ``max_count``), for whom."""

    kind: str
    probability: float = 1.0
    every_nth: int | None = None
    max_count: int | None = None
    request_filter: str | None = None  # regex searched in the request (leg) id
    worker_filter: str | None = None  # regex searched in the worker id
    delay_s: float = 0.05
    stall_s: float = 1.0
    seed: int | None = None  # default: the plan's seed + the fault's index

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"FaultSpec.{name} {why}, got {getattr(self, name)!r}")

        if self.kind not in FAULT_KINDS:
            raise bad("kind", f"must be one of {FAULT_KINDS}")
        if not 0.0 <= self.probability <= 1.0:
            raise bad("probability", "must be in [0, 1]")
        if self.every_nth is not None and self.every_nth < 1:
            raise bad("every_nth", "must be >= 1")
        if self.max_count is not None and self.max_count < 0:
            raise bad("max_count", "must be >= 0")
        if self.delay_s < 0 or self.stall_s < 0:
            raise bad("delay_s" if self.delay_s < 0 else "stall_s", "must be >= 0")
        for name in ("request_filter", "worker_filter"):
            pattern = getattr(self, name)
            if pattern is not None:
                try:
                    re.compile(pattern)
                except re.error as e:
                    raise bad(name, f"is not a valid regex ({e})") from None

    def matches(self, request_id: str, worker_id: str) -> bool:
        return (self.request_filter is None or re.search(self.request_filter, request_id)
                is not None) and self.applies_to(worker_id)

    def applies_to(self, worker_id: str) -> bool:
        return self.worker_filter is None or re.search(self.worker_filter, worker_id) is not None


@dataclass(frozen=True)
class FaultPlan:
    faults: tuple[FaultSpec, ...] = ()
    seed: int = 0

    @classmethod
    def parse(cls, obj: Any) -> FaultPlan:
        """A plan from a dict ``{"seed", "faults"}``, a list of faults, one fault dict,
        a JSON string of any of those, a FaultPlan, or None/"" (empty plan)."""
        if obj is None or obj == "" or obj == {}:
            return cls()
        if isinstance(obj, FaultPlan):
            return obj
        if isinstance(obj, str):
            try:
                obj = json.loads(obj)
            except json.JSONDecodeError as e:
                raise ValueError(f"fault plan is not valid JSON: {e}") from None
        if isinstance(obj, Mapping) and "kind" in obj:
            obj = {"faults": [obj]}
        if isinstance(obj, list):
            obj = {"faults": obj}
        if not isinstance(obj, Mapping) or set(obj) - {"seed", "faults"}:
            raise ValueError("fault plan must be {'seed': int, 'faults': [...]}, a list of "
                             f"faults or one fault, got {obj!r}")
        faults = []
        for f in obj.get("faults") or []:
            if not isinstance(f, Mapping):
                raise ValueError(f"a fault must be a mapping, got {f!r}")
            unknown = set(f) - set(FaultSpec.__dataclass_fields__)
            if unknown:
                raise ValueError(f"unknown fault field(s) {sorted(unknown)} in {dict(f)!r}")
            faults.append(FaultSpec(**f))
        return cls(tuple(faults), int(obj.get("seed", 0)))

    def merged(self, other: FaultPlan) -> FaultPlan:
        return FaultPlan(self.faults + other.faults, self.seed or other.seed)

    def for_worker(self, worker_id: str) -> FaultPlan:
        """The faults that can fire on this worker (seeds keep their plan-wide index)."""
        keep = [f if f.seed is not None else replace(f, seed=self.seed + i)
                for i, f in enumerate(self.faults) if f.applies_to(worker_id)]
        return FaultPlan(tuple(keep), self.seed)

    def to_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "faults": [asdict(f) for f in self.faults]}


class _Trigger:
    def __init__(self, spec: FaultSpec) -> None:
        self.spec = spec
        self.rng = random.Random(spec.seed)
        self.seen = 0
        self.fired = 0

    def fire(self) -> bool:
        s = self.spec
        self.seen += 1
        if s.max_count is not None and self.fired >= s.max_count:
            return False
        if s.every_nth is not None and self.seen % s.every_nth:
            return False
        if s.probability < 1.0 and self.rng.random() >= s.probability:
            return False
        self.fired += 1
        return True


class FaultInjector:
    """Seeded, thread-safe fault decisions for one worker; counts what fired."""

    def __init__(self, plan: FaultPlan, worker_id: str) -> None:
        self.plan = plan.for_worker(worker_id)
        self.worker_id = worker_id
        self._triggers = [_Trigger(f) for f in self.plan.faults]
        self._lock = threading.Lock()
        self.fired: Counter[str] = Counter()

    @property
    def has_kv_faults(self) -> bool:
        return any(f.kind in KV_FAULTS for f in self.plan.faults)

    def decide(self, kinds: tuple[str, ...], request_id: str) -> list[FaultSpec]:
        """The faults among ``kinds`` that fire for this event of ``request_id``."""
        out = []
        with self._lock:
            for t in self._triggers:
                if t.spec.kind in kinds and t.spec.matches(request_id, self.worker_id) \
                        and t.fire():
                    out.append(t.spec)
                    self.fired[t.spec.kind] += 1
        return out

    def refuse_admission(self, request_id: str) -> bool:
        return bool(self.decide(("refuse_admission",), request_id))

    def stats(self) -> dict[str, int]:
        """``fault_<kind>``: how often each kind fired (numbers, for worker stats)."""
        with self._lock:
            return {f"fault_{k}": n for k, n in self.fired.items()}

    def wrap_transport(self, inner: LinkTransport, dest: str, events: LinkEvents) -> LinkTransport:
        return FaultyTransport(inner, self, dest, events)


class FaultyTransport(LinkTransport):
    """Wraps one link's transport and applies the injector's KV frame faults."""

    def __init__(self, inner: LinkTransport, injector: FaultInjector, dest: str,
                 events: LinkEvents) -> None:
        self.inner = inner
        self.injector = injector
        self.dest = dest
        self._events = events
        self._closed = threading.Event()
        self._held: list[Piece] = []  # reordered frames waiting for the next one
        self._corrupt: dict[tuple, int] = {}  # frame key -> copies still to corrupt
        self._stalled_until = 0.0
        # the transports call this after computing a frame's header (checksum included)
        if hasattr(inner, "wire_tamper"):
            inner.wire_tamper = self._tamper

    def connect(self) -> None:
        self.inner.connect()

    def transmit(self, pieces: list[Piece]) -> None:
        out: list[Piece] = []
        for p in pieces:
            faults = self.injector.decide(KV_FAULTS, p.chunk.request_id)
            kinds = {f.kind: f for f in faults}
            if "stall" in kinds:
                self._stalled_until = max(self._stalled_until,
                                          time.monotonic() + kinds["stall"].stall_s)
            if self._stalled_until > time.monotonic() or "delay" in kinds:
                self._send(out)  # frames before this one are not held up
                out = []
                self._wait(self._stalled_until - time.monotonic())
                if "delay" in kinds:
                    self._wait(kinds["delay"].delay_s)
            if "drop" in kinds:  # lost on the way; the sender believes it was delivered
                self._events.on_acks([Ack(*p.key, AckStatus.OK, "", p.tx)])
                continue
            copies = [p, p] if "duplicate" in kinds else [p]
            if "corrupt" in kinds and p.nbytes:
                self._corrupt[p.key] = len(copies)
            if "reorder" in kinds and not self._held:
                self._held = copies  # goes out right after the link's next frame
                continue
            out += copies + self._held
            self._held = []
        self._send(out)

    def heartbeat(self) -> None:
        self._wait(self._stalled_until - time.monotonic())
        held, self._held = self._held, []
        self._send(held)  # a held frame never waits longer than one heartbeat
        self.inner.heartbeat()

    def _send(self, pieces: list[Piece]) -> None:
        if pieces:
            if self._closed.is_set():
                raise ConnectionAbortedError("link closed by fault injection wrapper")
            self.inner.transmit(pieces)

    def _wait(self, seconds: float) -> None:
        if seconds > 0:
            self._closed.wait(seconds)  # close() wakes it

    def _tamper(self, piece: Piece) -> torch.Tensor | None:
        uses = self._corrupt.pop(piece.key, 0)
        if not uses:
            return None
        if uses > 1:
            self._corrupt[piece.key] = uses - 1
        bad = piece.chunk.payload.clone()
        flat = bad.reshape(-1).view(torch.uint8)
        i = zlib.crc32(repr(piece.key).encode()) % flat.numel()
        flat[i] ^= 0xFF  # one flipped byte: the checksum in the header no longer matches
        return bad

    def close(self) -> None:
        self._closed.set()
        self.inner.close()

    def release(self) -> None:
        self.inner.release()
