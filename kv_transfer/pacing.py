"""Send policies and pacers: *when* a queued frame may leave.

Plain Python with an injectable clock, so a test drives them step by step on a
``ManualClock`` and the algorithm is checked deterministically.

Policies (by name, the registry ``SEND_POLICIES``; the config's choices and --help read it):
  at_end  a request's frames are held until its final chunk is queued (no streaming:
          the baseline that disaggregation with streaming is compared against)
  eager   a frame may leave as soon as it is queued
  paced   eager + a per-link token bucket of ``rate_bytes_per_s`` and ``burst_bytes``
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from engine.registry import Registry

Clock = Callable[[], float]


class PacingConfig(Protocol):
    """What a pacer reads of the transfer config (kv_transfer.config.TransferConfig)."""

    @property
    def rate_bytes_per_s(self) -> float: ...

    @property
    def burst_bytes(self) -> int: ...


class ManualClock:
    """A clock that only moves when told to (tests, simulations)."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, dt: float) -> None:
        assert dt >= 0, "time never goes backwards"
        self.now += dt


def monotonic_clock() -> float:
    return time.monotonic()


class Pacer(ABC):
    """Rate decision for one link. ``delay`` asks, ``consume`` commits."""

    @abstractmethod
    def delay(self, nbytes: int, now: float) -> float:
        """Seconds from ``now`` until ``nbytes`` may leave (0.0: right away)."""

    @abstractmethod
    def consume(self, nbytes: int, now: float) -> None:
        """Record that ``nbytes`` left at ``now``."""


class Unpaced(Pacer):
    def delay(self, nbytes: int, now: float) -> float:
        return 0.0

    def consume(self, nbytes: int, now: float) -> None:
        pass


class TokenBucket(Pacer):
    """Token bucket in bytes that may go into debt.

    A frame leaves once ``min(nbytes, burst)`` tokens are available and then takes all
    ``nbytes`` (the balance may go negative). Frames larger than the bucket therefore
    still leave, and the long-run rate is exactly ``rate``: after the first
    ``burst`` bytes, every byte waits for its token.
    """

    def __init__(self, rate_bytes_per_s: float, burst_bytes: int) -> None:
        assert rate_bytes_per_s > 0 and burst_bytes > 0
        self.rate = float(rate_bytes_per_s)
        self.burst = float(burst_bytes)
        self._tokens = float(burst_bytes)
        self._last: float | None = None

    def _refill(self, now: float) -> None:
        if self._last is not None and now > self._last:
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        if self._last is None or now > self._last:
            self._last = now

    def delay(self, nbytes: int, now: float) -> float:
        self._refill(now)
        short = min(float(nbytes), self.burst) - self._tokens
        if short <= 1e-6:  # float rounding of the refill must not cause a wait of ~1e-19 s
            return 0.0
        # a floor keeps ``now + delay > now`` for any clock value a caller can have
        return max(short / self.rate, 1e-7)

    def consume(self, nbytes: int, now: float) -> None:
        self._refill(now)
        self._tokens -= nbytes

    @property
    def tokens(self) -> float:
        return self._tokens


@dataclass(frozen=True)
class SendPolicy:
    """``hold_until_final``: queue a request's frames only once its final chunk is queued.
    ``needs_rate``: the policy paces at the config's rate (``transfer.rate_gbps``), which
    must then be set (and must not be set for any other policy)."""

    name: str
    hold_until_final: bool
    make_pacer: Callable[[PacingConfig], Pacer]
    help: str = ""
    needs_rate: bool = False


SEND_POLICIES: Registry[SendPolicy] = Registry("send_policy")


def register_send_policy(policy: SendPolicy, *, replace: bool = False) -> SendPolicy:
    """Add a policy under ``policy.name`` (the registry the config validates against)."""
    return SEND_POLICIES.register(policy.name, policy, help=policy.help, replace=replace)


def get_send_policy(name: str) -> SendPolicy:
    return SEND_POLICIES.get(name)


def unpaced(cfg: PacingConfig) -> Pacer:
    """Frames go as fast as the link takes them (an emulated link's rate is the
    transport's, kv_transfer/emulated_link.py, beneath every policy)."""
    return Unpaced()


def rate_pacer(cfg: PacingConfig) -> Pacer:
    return TokenBucket(cfg.rate_bytes_per_s, cfg.burst_bytes)


register_send_policy(SendPolicy("eager", False, unpaced, "as chunks finish"))
register_send_policy(SendPolicy("at_end", True, unpaced, "after the last chunk"))
register_send_policy(SendPolicy("paced", False, rate_pacer, "token bucket at rate_gbps",
                                needs_rate=True))
