"""Per-link send-queue disciplines: *which* queued frame leaves next.

``fcfs``: frames leave in the order they became eligible.
``wfq``:  two-level start-time fair queuing over bytes. Tenants share the link in
          proportion to their weights; inside a tenant, its requests share equally, so
          one long prompt's KV cannot monopolise the link in front of short requests.
          Frames of one request always leave in order.

A flow's start tag S advances by ``bytes / weight`` each time it is served; the
backlogged flow with the smallest S goes next. A flow that becomes backlogged starts
at ``max(its last finish tag, V)``, V being the start tag last served, so idling
earns no credit and a new tenant cannot jump the queue. Tenant names come from clients:
idle tenants and requests are pruned and bounded (``MAX_IDLE_*``). Pure Python; no
clocks, no threads.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.registry import Registry


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


# Idle flows kept for their finish tags; tenant strings come from clients, so both maps
# are bounded (a forgotten flow restarts at V: it gains at most one frame's worth)
MAX_IDLE_TENANTS = 256
MAX_IDLE_REQUESTS = 32  # per tenant


@dataclass(eq=False)
class _Flow:
    weight: float
    order: int  # creation order: breaks ties between equal start tags
    start: float = 0.0
    finish: float = 0.0
    frames: deque = field(default_factory=deque)  # request flows: QueuedFrames; tenant flows: unused


class _SfqLevel:
    """Start-time fair queuing among named flows; the caller owns what a flow holds.

    V (``vtime``) is the start tag last served. A flow that becomes backlogged starts at
    ``max(its finish tag, V)``: V is the floor for a new or returning flow, so nobody is
    owed service for time spent idle. An idle flow is kept only while its finish tag is
    ahead of V (after that it would restart at V anyway), and at most ``max_idle`` of
    those are kept (the ones with the latest finish tags).
    """

    def __init__(self, max_idle: int) -> None:
        self.flows: dict[str, _Flow] = {}
        self.backlogged: set[str] = set()
        self.vtime = 0.0
        self.max_idle = max_idle
        self._prune_at = min(max_idle, 16)
        self._created = 0

    def activate(self, name: str, weight: float) -> _Flow:
        flow = self.flows.get(name)
        if flow is None:
            self._created += 1
            flow = self.flows[name] = _Flow(weight=weight, order=self._created, finish=self.vtime)
        if name not in self.backlogged:
            flow.start = max(flow.finish, self.vtime)
            self.backlogged.add(name)
        return flow

    def best(self) -> str | None:
        if not self.backlogged:
            return None
        return min(self.backlogged, key=lambda n: (self.flows[n].start, self.flows[n].order))

    def served(self, name: str, nbytes: int, still_backlogged: bool) -> list[str]:
        """Account one frame of ``name``; returns the idle flows forgotten meanwhile."""
        flow = self.flows[name]
        self.vtime = flow.start
        flow.finish = flow.start + max(nbytes, 1) / flow.weight
        if still_backlogged:
            flow.start = flow.finish
            return []
        return self.idle(name)

    def idle(self, name: str) -> list[str]:
        """``name`` has nothing queued now; returns the idle flows forgotten."""
        self.backlogged.discard(name)
        n_idle = len(self.flows) - len(self.backlogged)
        if n_idle <= self._prune_at:
            return []
        idle = [n for n, f in self.flows.items() if n not in self.backlogged]
        gone = [n for n in idle if self.flows[n].finish <= self.vtime]
        kept = sorted((n for n in idle if self.flows[n].finish > self.vtime),
                      key=lambda n: self.flows[n].finish)
        if len(kept) > self.max_idle:  # down to half the bound: pruning stays amortised O(1)
            cut = len(kept) - self.max_idle // 2
            gone += kept[:cut]
            kept = kept[cut:]
        for n in gone:
            del self.flows[n]
        self._prune_at = min(self.max_idle, max(16, 2 * len(kept)))
        return gone

    def forget(self, name: str) -> None:
        self.backlogged.discard(name)
        self.flows.pop(name, None)


class WfqQueue(SendQueue):
    def __init__(self, weight_of: Callable[[str], float], *,
                 max_idle_tenants: int = MAX_IDLE_TENANTS,
                 max_idle_requests: int = MAX_IDLE_REQUESTS) -> None:
        self._weight_of = weight_of
        self._tenants = _SfqLevel(max_idle_tenants)
        self._requests: dict[str, _SfqLevel] = {}  # tenant -> its requests' level
        self._tenant_of: dict[str, str] = {}  # request with queued frames -> its tenant
        self._max_idle_requests = max_idle_requests
        self._len = 0

    def push(self, frame: QueuedFrame) -> None:
        # a request queues under one tenant (its first queued frame's), so it stays in order
        tenant = self._tenant_of.get(frame.request_id, frame.tenant)
        self._tenants.activate(tenant, self._weight_of(tenant))
        level = self._requests.get(tenant)
        if level is None:
            level = self._requests[tenant] = _SfqLevel(self._max_idle_requests)
        level.activate(frame.request_id, 1.0).frames.append(frame)
        self._tenant_of[frame.request_id] = tenant
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
        if not flow.frames:
            del self._tenant_of[rid]
        level.served(rid, frame.nbytes, bool(flow.frames))
        self._drop_levels(self._tenants.served(tenant, frame.nbytes, bool(level.backlogged)))
        self._len -= 1
        return frame

    def remove_request(self, request_id: str) -> list[QueuedFrame]:
        tenant = self._tenant_of.pop(request_id, None)
        if tenant is None:
            return []  # nothing queued (its idle flow, if any, ages out like any other)
        level = self._requests[tenant]
        dropped = list(level.flows[request_id].frames)
        level.forget(request_id)
        if not level.backlogged:
            self._drop_levels(self._tenants.idle(tenant))
        self._len -= len(dropped)
        return dropped

    def _drop_levels(self, tenants: list[str]) -> None:
        for t in tenants:  # a forgotten tenant had nothing queued: its requests go with it
            del self._requests[t]

    @property
    def tracked(self) -> tuple[int, int]:
        """(tenants, request flows) this queue holds state for, idle ones included."""
        return len(self._tenants.flows), sum(len(lv.flows) for lv in self._requests.values())

    def __len__(self) -> int:
        return self._len


# name -> factory(weight_of); ``weight_of(tenant)`` gives a tenant's weight
SEND_QUEUES: Registry[Callable[[Callable[[str], float]], SendQueue]] = Registry("send_queue")
SEND_QUEUES.register("fcfs", lambda weight_of: FcfsQueue(), help="in the order frames "
                     "became eligible")
SEND_QUEUES.register("wfq", WfqQueue, help="fair queuing over bytes by tenant_weights, then "
                     "by request")


def make_send_queue(name: str, weight_of: Callable[[str], float]) -> SendQueue:
    """Build a discipline by name; ``weight_of(tenant)`` gives WFQ weights."""
    return SEND_QUEUES.get(name)(weight_of)
