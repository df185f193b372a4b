"""Drive a RouterAPI in-process with a timed workload and record what a client sees.

Used by benchmarks that compare layouts inside one run (no gRPC hop, so the numbers are
the service's own); `bench/client.py` does the same over gRPC for a remote deployment.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bench.arrivals import send_at_arrivals
from bench.records import RequestRecord, phase_times
from cluster.router.types import GenerateSpec, RouterError
from engine.request import SamplingParams


@dataclass(frozen=True)
class TimedRequest:
    request_id: str
    arrival_s: float  # offset from the start of the run
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    kind: str = "default"
    tenant: str = "default"
    priority: int = 0
    ttft_deadline_ms: float | None = None


async def _send(router, req: TimedRequest) -> RequestRecord:
    sp = SamplingParams(temperature=0.0, max_tokens=req.max_tokens, ignore_eos=True)
    send = time.monotonic()
    times: list[float] = []
    usage, reason, error = None, "", ""
    spec = GenerateSpec(req.request_id, req.prompt_token_ids, sp, tenant=req.tenant,
                        priority=req.priority, ttft_deadline_ms=req.ttft_deadline_ms)
    try:
        async for d in router.generate(spec):
            now = time.monotonic()
            times.extend([now] * len(d.token_ids))
            if d.finished:
                usage, reason = d.usage, d.finish_reason or ""
    except RouterError as e:
        error = f"{e.code.value}: {e.message}"
    return RequestRecord(
        req.request_id, len(req.prompt_token_ids), send, tuple(times),
        end_time=times[-1] if times else None, tenant=req.tenant, kind=req.kind,
        success=not error, finish_reason=reason, error=error, **phase_times(usage))


async def run_workload(router, requests: Sequence[TimedRequest], *,
                       max_concurrency: int | None = None,
                       on_done: Callable[[RequestRecord], None] | None = None,
                       ) -> list[RequestRecord]:
    """Send each request at its arrival offset; records in input order.

    ``max_concurrency`` caps requests in flight (later arrivals wait, as in
    ``vllm bench serve``; a request's send time is when it is actually sent);
    ``on_done(record)`` is called as each request ends (progress bars).
    """
    return await send_at_arrivals(requests, lambda r: _send(router, r),
                                  max_concurrency=max_concurrency, on_done=on_done)


def timed_requests(requests: Sequence) -> list[TimedRequest]:
    """``bench.workload.WorkloadRequest``s as TimedRequests (same ids, times and tenants)."""
    return [TimedRequest(r.request_id, r.arrival_s, tuple(r.prompt_token_ids), r.max_tokens,
                         kind=r.kind, tenant=r.tenant, priority=r.priority,
                         ttft_deadline_ms=r.ttft_deadline_ms) for r in requests]
