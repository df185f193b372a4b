"""Per-link send-queue disciplines: *which* queued frame leaves next.

``fcfs``: frames leave in the order they became eligible.
``wfq``:  two-level start-time fair queuing over bytes. Tenants share the link in
          proportion to their weights; inside a tenant, its requests share equally, so
          one long prompt's KV cannot monopolise the link in front of short requests.
          Frames of one request always leave in order.

A flow's start tag S advances by ``bytes / weight`` each time it is served; the
backlogged flow with the smallest S goes next. A flow that becomes backlogged starts
at ``max(its last finish tag, V)``, V being the start tag last served, so idling
earns no credit. Pure Python; no clocks, no threads.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class QueuedFrame:
    """A frame waiting on a link. ``item`` is the transport's payload (a frame piece)."""

    request_id: str
    tenant: str
    nbytes: int
    enqueue_t: float
    item: Any = None
    key: tuple = ()


class SendQueue(ABC):
    @abstractmethod
    def push(self, frame: QueuedFrame) -> None: ...

    @abstractmethod
    def peek(self) -> QueuedFrame | None:
        """The frame ``pop`` would return, or None when empty."""

    @abstractmethod
    def pop(self) -> QueuedFrame: ...

    @abstractmethod
    def remove_request(self, request_id: str) -> list[QueuedFrame]:
        """Drop and return every queued frame of the request."""

    @abstractmethod
    def __len__(self) -> int: ...


class FcfsQueue(SendQueue):
    def __init__(self) -> None:
        self._q: deque[QueuedFrame] = deque()

    def push(self, frame: QueuedFrame) -> None:
        self._q.append(frame)

    def peek(self) -> QueuedFrame | None:
        return self._q[0] if self._q else None

    def pop(self) -> QueuedFrame:
        return self._q.popleft()

    def remove_request(self, request_id: str) -> list[QueuedFrame]:
        dropped = [f for f in self._q if f.request_id == request_id]
        if dropped:
            self._q = deque(f for f in self._q if f.request_id != request_id)
        return dropped

    def __len__(self) -> int:
        return len(self._q)


@dataclass(eq=False)
class _Flow:
    weight: float
    start: float = 0.0
    finish: float = 0.0
    frames: deque = field(default_factory=deque)  # request flows: QueuedFrames; tenant flows: unused


class _SfqLevel:
    """Start-time fair queuing among named flows; the caller owns what a flow holds."""

    def __init__(self) -> None:
        self.flows: dict[str, _Flow] = {}  # insertion order breaks ties
        self.backlogged: set[str] = set()
        self.vtime = 0.0

    def activate(self, name: str, weight: float) -> _Flow:
        flow = self.flows.get(name)
        if flow is None:
            flow = self.flows[name] = _Flow(weight=weight, finish=self.vtime)
        if name not in self.backlogged:
            flow.start = max(flow.finish, self.vtime)
            self.backlogged.add(name)
        return flow

    def best(self) -> str | None:
        best, best_s = None, 0.0
        for name in self.flows:
            if name in self.backlogged:
                s = self.flows[name].start
                if best is None or s < best_s:
                    best, best_s = name, s
        return best

    def served(self, name: str, nbytes: int, still_backlogged: bool) -> None:
        flow = self.flows[name]
        self.vtime = flow.start
        flow.finish = flow.start + max(nbytes, 1) / flow.weight
        if still_backlogged:
            flow.start = flow.finish
        else:
            self.backlogged.discard(name)
            # an idle flow keeps its finish tag (no queue-jumping on its next frame) until
            # V passes it; from then on it would restart at V anyway, so it can go
            if len(self.flows) > 64 + 2 * len(self.backlogged):
                for idle in [n for n, f in self.flows.items()
                             if n not in self.backlogged and f.finish <= self.vtime]:
                    del self.flows[idle]

    def forget(self, name: str) -> None:
        self.backlogged.discard(name)
        self.flows.pop(name, None)


class WfqQueue(SendQueue):
    def __init__(self, weight_of: Callable[[str], float]) -> None:
        self._weight_of = weight_of
        self._tenants = _SfqLevel()
        self._requests: dict[str, _SfqLevel] = {}  # tenant -> its requests' level
        self._len = 0

    def push(self, frame: QueuedFrame) -> None:
        self._tenants.activate(frame.tenant, self._weight_of(frame.tenant))
        level = self._requests.setdefault(frame.tenant, _SfqLevel())
        level.activate(frame.request_id, 1.0).frames.append(frame)
        self._len += 1

    def _choose(self) -> tuple[str, str] | None:
        tenant = self._tenants.best()
        if tenant is None:
            return None
        rid = self._requests[tenant].best()
        assert rid is not None, "a backlogged tenant has a backlogged request"
        return tenant, rid

    def peek(self) -> QueuedFrame | None:
        chosen = self._choose()
        if chosen is None:
            return None
        return self._requests[chosen[0]].flows[chosen[1]].frames[0]

    def pop(self) -> QueuedFrame:
        chosen = self._choose()
        assert chosen is not None, "pop from an empty queue"
        tenant, rid = chosen
        level = self._requests[tenant]
        flow = level.flows[rid]
        frame = flow.frames.popleft()
        level.served(rid, frame.nbytes, bool(flow.frames))
        self._tenants.served(tenant, frame.nbytes, bool(level.backlogged))
        self._len -= 1
        return frame

    def remove_request(self, request_id: str) -> list[QueuedFrame]:
        for tenant, level in self._requests.items():
            flow = level.flows.get(request_id)
            if flow is None:
                continue
            dropped = list(flow.frames)
            level.forget(request_id)
            if not level.backlogged:
                self._tenants.backlogged.discard(tenant)
            self._len -= len(dropped)
            return dropped
        return []

    def __len__(self) -> int:
        return self._len


QUEUE_DISCIPLINES: dict[str, Callable[[Callable[[str], float]], SendQueue]] = {
    "fcfs": lambda weight_of: FcfsQueue(),
    "wfq": lambda weight_of: WfqQueue(weight_of),
}


def make_send_queue(name: str, weight_of: Callable[[str], float]) -> SendQueue:
    """Build a discipline by name; ``weight_of(tenant)`` gives WFQ weights."""
    try:
        return QUEUE_DISCIPLINES[name](weight_of)
    except KeyError:
        raise ValueError(f"unknown queue discipline {name!r}; known: {sorted(QUEUE_DISCIPLINES)}") from None
