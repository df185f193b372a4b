"""Fairness (which prefill goes first) and chunk (how many tokens) policies, by name.

`FAIRNESS_POLICIES` and `CHUNK_POLICIES` are the registries the config's choices and
--help read: a new policy is a key function (or a ChunkPolicy subclass) plus one
`register(...)` call. Every fairness policy has aging: a request not served for `aging_s`
seconds jumps ahead of all others (oldest first), so no policy can starve anyone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import ClassVar

from engine.registry import Registry


@dataclass
class PrefillState:
    """What the policies see of one prefill (the scheduler owns these)."""

    request_id: str
    arrival: float  # monotonic
    prompt_len: int
    remaining: int
    tenant: str = "default"
    deadline: float | None = None  # monotonic TTFT deadline
    last_served: float | None = None
    priority: int = 0  # lower is served first by the "priority" policy (as in vLLM)


FairnessKey = Callable[[PrefillState, float, Mapping[str, float]], tuple]


def _fcfs(r: PrefillState, now: float, served: Mapping[str, float]) -> tuple:
    return (r.arrival,)


def _srpt(r: PrefillState, now: float, served: Mapping[str, float]) -> tuple:
    return (r.remaining, r.arrival)


def _round_robin(r: PrefillState, now: float, served: Mapping[str, float]) -> tuple:
    return (r.last_served if r.last_served is not None else r.arrival, r.arrival)


def _wfq(r: PrefillState, now: float, served: Mapping[str, float]) -> tuple:
    return (served.get(r.tenant, 0.0), r.arrival)  # weighted tokens already served


def _edf(r: PrefillState, now: float, served: Mapping[str, float]) -> tuple:
    return (r.deadline if r.deadline is not None else float("inf"), r.arrival)


def _priority(r: PrefillState, now: float, served: Mapping[str, float]) -> tuple:
    return (r.priority, r.arrival)


# key(state, now, served) -> sort key: the smallest key is served first
FAIRNESS_POLICIES: Registry[FairnessKey] = Registry("fairness_policy")
FAIRNESS_POLICIES.register("fcfs", _fcfs, help="arrival order")
FAIRNESS_POLICIES.register("srpt", _srpt, help="fewest prompt tokens left first")
FAIRNESS_POLICIES.register("round-robin", _round_robin, help="least recently served first")
FAIRNESS_POLICIES.register("wfq", _wfq, help="tenant with the least service per "
                           "tenant_weights first")
FAIRNESS_POLICIES.register("edf", _edf, help="earliest TTFT deadline first")
FAIRNESS_POLICIES.register("priority", _priority, help="lowest request priority first, then "
                           "arrival; aging_s lifts a starving request")


def order(
    policy: str | FairnessKey, reqs: list[PrefillState], now: float, aging_s: float,
    served: Mapping[str, float],
) -> list[PrefillState]:
    """Service order for this step: starving requests first (oldest first), then the
    policy (a name, or its key as the scheduler resolves it once)."""
    key = FAIRNESS_POLICIES.get(policy) if isinstance(policy, str) else policy
    if len(reqs) < 2:  # (one prefill: its own order, whatever the policy)
        return list(reqs)

    def waited(r: PrefillState) -> float:
        return now - (r.last_served if r.last_served is not None else r.arrival)

    starving = sorted((r for r in reqs if waited(r) >= aging_s), key=lambda r: r.arrival)
    rest = sorted((r for r in reqs if waited(r) < aging_s), key=lambda r: key(r, now, served))
    return starving + rest


class TenantLedger(Mapping[str, float]):
    """WFQ's weighted tokens served per tenant, read by the policies as `served`.

    Tenant names come from clients, so the ledger only knows tenants with a live request
    on this worker (`join` .. `leave`): it never outgrows the requests it holds. Service
    is counted in virtual time: `vtime` is the least service among tenants with a
    running prefill (never decreasing while anyone is live). A tenant whose request
    starts running (`activate`) is lifted to `vtime` at least, so a new, renamed or
    returning tenant is served like the least-served running one instead of going first
    until its zero total "catches up"; a tenant that was ahead keeps its lead.
    """

    def __init__(self, weights: Mapping[str, float] | None = None):
        self.weights = dict(weights or {})
        self.vtime = 0.0
        self._served: dict[str, float] = {}
        self._live: dict[str, int] = {}

    def __getitem__(self, tenant: str) -> float:
        return self._served[tenant]

    def __iter__(self) -> Iterator[str]:
        return iter(self._served)

    def __len__(self) -> int:
        return len(self._served)

    def join(self, tenant: str) -> None:
        self._live[tenant] = self._live.get(tenant, 0) + 1
        self._served.setdefault(tenant, self.vtime)

    def leave(self, tenant: str) -> None:
        n = self._live.get(tenant, 0) - 1
        if n > 0:
            self._live[tenant] = n
            return
        self._live.pop(tenant, None)
        self._served.pop(tenant, None)
        if not self._live:
            self.vtime = 0.0  # nobody left to compare with: start the clock afresh

    def activate(self, tenant: str) -> None:
        self._served[tenant] = max(self._served.get(tenant, 0.0), self.vtime)

    def charge(self, tenant: str, tokens: int) -> None:
        self._served[tenant] = self._served.get(tenant, self.vtime) + tokens / self.weights.get(
            tenant, 1.0)

    def tick(self, running_tenants: Iterable[str]) -> None:
        """Advance virtual time to the least service among the running tenants."""
        least = min((self._served[t] for t in running_tenants if t in self._served),
                    default=None)
        if least is not None:
            self.vtime = max(self.vtime, least)


class ChunkPolicy:
    """Chooses C = min(remaining, cap, budget); subclasses adjust the cap or the tail.

    `uses_decode_pressure`: the router should feed `observe_decode_pressure` (it measures
    the decode pool's ITL against scheduler.itl_target_ms only for policies that ask)."""

    uses_decode_pressure: ClassVar[bool] = False

    def __init__(self, max_chunk: int, min_chunk: int = 16):
        self.max_chunk = max_chunk
        self.min_chunk = min(min_chunk, max_chunk)
        self.cap = max_chunk

    def size(self, remaining: int, budget: int) -> int:
        return max(0, min(remaining, self.cap, budget))

    def observe_decode_pressure(self, pressure: float) -> None:
        """Feedback from the decode pool (0 = idle, >= 1 = over its ITL target)."""


class TailMergePolicy(ChunkPolicy):
    """Folds a tiny last chunk (< min_chunk) into the previous one when the budget allows."""

    def size(self, remaining: int, budget: int) -> int:
        c = super().size(remaining, budget)
        tail = remaining - c
        if 0 < tail < self.min_chunk and remaining <= budget:
            return remaining
        return c


class AdaptivePolicy(ChunkPolicy):
    """Halves the cap while the decode pool is under pressure, doubles it when idle.

    Hysteresis: lower at pressure >= high, raise at pressure <= low, hold in between;
    never below `min_chunk`.
    """

    uses_decode_pressure: ClassVar[bool] = True

    def __init__(self, max_chunk: int, min_chunk: int = 16, low: float = 0.3, high: float = 1.0):
        super().__init__(max_chunk, min_chunk)
        self.low, self.high = low, high

    def observe_decode_pressure(self, pressure: float) -> None:
        if pressure >= self.high:
            self.cap = max(self.min_chunk, self.cap // 2)
        elif pressure <= self.low:
            self.cap = min(self.max_chunk, self.cap * 2)


CHUNK_POLICIES: Registry[type[ChunkPolicy]] = Registry("chunk_policy")
CHUNK_POLICIES.register("fixed", ChunkPolicy, help="max_prefill_chunk tokens")
CHUNK_POLICIES.register("adaptive", AdaptivePolicy, help="shrinks while decode ITL exceeds "
                        "itl_target_ms")
CHUNK_POLICIES.register("tail-merge", TailMergePolicy, help="folds a tiny last chunk into "
                        "the previous one")


def make_chunk_policy(name: str, max_chunk: int, min_chunk: int = 16) -> ChunkPolicy:
    return CHUNK_POLICIES.get(name)(max_chunk, min_chunk)
