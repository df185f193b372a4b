"""The `pdserve.v1.Generation` servicer: validation at the door, streaming, cancellation.

It talks only to a `RouterAPI`. Every request that passes validation holds its id in
`ServingState.active` (as a `Call`) until it ends; the id is released *before* the client
can see the end (the last response, or the error status), so a client may reuse it at
once. Whatever way a request ends (finished, client cancel, deadline, error), the
`finally` aborts it in the router unless the router already ended it, so a vanished
client never leaves work or KV blocks behind. Text prompts are size-checked first and
tokenized off the event loop. After the first message, a Router's stream writes its own
common messages (cluster/router/delta_stream.py StreamWriter); the handler writes the rest.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from functools import partial

import grpc

from cluster.grpc.convert import (
    FINISH_TO_PROTO,
    logprobs_to_proto,
    prompt_logprobs_to_proto,
    stats_to_proto,
    usage_to_proto,
)
from cluster.grpc.intake import DEFAULT_MAX_PROMPT_BYTES, PromptIntake
from cluster.grpc.wire import common_message, id_field
from cluster.router.delta_stream import StreamWriter
from cluster.router.types import ErrorCode, GenerateSpec, RouterAPI, RouterError
from engine.detokenize import IncrementalDetokenizer
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

STATUS_OF = {code: getattr(grpc.StatusCode, code.value) for code in ErrorCode}
REAP_WAIT_S = 5.0  # how long a reused id waits for its cancelled call to be freed


@dataclass(eq=False)
class Call:
    """One Generate call holding its request id."""

    rid: str
    context: grpc.aio.ServicerContext | None = None
    aborted: bool = False  # by Abort RPC or drain: ends as finish_reason "abort"
    expired: bool = False  # past request_timeout_s
    ended: bool = False  # the router is done with it (nothing to abort there)
    closed: asyncio.Event = field(default_factory=asyncio.Event)  # its handler finished


@dataclass
class ServingState:
    """Shared by the servicer and the server's lifecycle (drain, health)."""

    draining: bool = False
    active: dict[str, Call] = field(default_factory=dict)

    def release(self, call: Call) -> None:
        """Free `call`'s request id (a no-op once another call holds it)."""
        if self.active.get(call.rid) is call:
            del self.active[call.rid]

    def mark_aborted(self, rid: str) -> Call | None:
        """Abort RPC / drain: the call ends with finish_reason "abort"."""
        call = self.active.get(rid)
        if call is not None:
            call.aborted = True
        return call


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, router: RouterAPI, state: ServingState, *,
                 request_timeout_s: float = 600.0, max_prompt_tokens: int | None = None,
                 max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES,
                 intake: PromptIntake | None = None):
        self.router = router
        self.state = state
        self.request_timeout_s = request_timeout_s
        self.intake = intake or PromptIntake(router, max_prompt_tokens=max_prompt_tokens,
                                             max_prompt_bytes=max_prompt_bytes)
        self._tasks: set[asyncio.Task] = set()
        self.peers = None  # cluster.serve.front_doors.Peers: the other front doors of the port

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        call, spec = await self._admit(request, context)
        rid = call.rid
        # The deadline aborts the request in the router, whose stream then ends (final
        # "abort" delta or RouterError); no wait_for around the stream, whose cancellation
        # can be swallowed when a token lands at the same moment.
        timer = asyncio.get_running_loop().call_later(self.request_timeout_s, self._expire,
                                                      call)
        status: tuple[grpc.StatusCode, str] | None = None  # the error to end with
        stream = None
        detok = None  # a backend that does not detokenize (LocalBackend) gets one
        writer: StreamWriter | None = None  # writes the common messages after the first
        try:
            stream = self.router.generate(spec)
            async for delta in stream:
                if call.expired:
                    break
                finished = delta.finished
                text = delta.text
                if text is None:
                    if detok is None:
                        detok = IncrementalDetokenizer(self.router.detokenize)
                    text = detok.push(delta.token_ids, final=finished)
                if writer is not None:
                    await writer.pause()  # (its write in flight is out first)
                if not finished and delta.logprobs is None and delta.prompt_logprobs is None:
                    yield pb.GenerateResponse(request_id=rid, token_ids=delta.token_ids,
                                              text=text)  # the common message
                    if writer is None:
                        writer = self._writer(rid, context)
                    else:
                        writer.resume()
                    continue
                if finished:
                    call.ended = True
                    self.state.release(call)  # free before the client sees the end
                yield _response(rid, delta, text)
                if finished:
                    return
                if writer is not None:
                    writer.resume()
            if not call.expired:
                log.error("router ended request %s without a final delta", rid)
            status = self._expired_status(call) or (
                grpc.StatusCode.INTERNAL, "backend ended the stream early")
        except RouterError as e:
            call.ended = True  # the router is done with it
            if writer is not None:
                await writer.pause()
            if e.code == ErrorCode.CANCELLED and call.aborted and not call.expired:
                # Abort RPC / drain: end like a backend that reports finish_reason "abort".
                self.state.release(call)
                text = detok.push((), final=True) if detok is not None else ""
                yield pb.GenerateResponse(request_id=rid, text=text,
                                          finish_reason=pb.FINISH_REASON_ABORT)
                return
            status = self._expired_status(call)
            if status is None:
                log.info("request %s failed: %s", rid, e)
                status = (STATUS_OF[e.code], e.message)
        except Exception:  # a backend bug must not take the server down
            log.exception("request %s failed in the backend", rid)
            status = (grpc.StatusCode.INTERNAL, "internal error in the backend")
        finally:
            timer.cancel()
            if writer is not None:
                writer.close()
            if not call.ended and not call.aborted:  # client cancel or error: free it in
                await self._abort_quietly(rid)  # the backend (Abort RPC / drain already did)
            self.state.release(call)
            if stream is not None:
                await _aclose(stream)
            call.closed.set()
        # Outside the try: context.abort raises, and nothing may catch that and abort twice.
        if writer is not None:
            await writer.pause()
        await context.abort(*status)

    def _writer(self, rid: str, context) -> StreamWriter | None:
        """A writer for the request's common messages, when its router hands them over
        (RouterAPI.stream) and the context can write."""
        stream = self.router.stream(rid)
        write = getattr(context, "write", None)
        if stream is None or stream.sink is not None or write is None:
            return None
        return StreamWriter(stream, write, partial(common_message, id_field(rid)))

    def _expired_status(self, call: Call) -> tuple[grpc.StatusCode, str] | None:
        if not call.expired:
            return None
        log.info("request %s exceeded request_timeout_s=%g", call.rid, self.request_timeout_s)
        return (grpc.StatusCode.DEADLINE_EXCEEDED,
                f"request exceeded the server's request_timeout_s ({self.request_timeout_s:g} s)")

    async def _admit(self, request: pb.GenerateRequest,
                     context: grpc.aio.ServicerContext) -> tuple[Call, GenerateSpec]:
        """Validate at the door (UNAVAILABLE / INVALID_ARGUMENT / ALREADY_EXISTS) and take
        the request id."""
        if self.state.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "server is draining; retry on another replica")
        rid = request.request_id or f"req-{uuid.uuid4().hex[:16]}"
        try:
            spec = await self._spec(request, rid)
        except ValueError as e:
            log.info("rejected request %s (%s): %s", rid, context.peer(), e)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        await self._reap_cancelled(rid)
        if rid in self.state.active:
            log.info("rejected request %s: request_id already in flight", rid)
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"request_id {rid!r} is already in flight")
        call = Call(rid, context)
        self.state.active[rid] = call
        return call, spec

    async def _spec(self, request: pb.GenerateRequest, rid: str) -> GenerateSpec:
        return await self.intake.spec(request, rid)

    async def _reap_cancelled(self, rid: str) -> None:
        """A call whose client cancelled it has ended for that client, though its handler
        may still be freeing it in the backend: wait for that before judging the id."""
        old = self.state.active.get(rid)
        if old is not None and old.context is not None and old.context.cancelled():
            await asyncio.wait({asyncio.ensure_future(old.closed.wait())}, timeout=REAP_WAIT_S)

    def _expire(self, call: Call) -> None:
        if self.state.active.get(call.rid) is call:
            call.expired = True
            self._spawn(self._abort_quietly(call.rid))

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
        rid = request.request_id
        if not rid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")
        found = await self.abort_local(rid)
        if not found and self.peers is not None:  # its stream may be on another front door
            found = await self.peers.abort(rid)
        return pb.AbortResponse(found=found)

    async def abort_local(self, rid: str) -> bool:
        """Abort `rid` if this front door holds it; whether it did."""
        call = self.state.mark_aborted(rid)
        found = bool(await self.router.abort(rid))
        if call is not None:  # the request has ended: its id is free when Abort returns
            self.state.release(call)
        return found or call is not None

    async def GetStats(self, request: pb.GetStatsRequest,
                       context: grpc.aio.ServicerContext) -> pb.GetStatsResponse:
        try:
            stats = await self.router.stats()
        except RouterError as e:
            await context.abort(STATUS_OF[e.code], e.message)
        if self.peers is not None:  # every front door's requests
            inflight, queued = await self.peers.totals()
            stats = replace(stats, num_inflight=stats.num_inflight + inflight,
                            router_queue_depth=stats.router_queue_depth + queued)
        return stats_to_proto(stats, serving=stats.serving and not self.state.draining)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        return pb.ModelInfo(vocab_size=self.router.vocab_size,
                            max_model_len=self.router.max_model_len)


def _response(rid: str, delta, text: str) -> pb.GenerateResponse:
    """A message with a finish, usage or log-probs."""
    finished = delta.finished
    return pb.GenerateResponse(
        request_id=rid, token_ids=delta.token_ids, text=text,
        finish_reason=FINISH_TO_PROTO[delta.finish_reason if finished else None],
        usage=usage_to_proto(delta.usage) if finished and delta.usage else None,
        logprobs=logprobs_to_proto(delta.logprobs) if delta.logprobs else None,
        prompt_logprobs=prompt_logprobs_to_proto(delta.prompt_logprobs)
        if delta.prompt_logprobs else None)


async def _aclose(stream) -> None:
    close = getattr(stream, "aclose", None)
    if close is None:
        return
    try:
        await close()
    except (Exception, asyncio.CancelledError):  # already closed or cancelled mid-close
        log.debug("closing a router stream failed", exc_info=True)
