"""Plain dataclasses that cross the router <-> server boundary, and the router contract.

The gRPC server (cluster/serve/server.py) talks only to a `RouterAPI`: the disaggregated router
(cluster/router/router.py) and the colocated backend (cluster/launch/local_backend.py) both implement it.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

from engine.logprobs import PromptLogprobs, TokenLogprobs
from engine.request import SamplingParams


class ErrorCode(str, enum.Enum):
    """Mirrors the gRPC status codes the server answers with."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAVAILABLE = "UNAVAILABLE"
    CANCELLED = "CANCELLED"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    INTERNAL = "INTERNAL"


class RouterError(Exception):
    """A request-level failure with the status the client should see."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True)
class GenerateSpec:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    tenant: str = "default"
    priority: int = 0
    ttft_deadline_ms: float | None = None


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    ttft_s: float = 0.0
    queue_s: float = 0.0
    prefill_s: float = 0.0
    transfer_s: float = 0.0
    decode_s: float = 0.0
    e2e_s: float = 0.0
    admission_s: float = 0.0  # arrival -> the first token's leg dispatched (router clock)


@dataclass(slots=True)
class TokenDelta:
    """New tokens of one request; the last delta has `finished` and `finish_reason` set.
    Built once per streamed message and never changed after (not frozen: a frozen
    dataclass's __init__ costs a setattr call per field, 4x the time, per message)."""

    request_id: str
    token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    usage: Usage | None = None
    # the tokens' text when the router detokenized them (off the front door's event
    # loop, engine/detokenize.py); None: the front door detokenizes itself
    text: str | None = None
    # SamplingParams.logprobs: one per token of token_ids (engine/logprobs.py)
    logprobs: tuple[TokenLogprobs, ...] | None = None
    # SamplingParams.prompt_logprobs: one per prompt token (the first None), on the
    # request's first delta
    prompt_logprobs: PromptLogprobs | None = None


@dataclass(frozen=True)
class WorkerStats:
    worker_id: str
    role: str  # "prefill" | "decode" | "colocated"
    alive: bool
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    queue_depth: int = 0
    send_queue_depth: int = 0
    extra: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ClusterStats:
    workers: tuple[WorkerStats, ...]
    router_queue_depth: int = 0
    num_inflight: int = 0
    serving: bool = True
    # tenant -> prompt tokens admitted to decode while another tenant waited (cumulative)
    admission_contended_tokens: dict[str, int] = field(default_factory=dict)


class CommonStream(Protocol):
    """A live request's outgoing deltas as a front door's writer takes them over: it sets
    `sink`, takes the common ones, detaches (cluster/router/delta_stream.py: DeltaStream is one,
    StreamWriter the writer)."""

    request_id: str
    sink: Callable[[], None] | None

    def take_common(self) -> tuple[list[int], str] | None: ...

    def detach(self) -> None: ...


class RouterAPI(Protocol):
    """What the gRPC server needs from a serving backend."""

    vocab_size: int
    max_model_len: int

    def tokenize(self, text: str) -> list[int]: ...

    def detokenize(self, token_ids: list[int]) -> str: ...

    def generate(self, spec: GenerateSpec) -> AsyncIterator[TokenDelta]:
        """Stream deltas; raises RouterError (RESOURCE_EXHAUSTED, UNAVAILABLE, ...)."""
        ...

    def stream(self, request_id: str) -> CommonStream | None:
        """The live request's stream, when the backend hands its common messages over to
        a writer (cluster/router/delta_stream.py StreamWriter); None: the server writes them all."""
        ...

    async def abort(self, request_id: str) -> bool: ...

    async def stats(self) -> ClusterStats: ...

    def healthy(self) -> bool: ...

    async def shutdown(self, drain_timeout_s: float = 10.0) -> None: ...
