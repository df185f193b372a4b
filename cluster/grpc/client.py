"""A small client for the pdserve gRPC API (used by the CLI, tests and benchmarks).

    with PdserveClient("127.0.0.1:50051", token=None, tls_ca=None) as c:
        for chunk in c.generate("Once upon a time", max_tokens=32, temperature=0):
            print(chunk.text, end="", flush=True)
        print(chunk.usage)

`AsyncPdserveClient` has the same methods as coroutines / an async iterator. Sampling
arguments left as None are not sent, so the server applies its documented defaults.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.grpc.auth import auth_metadata, channel_credentials
from cluster.grpc.convert import (
    FINISH_FROM_PROTO,
    build_request,
    logprobs_from_proto,
    stats_from_proto,
    usage_from_proto,
)
from cluster.router.types import ClusterStats, Usage
from engine.logprobs import TokenLogprobs
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc


@dataclass(frozen=True)
class Chunk:
    """One streamed response: new tokens and text; the last has finish_reason and usage."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    usage: Usage | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()  # with logprobs=N: one per token id
    # with prompt_logprobs=N, on the first chunk: prompt tokens 1, 2, ... (the first has none)
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def chunk_from_proto(r: pb.GenerateResponse) -> Chunk:
    return Chunk(r.request_id, tuple(r.token_ids), r.text, FINISH_FROM_PROTO[r.finish_reason],
                 usage_from_proto(r.usage) if r.HasField("usage") else None,
                 logprobs_from_proto(r.logprobs), logprobs_from_proto(r.prompt_logprobs))


def _make_channel(addr: str, tls_ca: str | None, tls: bool, module) -> Any:
    options = [("grpc.max_receive_message_length", 64 << 20)]
    if tls or tls_ca:
        return module.secure_channel(addr, channel_credentials(tls_ca), options=options)
    return module.insecure_channel(addr, options=options)


class GenerateStream:
    """Iterator over a Generate call's chunks; `cancel()` ends it (the server aborts)."""

    def __init__(self, call):
        self._call = call

    def __iter__(self) -> Iterator[Chunk]:
        for r in self._call:
            yield chunk_from_proto(r)

    def cancel(self) -> None:
        self._call.cancel()


class PdserveClient:
    """Synchronous client; `tls_ca` (a PEM file) or `tls=True` (system roots) turn on TLS."""

    def __init__(self, addr: str, token: str | None = None, tls_ca: str | None = None, *,
                 tls: bool = False, timeout: float | None = None):
        self.addr = addr
        self.timeout = timeout
        self._metadata = auth_metadata(token)
        self._channel = _make_channel(addr, tls_ca, tls, grpc)
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def generate(self, prompt: str | Sequence[int], *, timeout: float | None = None,
                 **kw: Any) -> GenerateStream:
        """Stream a completion; kw: request_id, temperature, top_p, top_k, max_tokens, seed,
        stop_token_ids, ignore_eos, tenant, priority, ttft_deadline_ms, logprobs,
        prompt_logprobs."""
        call = self._stub.Generate(build_request(prompt, **kw), metadata=self._metadata,
                                   timeout=timeout or self.timeout)
        return GenerateStream(call)

    def complete(self, prompt: str | Sequence[int], **kw: Any) -> Chunk:
        """Run a whole request; one Chunk with all tokens, all text and the usage."""
        return _merge(list(self.generate(prompt, **kw)))

    def abort(self, request_id: str) -> bool:
        return self._stub.Abort(pb.AbortRequest(request_id=request_id),
                                metadata=self._metadata, timeout=self.timeout).found

    def stats(self) -> ClusterStats:
        return stats_from_proto(self._stub.GetStats(pb.GetStatsRequest(),
                                                    metadata=self._metadata, timeout=self.timeout))

    def model_info(self) -> pb.ModelInfo:
        return self._stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=self._metadata,
                                       timeout=self.timeout)

    def health(self, service: str = "") -> str:
        """'SERVING' | 'NOT_SERVING' | 'SERVICE_UNKNOWN' | 'UNKNOWN' (no token needed)."""
        r = self._health.Check(health_pb2.HealthCheckRequest(service=service),
                               timeout=self.timeout or 10.0)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> PdserveClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncPdserveClient:
    """grpc.aio client with the same methods; create it inside the event loop that uses it."""

    def __init__(self, addr: str, token: str | None = None, tls_ca: str | None = None, *,
                 tls: bool = False, timeout: float | None = None):
        self.addr = addr
        self.timeout = timeout
        self._metadata = auth_metadata(token)
        self._channel = _make_channel(addr, tls_ca, tls, grpc.aio)
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def generate(self, prompt: str | Sequence[int], *, timeout: float | None = None,
                       **kw: Any) -> AsyncIterator[Chunk]:
        """Async iterator of chunks; cancelling the consuming task cancels the RPC."""
        call = self._stub.Generate(build_request(prompt, **kw), metadata=self._metadata,
                                   timeout=timeout or self.timeout)
        try:
            async for r in call:
                yield chunk_from_proto(r)
        finally:
            call.cancel()  # no-op when the call already ended

    async def complete(self, prompt: str | Sequence[int], **kw: Any) -> Chunk:
        return _merge([c async for c in self.generate(prompt, **kw)])

    async def abort(self, request_id: str) -> bool:
        r = await self._stub.Abort(pb.AbortRequest(request_id=request_id),
                                   metadata=self._metadata, timeout=self.timeout)
        return r.found

    async def stats(self) -> ClusterStats:
        r = await self._stub.GetStats(pb.GetStatsRequest(), metadata=self._metadata,
                                      timeout=self.timeout)
        return stats_from_proto(r)

    async def model_info(self) -> pb.ModelInfo:
        return await self._stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=self._metadata,
                                             timeout=self.timeout)

    async def health(self, service: str = "") -> str:
        r = await self._health.Check(health_pb2.HealthCheckRequest(service=service),
                                     timeout=self.timeout or 10.0)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncPdserveClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def _merge(chunks: list[Chunk]) -> Chunk:
    if not chunks:
        raise RuntimeError("the server sent no response")
    last = chunks[-1]
    return Chunk(last.request_id, tuple(t for c in chunks for t in c.token_ids),
                 "".join(c.text for c in chunks), last.finish_reason, last.usage,
                 tuple(lp for c in chunks for lp in c.logprobs), chunks[0].prompt_logprobs)
