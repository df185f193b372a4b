"""The bench client: drive a running pdserve over gRPC with a timed workload.

Each request is sent at its workload arrival offset (Poisson/gamma from
``bench.workload``), at most ``max_concurrency`` at a time (later arrivals wait for a
slot, as ``vllm bench serve --max-concurrency``; the send time is when the RPC starts).
Every streamed chunk is stamped with ``time.monotonic()`` on arrival and each of its
tokens gets that time; the final chunk's usage gives the server-side phase times. The
result is the same :class:`bench.metrics.RequestRecord` that ``bench.router_driver``
builds in-process, so both feed ``compute_metrics``.

    run = asyncio.run(run_bench("127.0.0.1:50051", build_workload(spec), max_concurrency=8))
    print(compute_metrics(run.records, run.duration_s).format())
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import grpc

from bench.metrics import RequestRecord
from bench.workload import WorkloadRequest
from cluster.client import AsyncPdserveClient, Chunk

Clock = Callable[[], float]
TimedChunk = tuple[float, Chunk]  # (arrival time, chunk)
OK_REASONS = ("stop", "length")


def build_record(req: WorkloadRequest, send_time: float, chunks: Sequence[TimedChunk],
                 error: str = "") -> RequestRecord:
    """The RequestRecord of one request from the chunks that arrived (in order).

    A chunk's tokens all arrived when the chunk did. The request succeeded when the
    stream ended with finish reason ``stop`` or ``length`` and no RPC error; its phase
    times are the final chunk's usage (queue, prefill, transfer, decode).
    """
    times = tuple(t for t, c in chunks for _ in c.token_ids)
    last = chunks[-1][1] if chunks else None
    reason = (last.finish_reason or "") if last is not None else ""
    if not error and reason not in OK_REASONS:
        error = f"stream ended with finish_reason {reason!r}" if reason else \
            "stream ended without a finish reason"
    usage = last.usage if last is not None else None
    return RequestRecord(
        req.request_id, req.prompt_len, send_time, times,
        end_time=chunks[-1][0] if chunks else None, tenant=req.tenant, kind=req.kind,
        success=not error, finish_reason=reason, error=error,
        queue_s=usage.queue_s if usage else None, prefill_s=usage.prefill_s if usage else None,
        transfer_s=usage.transfer_s if usage else None,
        decode_s=usage.decode_s if usage else None,
    )


async def collect(stream: AsyncIterator[Chunk], clock: Clock = time.monotonic,
                  ) -> tuple[list[TimedChunk], str]:
    """All chunks of a stream with their arrival times, and the RPC error ('' if none)."""
    chunks: list[TimedChunk] = []
    try:
        async for chunk in stream:
            chunks.append((clock(), chunk))
    except grpc.RpcError as e:  # grpc.aio.AioRpcError
        code = e.code() if callable(getattr(e, "code", None)) else None
        details = e.details() if callable(getattr(e, "details", None)) else str(e)
        error = f"{code.name if code is not None else 'RPC_ERROR'}: {details}"
        return chunks, error
    return chunks, ""


def request_kwargs(req: WorkloadRequest) -> dict:
    """Generate() arguments of a workload request: greedy, exactly max_tokens tokens."""
    return dict(request_id=req.request_id, max_tokens=req.max_tokens, temperature=0.0,
                ignore_eos=True, tenant=req.tenant, priority=req.priority,
                ttft_deadline_ms=req.ttft_deadline_ms)


async def run_requests(client, requests: Sequence[WorkloadRequest], *,
                       max_concurrency: int | None = None,
                       on_done: Callable[[RequestRecord], None] | None = None,
                       clock: Clock = time.monotonic) -> list[RequestRecord]:
    """Send every request at its arrival offset through ``client.generate`` (an
    ``AsyncPdserveClient`` or anything with its signature); records in input order."""
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    t0 = clock()

    async def send(req: WorkloadRequest) -> RequestRecord:
        send_time = clock()
        chunks, error = await collect(
            client.generate(req.prompt_token_ids, **request_kwargs(req)), clock)
        return build_record(req, send_time, chunks, error)

    async def one(req: WorkloadRequest) -> RequestRecord:
        await asyncio.sleep(max(0.0, t0 + req.arrival_s - clock()))
        if limit is None:
            rec = await send(req)
        else:
            async with limit:
                rec = await send(req)
        if on_done is not None:
            on_done(rec)
        return rec

    return list(await asyncio.gather(*(one(r) for r in requests)))


@dataclass(frozen=True)
class BenchRun:
    records: list[RequestRecord]
    duration_s: float  # first send .. last request end, as vllm bench serve


async def run_bench(addr: str, requests: Sequence[WorkloadRequest], *,
                    max_concurrency: int | None = None, token: str | None = None,
                    tls_ca: str | None = None, timeout: float | None = None,
                    progress: bool = False, desc: str = "requests") -> BenchRun:
    """Run ``requests`` against the server at ``addr`` (a tqdm bar with ``progress``)."""
    from tqdm import tqdm

    bar = tqdm(total=len(requests), desc=desc, unit="req", disable=not progress, leave=False)
    try:
        async with AsyncPdserveClient(addr, token=token, tls_ca=tls_ca, timeout=timeout) as c:
            t0 = time.monotonic()
            records = await run_requests(c, requests, max_concurrency=max_concurrency,
                                         on_done=lambda _: bar.update(1))
    finally:
        bar.close()
    return BenchRun(records, duration_of(records, t0))


def duration_of(records: Sequence[RequestRecord], t0: float) -> float:
    """First send (or ``t0``) to the last token or end time of any request."""
    ends = [r.end_time if r.end_time is not None else (r.token_times or (r.send_time,))[-1]
            for r in records]
    start = min((r.send_time for r in records), default=t0)
    return max(max(ends, default=start) - start, 1e-9)


async def server_model_info(addr: str, *, token: str | None = None, tls_ca: str | None = None,
                            timeout: float = 30.0) -> tuple[int, int]:
    """(vocab_size, max_model_len) of the served model, to size the workload."""
    async with AsyncPdserveClient(addr, token=token, tls_ca=tls_ca, timeout=timeout) as c:
        info = await c.model_info()
    return int(info.vocab_size), int(info.max_model_len)
