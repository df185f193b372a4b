"""RouterConfig and Flight: the router's settings and its state for one request, and
RouterCore: what the router's helpers (admission, event pump) may call on the router."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from cluster.router.delta_stream import DeltaStream
from cluster.router.policies import (
    PrefillPlacement,
    default_placement,
    make_admission_order,
    make_placement,
)
from cluster.router.pool import WorkerHandle
from cluster.router.types import GenerateSpec, RouterError, Usage
from engine.request import SamplingParams
from runtime.messages import EventKind, LegTiming


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
    # cluster/router/policies.py PREFILL_PLACEMENTS; None: default_placement(prefix_affinity)
    placement: str | None = None
    length_buckets: tuple[int, ...] = (256, 1024, 4096)  # thresholds of length-buckets
    # tokens per streamed message (the first token and the last message go at once)
    stream_interval: int = 1
    # send a leg's decode reserve together with its prefill add when nobody waits for
    # admission (the first token waits for the prefill alone); False: reserve, then add
    reserve_with_add: bool = True
    # with reserve_with_add: every arrival that finds nobody waiting sends its reserve at
    # once while the worker's last load, less the blocks of this router's reserves still in
    # flight, has room for it (a burst is reserved in one go); False: one reserve in flight
    # per decode worker, the rest of a burst queues for admission
    pipelined_reserves: bool = True
    # the admission queue's order (cluster/router/policies.py ADMISSION_ORDERS) and the
    # tenants' weights it shares decode KV by (the prefill and link policies' weights)
    admission_order: str = "fcfs"
    tenant_weights: Mapping[str, float] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if self.max_queue_len < 1 or self.max_legs < 1:
            raise ValueError("max_queue_len and max_legs must be >= 1")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        timeouts = (self.request_timeout_s, self.unavailable_grace_s,
                    self.admission_timeout_s if self.admission_timeout_s is not None else 1.0)
        if min(timeouts) <= 0:
            raise ValueError("timeouts must be > 0")
        self.make_placement()  # ValueError names an unknown policy or bad parameters
        make_admission_order(self.admission_order, self.tenant_weights)  # (the same)

    @property
    def placement_name(self) -> str:
        return self.placement or default_placement(self.prefix_affinity)

    def make_placement(self) -> PrefillPlacement:
        """A fresh prefill placement policy (the router's and the simulator's)."""
        name = self.placement_name
        params: dict[str, Any] = {}
        if name == "prefix-affinity":
            params = {"block_size": self.affinity_block_size,
                      "slack_tokens": self.affinity_slack_tokens}
        elif name == "length-buckets":
            params = {"thresholds": self.length_buckets}
        return make_placement(name, **params)


@dataclass(eq=False)
class Flight:
    spec: GenerateSpec
    queue: asyncio.Queue | DeltaStream  # what the request's consumer reads
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
    dispatched_at: float | None = None  # its latest leg's add sent, until the first token
    last_token_at: float | None = None
    timing: LegTiming = field(default_factory=LegTiming)  # summed over its legs
    first_timed: bool = False  # `timing` holds a first token's queue and prefill times
    done: bool = False
    admitted: bool = False
    prefill_done: bool = False  # the current leg's prefill finished (outstanding released)
    leg_first_seen: bool = False  # the current leg's first token was streamed
    held_tokens: list = field(default_factory=list)  # (worker, decode event) that overtook it
    unsent: list[int] = field(default_factory=list)  # tokens held for stream_interval
    unsent_logprobs: list = field(default_factory=list)  # theirs (SamplingParams.logprobs)
    unsent_prompt_logprobs: Any = None  # the prompt's, until the first token goes out
    streamed: bool = False  # its first token went out
    detok: Any = None  # its IncrementalDetokenizer (the detokenizer thread's alone)

    def start_leg(self, leg_id: str) -> tuple[tuple[int, ...], SamplingParams]:
        """Make `leg_id` its current leg; the leg's prompt and sampling: a later leg
        recomputes the tokens so far, whose number max_tokens counts, and the prompt's
        log-probs went out with the first token already."""
        spec = self.spec
        self.leg += 1
        prompt, sampling = tuple(spec.prompt_token_ids), spec.sampling
        if self.generated:
            prompt += tuple(self.generated)
            sampling = replace(sampling, max_tokens=sampling.max_tokens - len(self.generated),
                               prompt_logprobs=None)
        self.leg_id, self.leg_prompt_len = leg_id, len(prompt)
        self.prefill_done = False
        self.leg_first_seen = False
        self.held_tokens = []
        return prompt, sampling

    @property
    def wants_logprobs(self) -> bool:
        """Log-probs of the first token come only with the prefill's FIRST_TOKEN, so such
        a request never streams decode's copy of it (it waits for the prefill's)."""
        s = self.spec.sampling
        return s.logprobs is not None or s.prompt_logprobs is not None

    def add_timing(self, kind: EventKind, t: LegTiming) -> None:
        """A worker's phase times: the first token sets queue, prefill and cache figures
        (of the first leg that reported one: a later leg's prefill recomputes, its
        queue and compute are not the request's TTFT); transfer and decode times add up
        over legs."""
        if kind == EventKind.FIRST_TOKEN:
            if not self.first_timed:
                self.first_timed = True
                self.timing = replace(self.timing, queue_s=t.queue_s, prefill_s=t.prefill_s,
                                      cached_tokens=t.cached_tokens)
        else:
            self.timing = replace(self.timing, transfer_s=self.timing.transfer_s + t.transfer_s,
                                  decode_s=self.timing.decode_s + t.decode_s)

    def usage(self) -> Usage:
        """The request's usage so far (intervals on this process's monotonic clock)."""
        now = time.monotonic()
        t = self.timing
        return Usage(
            prompt_tokens=len(self.spec.prompt_token_ids),
            completion_tokens=len(self.generated),
            cached_prompt_tokens=t.cached_tokens,
            ttft_s=(self.first_token_at or now) - self.arrival,
            queue_s=t.queue_s, prefill_s=t.prefill_s, transfer_s=t.transfer_s,
            decode_s=t.decode_s, e2e_s=now - self.arrival,
            admission_s=(self.dispatched_at or self.arrival) - self.arrival,
        )


class RouterCore(Protocol):
    """The router as its helpers see it (cluster/router/admission.py, cluster/router/events.py):
    its pools and live legs, and the lifecycle steps they may take."""

    config: RouterConfig
    tokenizer: Any  # the model's (None: the front door detokenizes)
    prefill: list[WorkerHandle]
    decode: list[WorkerHandle]
    legs: dict[str, Flight]  # leg id -> its flight (current legs only)
    metrics: Any  # cluster.metrics.ServiceMetrics or None

    @property
    def workers(self) -> list[WorkerHandle]: ...

    async def dispatch(self, flight: Flight, refused: tuple | None = None) -> None: ...

    def release(self, flight: Flight) -> None: ...

    def fail(self, flight: Flight, err: RouterError) -> None: ...

    def end_leg(self, flight: Flight, ended: tuple[WorkerHandle | None, ...] = ()) -> None: ...

    def abort_on(self, w: WorkerHandle, leg_id: str) -> None: ...

    def mark_dead(self, w: WorkerHandle) -> None: ...

    def wake_admission(self) -> None: ...

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task: ...
