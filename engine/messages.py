"""Plain dataclasses that cross process boundaries between the router and the workers."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.request import SamplingParams


@dataclass(frozen=True)
class PrefillTask:
    """Router -> prefill worker: run this prompt and stream its KV to `decode_endpoint`."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    decode_endpoint: str
    eos_token_ids: tuple[int, ...] = ()
    tenant: str = "default"
    priority: int = 0
    ttft_deadline_s: float | None = None  # seconds after arrival
    num_generated: int = 0  # tail of the prompt that is earlier output (recompute)


@dataclass(frozen=True)
class DecodeTask:
    """Router -> decode worker: reserve room for this request and await its KV."""

    request_id: str
    prompt_len: int
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    num_generated: int = 0  # outputs produced before a recompute (count toward max_tokens)
    tenant: str = "default"


# Event kinds a worker reports to the router.
FIRST_TOKEN = "first_token"  # prefill sampled the first token (the TTFT the client sees)
PREFILL_DONE = "prefill_done"  # every KV frame of the request was delivered
TOKENS = "tokens"  # decode produced tokens (possibly finishing the request)
PREEMPTED = "preempted"  # decode ran out of blocks: recompute through a prefill worker
FAILED = "failed"  # the request cannot continue on this worker (message says why)


@dataclass(frozen=True)
class WorkerEvent:
    kind: str
    request_id: str
    worker_id: str
    token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None  # set when the request ended on this worker
    message: str = ""
    wall_time: float = field(default_factory=time.time)
    timing: dict[str, float] = field(default_factory=dict)
