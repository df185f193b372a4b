"""RouterConfig and Flight: the router's settings and its state for one request."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from cluster.pool import WorkerHandle
from cluster.types import GenerateSpec, Usage


@dataclass(frozen=True)
class RouterConfig:
    max_queue_len: int = 256  # requests waiting for decode admission
    request_timeout_s: float = 600.0
    # None: a queued request waits (in arrival order) until its deadline; a number caps
    # that wait, after which it ends RESOURCE_EXHAUSTED
    admission_timeout_s: float | None = None
    unavailable_grace_s: float = 15.0  # how long to wait for a dead pool's restart
    # failed legs per request before UNAVAILABLE (dead worker, failed transfer, KV timeout,
    # a preemption before the leg produced a token). Preemptions after progress are not
    # failures and are not counted: each such leg adds >= 1 token, so max_tokens bounds them.
    max_legs: int = 4
    prefix_affinity: bool = True
    affinity_block_size: int = 16
    affinity_slack_tokens: int = 2048
    adaptive_chunks: bool = False  # feed decode pressure to the prefill chunk policy
    itl_target_s: float = 0.1
    kv_keepalive_s: float = 1.0  # how often decode hears that a leg's prefill is still on

    def __post_init__(self) -> None:
        if self.max_queue_len < 1 or self.max_legs < 1:
            raise ValueError("max_queue_len and max_legs must be >= 1")
        timeouts = (self.request_timeout_s, self.unavailable_grace_s,
                    self.admission_timeout_s if self.admission_timeout_s is not None else 1.0)
        if min(timeouts) <= 0:
            raise ValueError("timeouts must be > 0")


@dataclass
class Flight:
    spec: GenerateSpec
    queue: asyncio.Queue
    arrival: float
    leg: int = 0
    leg_id: str = ""
    failures: int = 0  # legs lost to failures (bounded by max_legs)
    preemptions: int = 0  # legs preempted after producing tokens (not failures)
    prefill: WorkerHandle | None = None
    decode: WorkerHandle | None = None
    leg_prompt_len: int = 0
    generated: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    last_token_at: float | None = None
    timing: dict[str, float] = field(default_factory=dict)
    done: bool = False
    admitted: bool = False
    prefill_done: bool = False  # the current leg's prefill finished (outstanding released)
    leg_first_seen: bool = False  # the current leg's first token was streamed
    held_tokens: list = field(default_factory=list)  # (worker, decode event) that overtook it

    def usage(self) -> Usage:
        """The request's usage so far (intervals on this process's monotonic clock)."""
        now = time.monotonic()
        t = self.timing
        return Usage(
            prompt_tokens=len(self.spec.prompt_token_ids),
            completion_tokens=len(self.generated),
            cached_prompt_tokens=int(t.get("cached_tokens", 0)),
            ttft_s=(self.first_token_at or now) - self.arrival,
            queue_s=t.get("queue_s", 0.0), prefill_s=t.get("prefill_s", 0.0),
            transfer_s=t.get("transfer_s", 0.0), decode_s=t.get("decode_s", 0.0),
            e2e_s=now - self.arrival,
        )
