"""One OpenAI request's run against the router: tokens -> text pieces, stop strings, end.

`OpenAIRun.pieces()` turns the router's TokenDeltas into `Piece`s of released text (UTF-8
safe through IncrementalDetokenizer, stop strings cut through StopStrings). A stop string
ends the run early: the router request is then aborted, which frees its KV on both pools.
The run is registered in the server's ServingState like a gRPC stream, so draining waits
for it and aborts it (finish_reason "abort"), and `request_timeout_s` expires it.
`close()` is idempotent and must run however the run ends (finished, stop string, error,
client gone): it forgets the run and aborts the router request unless it finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from cluster.grpc.servicer import Call, ServingState
from cluster.http.protocol import OpenAIError
from cluster.http.stop_strings import StopStrings
from cluster.router.types import ErrorCode, GenerateSpec, RouterAPI, RouterError, Usage
from engine.detokenize import IncrementalDetokenizer
from engine.logprobs import PromptLogprobs, TokenLogprobs

log = logging.getLogger(__name__)

HTTP_STATUS = {
    ErrorCode.INVALID_ARGUMENT: 400, ErrorCode.RESOURCE_EXHAUSTED: 429,
    ErrorCode.UNAVAILABLE: 503, ErrorCode.CANCELLED: 499, ErrorCode.DEADLINE_EXCEEDED: 504,
    ErrorCode.ALREADY_EXISTS: 409, ErrorCode.INTERNAL: 500,
}


def http_error(e: RouterError) -> OpenAIError:
    return OpenAIError(HTTP_STATUS[e.code], e.message, code=e.code.value.lower())


@dataclass(frozen=True)
class Piece:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" on the last
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    logprobs: tuple[TokenLogprobs, ...] = ()  # of token_ids, when the request asked


class OpenAIRun:
    def __init__(self, router: RouterAPI, state: ServingState, spec: GenerateSpec, *,
                 stops: tuple[str, ...] = (), include_stop: bool = False,
                 request_timeout_s: float = 600.0):
        self.router, self.state, self.spec = router, state, spec
        self.rid = spec.request_id
        self.stops = StopStrings(stops, include=include_stop)
        self.detok = IncrementalDetokenizer(router.detokenize)
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] = []  # of token_ids (SamplingParams.logprobs)
        self.prompt_logprobs: PromptLogprobs | None = None  # from the first delta
        self.router_usage: Usage | None = None
        self.finish_reason: str | None = None
        self._router_done = False  # the router ended the request itself
        self._closed = False
        self._stream = None
        self._tasks: set[asyncio.Task] = set()
        self.call = Call(self.rid)  # holds the request id like a gRPC stream
        state.active[self.rid] = self.call
        self._timer = asyncio.get_running_loop().call_later(request_timeout_s, self._expire)
        self._timeout_s = request_timeout_s

    async def pieces(self) -> AsyncIterator[Piece]:
        """Released text as it arrives; the last piece has finish_reason set.

        Raises OpenAIError for a router error (or an expired run) with its HTTP status."""
        self._stream = self.router.generate(self.spec)
        try:
            async for delta in self._stream:
                ids, lps = tuple(delta.token_ids), tuple(delta.logprobs or ())
                self.token_ids.extend(ids)
                self.logprobs.extend(lps)
                if delta.prompt_logprobs is not None:
                    self.prompt_logprobs = delta.prompt_logprobs
                piece = delta.text  # None: a backend that does not detokenize
                if piece is None:
                    piece = self.detok.push(ids, final=delta.finished)
                text = self.stops.push(piece, final=delta.finished)
                if self.stops.matched is not None:  # end it now: free its KV at once
                    self._router_done = True
                    self._spawn(self._abort())
                    yield self._end(Piece(text, ids, "stop", self.stops.matched, lps))
                    return
                if delta.finished:
                    self._router_done = True
                    self.router_usage = delta.usage
                    if self.call.expired:
                        raise self._expired_error()
                    yield self._end(Piece(text, ids, delta.finish_reason,
                                          self._stop_token(delta.finish_reason), lps))
                    return
                yield Piece(text, ids, logprobs=lps)
        except RouterError as e:
            self._router_done = True
            if self.call.expired:
                raise self._expired_error() from e
            if e.code == ErrorCode.CANCELLED and self.call.aborted:
                # drain / shutdown: end like a backend reporting finish_reason "abort"
                yield self._end(Piece(self.stops.push(self.detok.push((), final=True),
                                                      final=True), (), "abort"))
                return
            raise http_error(e) from e
        log.error("router ended request %s without a final delta", self.rid)
        raise OpenAIError(500, "the backend ended the stream early")

    def _end(self, piece: Piece) -> Piece:
        self.finish_reason = piece.finish_reason
        return piece

    def _stop_token(self, reason: str | None) -> int | None:
        last = self.token_ids[-1] if self.token_ids else None
        if reason == "stop" and last is not None and last in self.spec.sampling.stop_token_ids:
            return last
        return None

    def _expired_error(self) -> OpenAIError:
        return OpenAIError(504, f"request exceeded the server's request_timeout_s "
                           f"({self._timeout_s:g} s)", code="deadline_exceeded")

    @property
    def usage(self) -> dict:
        prompt, completion = len(self.spec.prompt_token_ids), len(self.token_ids)
        body = {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}
        if self.router_usage is not None:
            body["prompt_tokens_details"] = {
                "cached_tokens": self.router_usage.cached_prompt_tokens}
        return body

    def _expire(self) -> None:
        if not self._closed:
            self.call.expired = True
            self._spawn(self._abort())

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _abort(self) -> None:
        try:
            await asyncio.shield(self.router.abort(self.rid))
        except asyncio.CancelledError:
            pass  # the abort keeps running under the shield
        except Exception:
            log.exception("abort of %s failed", self.rid)

    async def close(self) -> None:
        """Forget the run; abort it in the router unless the router finished it."""
        if self._closed:
            return
        self._closed = True
        self._timer.cancel()
        try:
            if not self._router_done:  # stop string, client gone or error: free its KV
                await self._abort()
        finally:
            self.state.release(self.call)  # the id is free once the router let go of it
            self.call.closed.set()
        if self._stream is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await self._stream.aclose()
