"""The bench client: drive a running pdserve over gRPC or its OpenAI-compatible HTTP API
with a timed workload (``backend="grpc" | "openai"``).

Each request is sent at its workload arrival offset (Poisson/gamma from
``bench.workload``), at most ``max_concurrency`` at a time (later arrivals wait for a
slot, as ``vllm bench serve --max-concurrency``; the send time is when the RPC starts).
Every streamed chunk is stamped with ``time.monotonic()`` on arrival and each of its
tokens gets that time; the final chunk's usage gives the server-side phase times. The
result is the same :class:`bench.metrics.RequestRecord` that ``bench.router_driver``
builds in-process, so both feed ``compute_metrics``. The ``openai`` backend talks to
``/v1/completions`` with the official ``openai`` client (streamed, token-id prompts,
``return_token_ids`` so tokens are counted exactly; server-side phase times are not
part of that API, so they stay empty).

    run = asyncio.run(run_bench("127.0.0.1:50051", build_workload(spec), max_concurrency=8))
    print(compute_metrics(run.records, run.duration_s).format())
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import grpc
import openai

from bench.arrivals import Clock, send_at_arrivals
from bench.records import RequestRecord, phase_times
from bench.workload import WorkloadRequest
from cluster.grpc.client import AsyncPdserveClient, Chunk
from cluster.router.types import Usage

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
    return RequestRecord(
        req.request_id, req.prompt_len, send_time, times,
        end_time=chunks[-1][0] if chunks else None, tenant=req.tenant, kind=req.kind,
        success=not error, finish_reason=reason, error=error,
        **phase_times(last.usage if last is not None else None))


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
    except openai.APIError as e:
        status = getattr(e, "status_code", None)
        return chunks, f"HTTP {status or 'error'}: {e.message}"
    return chunks, ""


class OpenAIBenchClient:
    """``generate()`` like AsyncPdserveClient's, over ``/v1/completions``: yields Chunks
    whose last one carries the finish reason and the token counts (include_usage)."""

    def __init__(self, base_url: str, token: str | None = None, timeout: float | None = None,
                 tls_ca: str | None = None):
        http = None
        if tls_ca:  # trust this CA for an https:// base URL (server.tls_cert)
            import ssl

            http = openai.DefaultAsyncHttpxClient(
                verify=ssl.create_default_context(cafile=tls_ca))
        self._client = openai.AsyncOpenAI(base_url=base_url, api_key=token or "no-token",
                                          timeout=timeout or 600.0, max_retries=0,
                                          http_client=http)
        self.model: str | None = None

    async def __aenter__(self) -> OpenAIBenchClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self._client.close()

    async def model_info(self) -> tuple[int, int]:
        """(vocab_size, max_model_len) from the served model's card; sets ``model``."""
        card = (await self._client.models.list()).data[0]
        self.model = card.id
        extra = card.model_extra or {}
        return int(extra["vocab_size"]), int(extra["max_model_len"])

    async def generate(self, prompt, *, request_id: str = "", max_tokens: int | None = None,
                       temperature: float | None = None, ignore_eos: bool | None = None,
                       tenant: str = "", priority: int = 0,
                       ttft_deadline_ms: float | None = None) -> AsyncIterator[Chunk]:
        if self.model is None:
            await self.model_info()
        extra = {"return_token_ids": True, "priority": priority}
        for name, value in (("ignore_eos", ignore_eos), ("ttft_deadline_ms", ttft_deadline_ms)):
            if value is not None:
                extra[name] = value
        headers = {"x-request-id": request_id} if request_id else {}
        if tenant:
            headers["x-pdserve-tenant"] = tenant
        stream = await self._client.completions.create(
            model=self.model, prompt=list(prompt), max_tokens=max_tokens,
            temperature=temperature, stream=True, stream_options={"include_usage": True},
            extra_body=extra, extra_headers=headers)
        async with stream:  # closes the HTTP response however the consumer stops
            last: Chunk | None = None  # the finish chunk waits for the usage chunk after it
            async for event in stream:
                if event.usage is not None and last is not None:
                    u = event.usage
                    last = Chunk(last.request_id, last.token_ids, last.text,
                                 last.finish_reason, Usage(prompt_tokens=u.prompt_tokens,
                                                           completion_tokens=u.completion_tokens))
                    continue
                if not event.choices:
                    continue
                c = event.choices[0]
                chunk = Chunk(request_id or event.id,
                              tuple(getattr(c, "token_ids", None) or ()), c.text,
                              c.finish_reason)
                if c.finish_reason is not None:
                    last = chunk
                else:
                    yield chunk
        if last is not None:
            yield last


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
    async def send(req: WorkloadRequest) -> RequestRecord:
        send_time = clock()
        chunks, error = await collect(
            client.generate(req.prompt_token_ids, **request_kwargs(req)), clock)
        return build_record(req, send_time, chunks, error)

    return await send_at_arrivals(requests, send, max_concurrency=max_concurrency,
                                  on_done=on_done, clock=clock)


@dataclass(frozen=True)
class BenchRun:
    records: list[RequestRecord]
    duration_s: float  # first send .. last request end, as vllm bench serve


def make_client(backend: str, addr: str, *, token: str | None = None,
                tls_ca: str | None = None, timeout: float | None = None):
    """The async client of a front door: ``addr`` is HOST:PORT for grpc, the base URL
    (``http://HOST:PORT/v1``) for openai."""
    if backend == "grpc":
        return AsyncPdserveClient(addr, token=token, tls_ca=tls_ca, timeout=timeout)
    if backend == "openai":
        return OpenAIBenchClient(addr, token=token, timeout=timeout, tls_ca=tls_ca)
    raise ValueError(f"backend must be 'grpc' or 'openai', got {backend!r}")


async def run_bench(addr: str, requests: Sequence[WorkloadRequest], *,
                    max_concurrency: int | None = None, token: str | None = None,
                    tls_ca: str | None = None, timeout: float | None = None,
                    progress: bool = False, desc: str = "requests",
                    backend: str = "grpc") -> BenchRun:
    """Run ``requests`` against the server at ``addr`` (a tqdm bar with ``progress``)."""
    from tqdm import tqdm

    bar = tqdm(total=len(requests), desc=desc, unit="req", disable=not progress, leave=False)
    try:
        async with make_client(backend, addr, token=token, tls_ca=tls_ca,
                               timeout=timeout) as c:
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
                            timeout: float = 30.0, backend: str = "grpc") -> tuple[int, int]:
    """(vocab_size, max_model_len) of the served model, to size the workload."""
    async with make_client(backend, addr, token=token, tls_ca=tls_ca, timeout=timeout) as c:
        info = await c.model_info()
    if backend == "openai":
        return info
    return int(info.vocab_size), int(info.max_model_len)
