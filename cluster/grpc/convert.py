"""Conversions between the wire messages (proto.pdserve.v1) and cluster.router.types dataclasses:
a client's GenerateRequest (`build_request`), the responses' log-probs, usage and stats.
A request coming in is validated by cluster/grpc/intake.py.
"""

from __future__ import annotations

from collections.abc import Sequence

from cluster.router.types import ClusterStats, Usage, WorkerStats
from engine.logprobs import PromptLogprobs, TokenLogprobs
from proto.pdserve.v1 import pdserve_pb2 as pb

FINISH_TO_PROTO = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
    "error": pb.FINISH_REASON_ERROR,
}
FINISH_FROM_PROTO = {v: k for k, v in FINISH_TO_PROTO.items()}
_USAGE_FIELDS = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens", "ttft_s",
                 "queue_s", "prefill_s", "transfer_s", "decode_s", "e2e_s", "admission_s")
_WORKER_FIELDS = ("worker_id", "role", "alive", "num_running", "num_waiting",
                  "kv_blocks_used", "kv_blocks_free", "queue_depth", "send_queue_depth")


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
                               num_inflight=s.num_inflight, serving=serving,
                               admission_contended_tokens=s.admission_contended_tokens)


def stats_from_proto(s: pb.GetStatsResponse) -> ClusterStats:
    workers = tuple(WorkerStats(**{n: getattr(w, n) for n in _WORKER_FIELDS},
                                extra=dict(w.extra)) for w in s.workers)
    return ClusterStats(workers=workers, router_queue_depth=s.router_queue_depth,
                        num_inflight=s.num_inflight, serving=s.serving,
                        admission_contended_tokens=dict(s.admission_contended_tokens))
