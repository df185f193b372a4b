"""PromptIntake: the one place a GenerateRequest becomes a validated GenerateSpec, for
every front door (gRPC, OpenAI HTTP).

Validation comes in two steps, both raising ValueError whose message starts with the
field's name (the server returns it as INVALID_ARGUMENT): `check_request` does the checks
that cost nothing (ids, the prompt's byte size and token count, list sizes) *before* a
text prompt is tokenized (off the event loop), then `spec_from_request` checks the
tokens and the sampling fields and builds the spec. Unset optional sampling fields take
SamplingParams' defaults (temperature 1.0, top_p 1.0, top_k -1, max_tokens 16,
unseeded, no log-probs); an explicit 0 is a value.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from cluster.config.serve import LimitsSection
from cluster.router.types import GenerateSpec, RouterAPI
from engine.request import SamplingParams
from engine.validation import validate_stop_token_ids
from proto.pdserve.v1 import pdserve_pb2 as pb

DEFAULT_MAX_PROMPT_BYTES = LimitsSection().max_prompt_bytes
MAX_ID_LEN = 256  # request_id / tenant
DEFAULT_MAX_LOGPROBS = 20  # limits.max_logprobs


class PromptIntake:
    def __init__(self, router: RouterAPI, *, max_prompt_tokens: int | None = None,
                 max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES,
                 max_logprobs: int = DEFAULT_MAX_LOGPROBS, logprobs_mode: str = "processed"):
        self.router = router
        self.max_prompt_tokens = max_prompt_tokens
        self.max_prompt_bytes = max_prompt_bytes
        self.max_logprobs = max_logprobs
        self.logprobs_mode = logprobs_mode
        # Off the event loop (streams and health checks never wait for a long text), one
        # at a time: a HF fast tokenizer used from two threads at once can fail with
        # "Already borrowed".
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pdserve-tokenize")

    async def run_off_loop(self, fn, *args):
        """Run tokenizer work (encode, chat templates) on the intake's thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def spec(self, request: pb.GenerateRequest, request_id: str) -> GenerateSpec:
        """The validated spec; ValueError names the offending field."""
        router = self.router
        check_request(request, request_id=request_id, max_model_len=router.max_model_len,
                      max_prompt_bytes=self.max_prompt_bytes)
        if request.WhichOneof("prompt") == "text":
            ids = await self.run_off_loop(router.tokenize, request.text)
        else:
            ids = request.token_ids.ids
        return spec_from_request(request, request_id=request_id, prompt_ids=ids,
                                 vocab_size=router.vocab_size, max_model_len=router.max_model_len,
                                 max_prompt_tokens=self.max_prompt_tokens,
                                 max_logprobs=self.max_logprobs,
                                 logprobs_mode=self.logprobs_mode)

    def close(self) -> None:
        self._pool.shutdown(wait=False)


def _finite(name: str, value: float) -> float:
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    return value


def check_request(req: pb.GenerateRequest, *, request_id: str, max_model_len: int,
                  max_prompt_bytes: int | None = None) -> None:
    """The checks that need no tokenizer; run them before tokenizing (sizes first)."""
    if len(request_id) > MAX_ID_LEN:
        raise ValueError(f"request_id is longer than {MAX_ID_LEN} characters")
    if len(req.tenant) > MAX_ID_LEN:
        raise ValueError(f"tenant is longer than {MAX_ID_LEN} characters")
    kind = req.WhichOneof("prompt")
    if kind is None:
        raise ValueError("prompt is not set: set prompt.text or prompt.token_ids")
    if kind == "text":
        if not req.text:
            raise ValueError("prompt.text is empty")
        # characters bound the UTF-8 size from below: no need to encode a huge text
        if max_prompt_bytes is not None and (len(req.text) > max_prompt_bytes or len(
                req.text.encode()) > max_prompt_bytes):
            raise ValueError(f"prompt.text is larger than the server's limits.max_prompt_bytes "
                             f"({max_prompt_bytes} bytes of UTF-8)")
    else:
        _check_prompt_len(len(req.token_ids.ids), max_model_len, "prompt.token_ids")
    if req.stop_token_ids:  # the count; ids later
        validate_stop_token_ids(req.stop_token_ids, vocab_size=None)


def _check_prompt_len(n: int, max_model_len: int, name: str) -> None:
    if n == 0:
        raise ValueError(f"{name} is empty")
    if n >= max_model_len:
        raise ValueError(
            f"prompt has {n} tokens; max_model_len is {max_model_len} "
            "(the prompt must leave room for at least one generated token)")


def spec_from_request(
    req: pb.GenerateRequest, *, request_id: str, prompt_ids: Sequence[int],
    vocab_size: int, max_model_len: int, max_prompt_tokens: int | None = None,
    max_logprobs: int = DEFAULT_MAX_LOGPROBS, logprobs_mode: str = "processed",
) -> GenerateSpec:
    """Validate a GenerateRequest that passed `check_request`, whose prompt is
    `prompt_ids` (the token_ids, or the tokenized text); messages name the field.
    `logprobs_mode` is the server's (model.logprobs_mode), set on every request."""
    ids = list(prompt_ids)
    if req.WhichOneof("prompt") == "text" and not ids:
        raise ValueError("prompt.text tokenizes to no tokens")
    _check_prompt_len(len(ids), max_model_len, "prompt")
    if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
        raise ValueError(f"prompt has {len(ids)} tokens; the server's limits.max_prompt_tokens "
                         f"is {max_prompt_tokens}")
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise ValueError(f"prompt.token_ids[{i}] = {t} is outside the vocabulary "
                             f"[0, {vocab_size})")
    if req.stop_token_ids:
        validate_stop_token_ids(req.stop_token_ids, vocab_size)
    kw: dict = {}
    if req.HasField("temperature"):
        kw["temperature"] = _finite("temperature", req.temperature)
        if kw["temperature"] < 0:
            raise ValueError(f"temperature must be >= 0, got {req.temperature}")
    if req.HasField("top_p"):
        kw["top_p"] = _finite("top_p", req.top_p)
        if not 0.0 < kw["top_p"] <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {req.top_p}")
    if req.HasField("top_k"):
        if req.top_k == 0 or req.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {req.top_k}")
        kw["top_k"] = req.top_k
    if req.HasField("max_tokens"):
        if req.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {req.max_tokens}")
        kw["max_tokens"] = req.max_tokens
    if req.HasField("seed"):
        if req.seed < 0:
            raise ValueError(f"seed must be >= 0, got {req.seed}")
        kw["seed"] = req.seed
    if req.HasField("ignore_eos"):
        kw["ignore_eos"] = req.ignore_eos
    for name in ("logprobs", "prompt_logprobs"):
        if req.HasField(name):
            n = getattr(req, name)
            if not 0 <= n <= max_logprobs:
                raise ValueError(f"{name} must be in [0, {max_logprobs}] (the server's "
                                 f"limits.max_logprobs), got {n}")
            kw[name] = n
    deadline = None
    if req.HasField("ttft_deadline_ms"):
        deadline = _finite("ttft_deadline_ms", req.ttft_deadline_ms)
        if deadline <= 0:
            raise ValueError(f"ttft_deadline_ms must be > 0, got {req.ttft_deadline_ms}")
    sampling = SamplingParams(stop_token_ids=tuple(req.stop_token_ids),
                              logprobs_mode=logprobs_mode, **kw)
    return GenerateSpec(request_id=request_id, prompt_token_ids=tuple(ids), sampling=sampling,
                        tenant=req.tenant or "default", priority=req.priority,
                        ttft_deadline_ms=deadline)
