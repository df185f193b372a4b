"""The `pdserve.v1.Generation` servicer: validation at the door, streaming, cancellation.

It talks only to a `RouterAPI`. Every request that passes validation is in `active`
until its stream ends; whatever way it ends (finished, client cancel, deadline, error),
the `finally` aborts it in the router unless the router already finished it, so a
vanished client never leaves work or KV blocks behind.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from cluster.convert import FINISH_TO_PROTO, spec_from_request, stats_to_proto, usage_to_proto
from cluster.detokenize import IncrementalDetokenizer
from cluster.types import ErrorCode, GenerateSpec, RouterAPI, RouterError
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

STATUS_OF = {code: getattr(grpc.StatusCode, code.value) for code in ErrorCode}


@dataclass
class ServingState:
    """Shared by the servicer and the server's lifecycle (drain, health)."""

    draining: bool = False
    active: dict[str, asyncio.Task | None] = field(default_factory=dict)
    aborted: set[str] = field(default_factory=set)  # by Abort RPC or drain: end as "abort"
    expired: set[str] = field(default_factory=set)  # past request_timeout_s


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, router: RouterAPI, state: ServingState, *,
                 request_timeout_s: float = 600.0, max_prompt_tokens: int | None = None):
        self.router = router
        self.state = state
        self.request_timeout_s = request_timeout_s
        self.max_prompt_tokens = max_prompt_tokens
        self._tasks: set[asyncio.Task] = set()

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        spec = await self._admit(request, context)
        rid = spec.request_id
        state = self.state
        state.active[rid] = asyncio.current_task()
        # The deadline aborts the request in the router, whose stream then ends (final
        # "abort" delta or RouterError); no wait_for around the stream, whose cancellation
        # can be swallowed when a token lands at the same moment.
        timer = asyncio.get_running_loop().call_later(self.request_timeout_s, self._expire, rid)
        finished = False
        stream = None
        detok = IncrementalDetokenizer(self.router.detokenize)
        try:
            stream = self.router.generate(spec)
            async for delta in stream:
                finished = delta.finished
                if rid in state.expired:
                    break
                yield pb.GenerateResponse(
                    request_id=rid, token_ids=delta.token_ids,
                    text=detok.push(delta.token_ids, final=finished),
                    finish_reason=FINISH_TO_PROTO[delta.finish_reason if finished else None],
                    usage=usage_to_proto(delta.usage) if finished and delta.usage else None)
                if finished:
                    return
            if rid in state.expired:
                raise RouterError(ErrorCode.DEADLINE_EXCEEDED, "")
            log.error("router ended request %s without a final delta", rid)
            await context.abort(grpc.StatusCode.INTERNAL, "backend ended the stream early")
        except RouterError as e:
            finished = True  # the router is done with it
            if rid in state.expired:
                log.info("request %s exceeded request_timeout_s=%g", rid, self.request_timeout_s)
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    "request exceeded the server's request_timeout_s "
                                    f"({self.request_timeout_s:g} s)")
            if e.code == ErrorCode.CANCELLED and rid in state.aborted:
                # Abort RPC / drain: end like a backend that reports finish_reason "abort".
                yield pb.GenerateResponse(request_id=rid, text=detok.push((), final=True),
                                          finish_reason=pb.FINISH_REASON_ABORT)
                return
            log.info("request %s failed: %s", rid, e)
            await context.abort(STATUS_OF[e.code], e.message)
        except Exception:  # a backend bug must not take the server down
            log.exception("request %s failed in the backend", rid)
            await context.abort(grpc.StatusCode.INTERNAL, "internal error in the backend")
        finally:
            timer.cancel()
            state.active.pop(rid, None)
            state.expired.discard(rid)
            state.aborted.discard(rid)
            if not finished:  # client cancel or error: free the request in the backend
                await self._abort_quietly(rid)
            if stream is not None:
                await _aclose(stream)

    async def _admit(self, request: pb.GenerateRequest,
                     context: grpc.aio.ServicerContext) -> GenerateSpec:
        """Validate at the door: UNAVAILABLE / INVALID_ARGUMENT / ALREADY_EXISTS."""
        if self.state.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "server is draining; retry on another replica")
        rid = request.request_id or f"req-{uuid.uuid4().hex[:16]}"
        try:
            spec = spec_from_request(
                request, request_id=rid, tokenize=self.router.tokenize,
                vocab_size=self.router.vocab_size, max_model_len=self.router.max_model_len,
                max_prompt_tokens=self.max_prompt_tokens)
        except ValueError as e:
            log.info("rejected request %s (%s): %s", rid, context.peer(), e)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if rid in self.state.active:
            log.info("rejected request %s: request_id already in flight", rid)
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"request_id {rid!r} is already in flight")
        return spec

    def _expire(self, rid: str) -> None:
        if rid in self.state.active:
            self.state.expired.add(rid)
            self._spawn(self._abort_quietly(rid))

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)  # keep a reference until done
        task.add_done_callback(self._tasks.discard)

    async def _abort_quietly(self, rid: str) -> None:
        try:
            await asyncio.shield(self.router.abort(rid))
        except asyncio.CancelledError:
            pass  # the abort itself keeps running under the shield
        except Exception:  # never let cleanup mask the RPC's real outcome
            log.exception("abort of %s failed", rid)

    async def Abort(self, request: pb.AbortRequest,
                    context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")
        if request.request_id in self.state.active:
            self.state.aborted.add(request.request_id)
        return pb.AbortResponse(found=bool(await self.router.abort(request.request_id)))

    async def GetStats(self, request: pb.GetStatsRequest,
                       context: grpc.aio.ServicerContext) -> pb.GetStatsResponse:
        try:
            stats = await self.router.stats()
        except RouterError as e:
            await context.abort(STATUS_OF[e.code], e.message)
        return stats_to_proto(stats, serving=stats.serving and not self.state.draining)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        return pb.ModelInfo(vocab_size=self.router.vocab_size,
                            max_model_len=self.router.max_model_len)


async def _aclose(stream) -> None:
    close = getattr(stream, "aclose", None)
    if close is None:
        return
    try:
        await close()
    except (Exception, asyncio.CancelledError):  # already closed or cancelled mid-close
        log.debug("closing a router stream failed", exc_info=True)
