"""The P/D messages: frozen dataclasses that cross the router <-> worker process boundary.

Below the router every id is a *leg* id (one dispatch of a request to a prefill/decode
pair, see cluster/router/router.py): tasks, events and the engines' tables are keyed by it.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.logprobs import PromptLogprobs, TokenLogprobs
from engine.request import FinishReason, SamplingParams


@dataclass(frozen=True)
class PrefillTask:
    """Router -> prefill worker: run this prompt and stream its KV to `decode_endpoint`."""

    leg_id: str
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
    """Router -> decode worker: reserve room for this leg and await its KV."""

    leg_id: str
    prompt_len: int
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    num_generated: int = 0  # outputs produced before a recompute (count toward max_tokens)
    tenant: str = "default"


class EventKind(str, enum.Enum):
    """What a worker reports to the router about one leg."""

    FIRST_TOKEN = "first_token"  # prefill sampled the first token (the TTFT the client sees)
    PREFILL_DONE = "prefill_done"  # every KV frame of the leg was delivered
    TOKENS = "tokens"  # decode produced tokens (possibly finishing the request)
    PREEMPTED = "preempted"  # decode ran out of blocks: recompute through a prefill worker
    FAILED = "failed"  # the leg cannot continue on this worker (message says why)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class LegTiming:
    """Seconds of one leg's phases, each measured on the reporting worker's monotonic
    clock; an event carries only the phases it ends (the others stay 0)."""

    queue_s: float = 0.0  # arrival on the worker -> first chunk scheduled
    prefill_s: float = 0.0  # first chunk scheduled -> first token
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    transfer_s: float = 0.0  # first token -> last KV frame delivered
    decode_s: float = 0.0  # decode start -> the leg's last token


NO_TIMING = LegTiming()


# slots, not frozen: a decode step makes one per token, and a frozen dataclass's
# __init__ (object.__setattr__ per field) costs ~1 us of it, 6x a plain one; nothing
# changes an event once made
@dataclass(slots=True)
class WorkerEvent:
    kind: EventKind
    leg_id: str
    worker_id: str
    token_ids: tuple[int, ...] = ()
    finish_reason: FinishReason | None = None  # set when the request ended on this worker
    message: str = ""
    wall_time: float = field(default_factory=time.time)
    timing: LegTiming = NO_TIMING
    # SamplingParams.logprobs: one per token of token_ids; prompt_logprobs: the whole
    # prompt's (first entry None), on a leg's FIRST_TOKEN only
    logprobs: tuple[TokenLogprobs, ...] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    # decode's first TOKENS of a leg: the leg's first token (the prefill's, from the final
    # KV chunk), sampled before token_ids; the router uses it if the prefill's is late
    first_token: int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class WorkerInfo:
    """A worker actor's answer to `ready()`: who it is and what it holds."""

    worker_id: str
    role: str  # "prefill" | "decode" | "colocated"
    num_blocks: int
    block_size: int
    endpoint: str = ""  # where prefill workers send this worker's KV ("" if none)
    pid: int = 0
    node_id: str = ""
    device: str = "cpu"
    gpu_ids: tuple[str, ...] = ()
    cuda_visible_devices: str | None = None
    # a tensor-parallel worker: one line per rank (pid, node, GPUs), rank 0 first
    tp_ranks: tuple[str, ...] = ()
    channel: str = ""  # host:port of its control channel (runtime/channel.py; "" if none)


@dataclass(frozen=True)
class WorkerLoad:
    """A worker's load as every step's channel message carries it: what each front door
    places requests on (all front doors see every worker's load, not just their own)."""

    kv_blocks_used: int = 0
    kv_blocks_promisable: int = 0  # decode: free blocks no reservation is owed
    num_running: int = 0
    num_waiting: int = 0
    outstanding_tokens: int = 0  # prefill: prompt tokens not yet prefilled
