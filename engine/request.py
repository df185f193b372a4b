"""Request state: tokens, counters, blocks. The Request owns its token and block state."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from engine.logprobs import LOGPROBS_MODES, PromptLogprobs, TokenLogprobs


class RequestStatus(enum.IntEnum):
    """Ordered lifecycle; everything from FINISHED_STOPPED on is terminal."""

    WAITING = 0
    WAITING_FOR_KV = 1  # decode side: KV ranges still arriving from a prefill worker
    PREFILLING = 2
    RUNNING = 3
    PREEMPTED = 4
    FINISHED_STOPPED = 5
    FINISHED_LENGTH = 6
    FINISHED_ABORTED = 7
    FINISHED_ERROR = 8

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: disabled
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Log-probs (engine/logprobs.py says exactly which): None = off; N >= 0 = the sampled
    # (resp. each prompt) token's log-prob and rank plus the N most likely tokens.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logprobs_mode: str = "processed"  # or "raw" (vLLM's default raw_logprobs)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
                raise ValueError(f"{name} must be None (off) or an integer >= 0, got {n!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, "
                             f"got {self.logprobs_mode!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        # below this, logits / T overflows fp32: such a temperature means argmax anyway
        return self.temperature < GREEDY_TEMPERATURE


@dataclass(eq=False)  # identity: `in` / `remove` on the schedulers' lists cost no field compares
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    tenant: str = "default"
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    # Prompt(-phase) tokens whose KV is written; counts up to `prefill_len`.
    num_computed_tokens: int = 0
    # All tokens whose KV is written (prefill and decode).
    num_cached_tokens: int = 0
    # Tokens the prefill phase must cover: the prompt, or prompt + outputs after a
    # recompute preemption (the sampled token at its end continues the sequence).
    prefill_len: int = 0
    prefix_hit_tokens: int = 0
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    first_token_time: float | None = None
    # With sampling_params.logprobs, in engine.LLM: one entry per output token (the worker
    # engines send each token's log-probs on with it and keep none).
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # With sampling_params.prompt_logprobs: filled chunk by chunk during the prefill; index
    # i is prompt token i (entry 0 is None); complete when the first token is sampled.
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    def __post_init__(self) -> None:
        if self.prefill_len == 0:
            self.prefill_len = len(self.prompt_token_ids)
        if self.sampling_params.seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed(self.sampling_params.seed)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def remaining_prefill(self) -> int:
        return self.prefill_len - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prefill must compute the log-prob of every prompt token (until the first
        token is sampled, when they are complete)."""
        return self.sampling_params.prompt_logprobs is not None and not self.output_token_ids

    @property
    def may_use_prefix_cache(self) -> bool:
        """A cached prefix has no logits: a request that needs its prompt's log-probs
        recomputes the whole prompt (as vLLM does); its blocks are cached as usual."""
        return not self.wants_prompt_logprobs

    def prompt_logprobs_tuple(self) -> PromptLogprobs | None:
        """The prompt's log-probs once the first token is sampled (None if not asked)."""
        if self.sampling_params.prompt_logprobs is None:
            return None
        return tuple(self.prompt_logprobs or (None,))  # a one-token prompt: (None,)

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASON.get(self.status)

    def append_token(self, token_id: int) -> None:
        """Add a sampled token and move to a terminal status if a stop condition holds."""
        self.output_token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        sp = self.sampling_params
        if token_id in sp.stop_token_ids or (
            not sp.ignore_eos and token_id in self.eos_token_ids
        ):
            self.status = RequestStatus.FINISHED_STOPPED
        elif len(self.output_token_ids) >= sp.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: drop all KV; the next prefill covers every token."""
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.prefix_hit_tokens = 0
        if not self.output_token_ids:  # prompt log-probs still incomplete: start over
            self.prompt_logprobs = None
        self.prefill_len = self.num_tokens
        self.num_preemptions += 1
        self.status = RequestStatus.PREEMPTED
