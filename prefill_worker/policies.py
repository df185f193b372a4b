"""Fairness (which prefill goes first) and chunk (how many tokens) policies, by name.

Every fairness policy has aging: a request not served for `aging_s` seconds jumps ahead
of all others (oldest first), so no policy can starve anyone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass


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


FAIRNESS_POLICIES: dict[str, FairnessKey] = {
    "fcfs": _fcfs,
    "srpt": _srpt,
    "round-robin": _round_robin,
    "wfq": _wfq,
    "edf": _edf,
}


def order(
    policy: str, reqs: list[PrefillState], now: float, aging_s: float,
    served: Mapping[str, float],
) -> list[PrefillState]:
    """Service order for this step: starving requests first (oldest first), then the policy."""
    key = FAIRNESS_POLICIES[policy]

    def waited(r: PrefillState) -> float:
        return now - (r.last_served if r.last_served is not None else r.arrival)

    starving = sorted((r for r in reqs if waited(r) >= aging_s), key=lambda r: r.arrival)
    rest = sorted((r for r in reqs if waited(r) < aging_s), key=lambda r: key(r, now, served))
    return starving + rest


class ChunkPolicy:
    """Chooses C = min(remaining, cap, budget); subclasses adjust the cap or the tail."""

    name = "fixed"

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

    name = "tail-merge"

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

    name = "adaptive"

    def __init__(self, max_chunk: int, min_chunk: int = 16, low: float = 0.3, high: float = 1.0):
        super().__init__(max_chunk, min_chunk)
        self.low, self.high = low, high

    def observe_decode_pressure(self, pressure: float) -> None:
        if pressure >= self.high:
            self.cap = max(self.min_chunk, self.cap // 2)
        elif pressure <= self.low:
            self.cap = min(self.max_chunk, self.cap * 2)


CHUNK_POLICIES: dict[str, type[ChunkPolicy]] = {
    "fixed": ChunkPolicy,
    "tail-merge": TailMergePolicy,
    "adaptive": AdaptivePolicy,
}


def make_chunk_policy(name: str, max_chunk: int, min_chunk: int = 16) -> ChunkPolicy:
    if name not in CHUNK_POLICIES:
        raise ValueError(f"unknown chunk_policy {name!r}; choose one of {sorted(CHUNK_POLICIES)}")
    return CHUNK_POLICIES[name](max_chunk, min_chunk)
