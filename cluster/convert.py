"""Conversions between the wire messages (proto.pdserve.v1) and cluster.types dataclasses.

The door's validation comes in two steps, both raising ValueError whose message starts
with the field's name (the server returns it as INVALID_ARGUMENT): `check_request` does
the checks that cost nothing (ids, the prompt's byte size and token count, list sizes)
*before* the server tokenizes a text prompt (off its event loop), then
`spec_from_request` checks the tokens and the sampling fields and builds the spec.
Unset optional sampling fields take SamplingParams' defaults (temperature 1.0,
top_p 1.0, top_k -1, max_tokens 16, unseeded, no log-probs); an explicit 0 is a value.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from cluster.types import ClusterStats, GenerateSpec, Usage, WorkerStats
from engine.logprobs import PromptLogprobs, TokenLogprobs
from engine.request import SamplingParams
from engine.validation import validate_stop_token_ids
from proto.pdserve.v1 import pdserve_pb2 as pb

MAX_ID_LEN = 256  # request_id / tenant
DEFAULT_MAX_LOGPROBS = 20  # limits.max_logprobs

FINISH_TO_PROTO = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
    "error": pb.FINISH_REASON_ERROR,
}
FINISH_FROM_PROTO = {v: k for k, v in FINISH_TO_PROTO.items()}
_USAGE_FIELDS = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens", "ttft_s",
                 "queue_s", "prefill_s", "transfer_s", "decode_s", "e2e_s")
_WORKER_FIELDS = ("worker_id", "role", "alive", "num_running", "num_waiting",
                  "kv_blocks_used", "kv_blocks_free", "queue_depth", "send_queue_depth")


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
    validate_stop_token_ids(req.stop_token_ids, vocab_size=None)  # the count; ids later


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


def build_request(
    prompt: str | Sequence[int], *, request_id: str = "", temperature: float | None = None,
    top_p: float | None = None, top_k: int | None = None, max_tokens: int | None = None,
    seed: int | None = None, stop_token_ids: Sequence[int] = (), ignore_eos: bool | None = None,
    tenant: str = "", priority: int = 0, ttft_deadline_ms: float | None = None,
    logprobs: int | None = None, prompt_logprobs: int | None = None,
) -> pb.GenerateRequest:
    """A GenerateRequest; None leaves an optional field unset (server default)."""
    req = pb.GenerateRequest(request_id=request_id, stop_token_ids=list(stop_token_ids),
                             tenant=tenant, priority=priority)
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(int(t) for t in prompt)
    for name, value in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k),
                        ("max_tokens", max_tokens), ("seed", seed), ("ignore_eos", ignore_eos),
                        ("ttft_deadline_ms", ttft_deadline_ms), ("logprobs", logprobs),
                        ("prompt_logprobs", prompt_logprobs)):
        if value is not None:
            setattr(req, name, value)
    return req


def logprobs_to_proto(lps: Sequence[TokenLogprobs]) -> list[pb.TokenLogprobs]:
    return [pb.TokenLogprobs(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank,
                             top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
            for lp in lps]


def prompt_logprobs_to_proto(lps: PromptLogprobs) -> list[pb.TokenLogprobs]:
    """GenerateResponse.prompt_logprobs: from the second prompt token on."""
    return logprobs_to_proto(lps[1:])  # type: ignore[arg-type]  # only [0] is None


def logprobs_from_proto(lps) -> tuple[TokenLogprobs, ...]:
    return tuple(TokenLogprobs(lp.token_id, lp.logprob, lp.rank,
                               tuple((t.token_id, t.logprob) for t in lp.top)) for lp in lps)


def usage_to_proto(u: Usage) -> pb.Usage:
    return pb.Usage(**{name: getattr(u, name) for name in _USAGE_FIELDS})


def usage_from_proto(u: pb.Usage) -> Usage:
    return Usage(**{name: getattr(u, name) for name in _USAGE_FIELDS})


def stats_to_proto(s: ClusterStats, serving: bool) -> pb.GetStatsResponse:
    workers = [pb.WorkerStats(**{n: getattr(w, n) for n in _WORKER_FIELDS},
                              extra={k: float(v) for k, v in w.extra.items()})
               for w in s.workers]
    return pb.GetStatsResponse(workers=workers, router_queue_depth=s.router_queue_depth,
                               num_inflight=s.num_inflight, serving=serving)


def stats_from_proto(s: pb.GetStatsResponse) -> ClusterStats:
    workers = tuple(WorkerStats(**{n: getattr(w, n) for n in _WORKER_FIELDS},
                                extra=dict(w.extra)) for w in s.workers)
    return ClusterStats(workers=workers, router_queue_depth=s.router_queue_depth,
                        num_inflight=s.num_inflight, serving=s.serving)
