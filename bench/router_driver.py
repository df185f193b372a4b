"""Drive a RouterAPI in-process with a timed workload and record what a client sees.

Used by benchmarks that compare layouts inside one run (no gRPC hop, so the numbers are
the service's own); `bench/client.py` does the same over gRPC for a remote deployment.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

from bench.metrics import RequestRecord
from cluster.types import GenerateSpec, RouterError
from engine.request import SamplingParams


@dataclass(frozen=True)
class TimedRequest:
    request_id: str
    arrival_s: float  # offset from the start of the run
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    kind: str = "default"
    tenant: str = "default"


async def _one(router, req: TimedRequest, t0: float) -> RequestRecord:
    await asyncio.sleep(max(0.0, t0 + req.arrival_s - time.monotonic()))
    sp = SamplingParams(temperature=0.0, max_tokens=req.max_tokens, ignore_eos=True)
    send = time.monotonic()
    times: list[float] = []
    usage, reason, error = None, "", ""
    try:
        async for d in router.generate(GenerateSpec(req.request_id, req.prompt_token_ids, sp,
                                                    tenant=req.tenant)):
            now = time.monotonic()
            times.extend([now] * len(d.token_ids))
            if d.finished:
                usage, reason = d.usage, d.finish_reason or ""
    except RouterError as e:
        error = f"{e.code.value}: {e.message}"
    return RequestRecord(
        req.request_id, len(req.prompt_token_ids), send, tuple(times),
        end_time=times[-1] if times else None, tenant=req.tenant, kind=req.kind,
        success=not error, finish_reason=reason, error=error,
        queue_s=usage.queue_s if usage else None, prefill_s=usage.prefill_s if usage else None,
        transfer_s=usage.transfer_s if usage else None,
        decode_s=usage.decode_s if usage else None,
    )


async def run_workload(router, requests: Sequence[TimedRequest]) -> list[RequestRecord]:
    t0 = time.monotonic()
    return list(await asyncio.gather(*(_one(router, r, t0) for r in requests)))
