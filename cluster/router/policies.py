"""Placement policies by name: which prefill worker takes a prompt, in which order the
decode workers are asked for room. Pure Python over plain load records (no Ray, no
asyncio), so the router and the simulator (sim/) run the same decisions.

Prefill placement (``PREFILL_PLACEMENTS``):
  least-outstanding  the worker with the fewest outstanding prefill tokens (the first of
                     equals, in the order given)
  prefix-affinity    least-outstanding, but a prompt goes back to the worker that last
                     took the same first block (whose prefix cache likely holds it) unless
                     that one is more than ``slack_tokens`` busier than the least loaded:
                     the router's default with prefix caching on (cluster/router/router.py)
  length-buckets     short / medium / long / ultra-long prompts (``thresholds``) go to
                     dedicated slices of the pool, least-outstanding inside a slice

Decode order (``DECODE_ORDERS``):
  least-kv-usage     every worker, least KV usage first (stable among equals): the order
                     cluster/router/admission.py asks them to reserve. The usage is the workers'
                     last reported stats, which the router refreshes only when asked
                     (GetStats, the /metrics refresher): unrefreshed, every worker looks
                     empty and the first one takes every request it has room for
  least-legs         least legs the router itself has placed there (always current)

Decode admission order (``ADMISSION_ORDERS``): which waiter of cluster/router/admission.py's
queue asks for decode room first, when decode KV is contended (requests wait):
  fcfs               arrival order (a re-dispatched leg keeps its request's arrival)
  wfq                the tenants share the promised KV by ``tenant_weights``: start-time
                     fair queuing over promised tokens (a tenant's waiter is tagged where
                     its tenant's earlier waiters end, in tokens / weight, and no earlier
                     than the tag admitted last). Starvation-free: a waiter's tag is fixed
                     and every later waiter of any tenant is tagged past the virtual time,
                     which rises with each admission. And the tenants share the
                     pool's room by weight: a tenant whose legs hold its weighted share
                     of the live pool's tokens (among the tenants holding or waiting for
                     room) takes more only when no tenant within its share waits, and a
                     request that finds nobody waiting goes at once
                     (pools.reserve_with_add) only within its tenant's share (so a burst
                     that reaches an idle pool is not admitted in arrival order)

    policy = make_placement("length-buckets", thresholds=(256, 1024, 4096))
    wid = policy.pick([PrefillLoad("prefill-0", 900), PrefillLoad("prefill-1", 0)], prompt)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import pairwise
from operator import attrgetter
from typing import Any, ClassVar, NamedTuple

from engine.block_manager import block_hashes

MAX_AFFINITY_KEYS = 1 << 16  # first blocks remembered (they come from clients' prompts)


class PrefillLoad(NamedTuple):
    """The router's view of one live prefill worker (a tuple: built per decision)."""

    worker_id: str
    outstanding_tokens: int  # prompt tokens dispatched to it, prefill not done yet


class DecodeLoad(NamedTuple):
    """The router's view of one live decode worker (``kv_usage`` as last reported)."""

    worker_id: str
    kv_usage: float
    legs: int = 0  # legs the router has placed there and not ended


_OUTSTANDING = attrgetter("outstanding_tokens")
_KV_USAGE, _LEGS = attrgetter("kv_usage"), attrgetter("legs")


def least_outstanding(loads: Sequence[PrefillLoad]) -> PrefillLoad:
    """The first worker with the fewest outstanding tokens."""
    if not loads:
        raise ValueError("no prefill worker to place on")
    return min(loads, key=_OUTSTANDING)


class PrefillPlacement(ABC):
    """Chooses a prefill worker for a prompt. May keep state (affinity memory)."""

    name: ClassVar[str] = ""

    @abstractmethod
    def pick(self, loads: Sequence[PrefillLoad], prompt: Sequence[int],
             hashes: Sequence[bytes] | None = None) -> str:
        """The worker_id of the chosen worker among ``loads`` (the live workers).
        ``hashes``: the prompt's ``block_hashes`` at the placement's block size, if the
        caller has them (the simulator hashes a prompt once for placement and prefill)."""

    def describe(self) -> dict[str, Any]:
        return {"name": self.name}


class LeastOutstanding(PrefillPlacement):
    name: ClassVar[str] = "least-outstanding"

    def pick(self, loads: Sequence[PrefillLoad], prompt: Sequence[int],
             hashes: Sequence[bytes] | None = None) -> str:
        return least_outstanding(loads).worker_id


class PrefixAffinity(PrefillPlacement):
    """Least outstanding tokens, sticky on a prompt's first block within ``slack_tokens``.
    Keeps the ``capacity`` most recent first blocks."""

    name: ClassVar[str] = "prefix-affinity"

    def __init__(self, block_size: int = 16, slack_tokens: int = 2048,
                 capacity: int = MAX_AFFINITY_KEYS):
        if block_size < 1 or slack_tokens < 0 or capacity < 1:
            raise ValueError("prefix-affinity needs block_size >= 1, slack_tokens >= 0, "
                             f"capacity >= 1; got {block_size}, {slack_tokens}, {capacity}")
        self.block_size, self.slack_tokens, self.capacity = block_size, slack_tokens, capacity
        self._last: OrderedDict[bytes, str] = OrderedDict()  # first block -> worker_id

    def __len__(self) -> int:
        return len(self._last)

    def pick(self, loads: Sequence[PrefillLoad], prompt: Sequence[int],
             hashes: Sequence[bytes] | None = None) -> str:
        best = least_outstanding(loads)
        if len(prompt) <= self.block_size:
            return best.worker_id
        key = hashes[0] if hashes else block_hashes(prompt[: self.block_size],
                                                    self.block_size)[0]
        last = self._last.get(key)
        sticky = next((w for w in loads if w.worker_id == last), None)
        if sticky and sticky.outstanding_tokens <= best.outstanding_tokens + self.slack_tokens:
            best = sticky
        self._last[key] = best.worker_id
        self._last.move_to_end(key)
        while len(self._last) > self.capacity:
            self._last.popitem(last=False)
        return best.worker_id

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "block_size": self.block_size,
                "slack_tokens": self.slack_tokens}


BUCKET_NAMES = ("short", "medium", "long", "ultra-long")


class LengthBuckets(PrefillPlacement):
    """Prompt length -> bucket (``len <= thresholds[i]``: bucket i; beyond: the last) ->
    that bucket's slice of the workers -> least outstanding in the slice.

    With ``n`` workers and ``b`` buckets, bucket i owns positions
    ``[floor(i*n/b), max(floor(i*n/b) + 1, floor((i+1)*n/b)))`` of the given order: every
    bucket has a worker, and with fewer workers than buckets neighbours share one.
    """

    name: ClassVar[str] = "length-buckets"

    def __init__(self, thresholds: Sequence[int] = (256, 1024, 4096)):
        t = tuple(int(x) for x in thresholds)
        if not t or any(x < 1 for x in t) or any(b <= a for a, b in pairwise(t)):
            raise ValueError(f"length-buckets thresholds must be increasing and >= 1, got {t}")
        if len(t) + 1 > len(BUCKET_NAMES):
            raise ValueError(f"length-buckets takes at most {len(BUCKET_NAMES) - 1} thresholds, "
                             f"got {len(t)}")
        self.thresholds = t

    @property
    def num_buckets(self) -> int:
        return len(self.thresholds) + 1

    def bucket(self, prompt_len: int) -> int:
        return next((i for i, x in enumerate(self.thresholds) if prompt_len <= x),
                    len(self.thresholds))

    def members(self, bucket: int, n: int) -> range:
        b = self.num_buckets
        lo = bucket * n // b
        return range(lo, max(lo + 1, (bucket + 1) * n // b))

    def pick(self, loads: Sequence[PrefillLoad], prompt: Sequence[int],
             hashes: Sequence[bytes] | None = None) -> str:
        if not loads:
            raise ValueError("no prefill worker to place on")
        mine = self.members(self.bucket(len(prompt)), len(loads))
        return least_outstanding([loads[i] for i in mine]).worker_id

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "thresholds": list(self.thresholds),
                "buckets": list(BUCKET_NAMES[: self.num_buckets])}


PREFILL_PLACEMENTS: dict[str, Callable[..., PrefillPlacement]] = {
    LeastOutstanding.name: LeastOutstanding,
    PrefixAffinity.name: PrefixAffinity,
    LengthBuckets.name: LengthBuckets,
}


def make_placement(name: str, **params: Any) -> PrefillPlacement:
    """A fresh placement policy by name; ValueError names an unknown one or bad params."""
    try:
        factory = PREFILL_PLACEMENTS[name]
    except KeyError:
        raise ValueError(f"unknown prefill placement {name!r}; choose one of "
                         f"{sorted(PREFILL_PLACEMENTS)}") from None
    try:
        return factory(**params)
    except TypeError as e:
        raise ValueError(f"prefill placement {name!r}: {e}") from None


def default_placement(prefix_caching: bool) -> str:
    """Today's router: prefix affinity when prefix caching is on, else least outstanding."""
    return PrefixAffinity.name if prefix_caching else LeastOutstanding.name


def least_kv_usage(loads: Sequence[DecodeLoad]) -> list[str]:
    return [w.worker_id for w in sorted(loads, key=_KV_USAGE)]


def least_legs(loads: Sequence[DecodeLoad]) -> list[str]:
    return [w.worker_id for w in sorted(loads, key=_LEGS)]


DECODE_ORDERS: dict[str, Callable[[Sequence[DecodeLoad]], list[str]]] = {
    "least-kv-usage": least_kv_usage,
    "least-legs": least_legs,
}


def decode_order(name: str, loads: Sequence[DecodeLoad]) -> list[str]:
    """The worker ids to ask for a reservation, in order."""
    try:
        return DECODE_ORDERS[name](loads)
    except KeyError:
        raise ValueError(f"unknown decode order {name!r}; choose one of "
                         f"{sorted(DECODE_ORDERS)}") from None


class AdmissionOrder:
    """The decode admission queue's order: the sort key a waiter gets when it joins."""

    name: ClassVar[str]

    def key(self, arrival: float, tenant: str, tokens: int) -> tuple[float, ...]:
        raise NotImplementedError

    def admitted(self, key: tuple[float, ...]) -> None:
        """A waiter with ``key`` was admitted."""

    # whether tenants share the decode pool's room by weight (AdmissionCore.within_share)
    shares_room: ClassVar[bool] = False

    def share(self, tenant: str, others: Iterable[str]) -> float:
        """``tenant``'s share of the pool's room beside ``others`` (holding or waiting)."""
        return 1.0

    def idle(self) -> None:
        """The queue is empty: nothing is contended."""


class ArrivalOrder(AdmissionOrder):
    name = "fcfs"

    def key(self, arrival: float, tenant: str, tokens: int) -> tuple[float, ...]:
        return (arrival,)


class TenantFairOrder(AdmissionOrder):
    """Start-time fair queuing over promised tokens, weighted by tenant."""

    name = "wfq"

    def __init__(self, tenant_weights: Mapping[str, float] | None = None,
                 default_weight: float = 1.0):
        self.weights = dict(tenant_weights or {})
        bad = {t: w for t, w in self.weights.items() if not w > 0}
        if bad or not default_weight > 0:
            raise ValueError(f"tenant weights must be > 0, got {bad or default_weight}")
        self.default_weight = default_weight
        self.vtime = 0.0  # the start tag admitted last (never decreasing)
        self._finish: dict[str, float] = {}  # tenant -> where its last waiter's tag ends

    def key(self, arrival: float, tenant: str, tokens: int) -> tuple[float, ...]:
        start = max(self.vtime, self._finish.get(tenant, 0.0))
        weight = self.weights.get(tenant, self.default_weight)
        self._finish[tenant] = start + max(tokens, 1) / weight
        return (start, arrival)

    shares_room = True

    def share(self, tenant: str, others: Iterable[str]) -> float:
        weight = self.weights.get(tenant, self.default_weight)
        return weight / (weight + sum(self.weights.get(t, self.default_weight)
                                      for t in others))

    def admitted(self, key: tuple[float, ...]) -> None:
        if key[0] > self.vtime:
            self.vtime = key[0]
            # a tenant whose tags all lie behind the virtual time is tagged from it anyway:
            # forget it (tenants are the clients' strings)
            self._finish = {t: f for t, f in self._finish.items() if f > self.vtime}

    def idle(self) -> None:
        # no backlog: every tenant starts afresh at the virtual time (a tenant that ran ahead
        # before keeps no debt into the next contended period, as in start-time fair queuing)
        self.vtime = max(self.vtime, *self._finish.values()) if self._finish else self.vtime
        self._finish.clear()


ADMISSION_ORDERS: dict[str, type[AdmissionOrder]] = {
    ArrivalOrder.name: ArrivalOrder,
    TenantFairOrder.name: TenantFairOrder,
}
ADMISSION_ORDER_HELP = {"fcfs": "arrival order", "wfq": "tenants share the promised decode KV "
                        "by tenant_weights (start-time fair queuing over tokens)"}


def make_admission_order(name: str, tenant_weights: Mapping[str, float] | None = None
                         ) -> AdmissionOrder:
    """A fresh admission order by name; ValueError names an unknown one."""
    if name not in ADMISSION_ORDERS:
        raise ValueError(f"unknown decode admission order {name!r}; choose one of "
                         f"{sorted(ADMISSION_ORDERS)}")
    return TenantFairOrder(tenant_weights) if name == "wfq" else ArrivalOrder()
