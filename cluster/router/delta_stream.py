"""DeltaStream: one request's outgoing deltas between the router and its front door.

The router puts TokenDeltas (or a RouterError) with `put_nowait`, as into the
asyncio.Queue it replaces; the front door's `get()` returns everything put since its
last get as one delta (tokens and text concatenated, the finish and usage of the last).
Log-probs (when asked for) are concatenated as the tokens are; the prompt's ride with the
first delta. So a client that reads slower than tokens arrive gets fewer, larger messages
and costs nothing extra, and nothing is lost; a reader waits on one Future per wait, never
one per token. Tokens put before an error are handed out before it.

A front door that writes the common deltas itself sets `sink`: a put of tokens with
their text (no finish, error or log-probs) then calls `sink()` instead of waking the
reader, and the sink takes them with `take_common()` (at once, or when its write in
flight completes); the rest still wakes the reader, whose `get()` returns whatever the
sink has not taken along with it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from cluster.router.types import CommonStream, RouterError, TokenDelta
from engine.logprobs import PromptLogprobs, TokenLogprobs

log = logging.getLogger(__name__)


class DeltaStream:
    __slots__ = ("request_id", "_ids", "_texts", "_lps", "_prompt_lps", "_last", "_error",
                 "_waiter", "sink")

    def __init__(self, request_id: str):
        self.request_id = request_id
        self._ids: list[int] = []
        self._texts: list[str] | None = None  # None: deltas without text
        self._lps: list[TokenLogprobs] | None = None  # None: deltas without log-probs
        self._prompt_lps: PromptLogprobs | None = None
        self._last: TokenDelta | None = None  # the finishing delta, once put
        self._error: RouterError | None = None
        self._waiter: asyncio.Future | None = None
        self.sink: Callable[[], None] | None = None

    def __len__(self) -> int:
        """Tokens waiting to be read."""
        return len(self._ids)

    def empty(self) -> bool:
        return not (self._ids or self._last or self._error)

    def put_nowait(self, item: TokenDelta | RouterError) -> None:
        if isinstance(item, RouterError):
            if self._error is None:
                self._error = item
            self._wake()
        else:
            self.put(item.token_ids, item.text, item if item.finished else None,
                     item.logprobs, item.prompt_logprobs)

    def put(self, token_ids, text: str | None, last: TokenDelta | None = None,
            logprobs: tuple[TokenLogprobs, ...] | None = None,
            prompt_logprobs: PromptLogprobs | None = None) -> None:
        """Tokens and their text (None: not detokenized) and log-probs (None: not asked
        for); `last`: the finishing delta."""
        self._ids.extend(token_ids)
        if logprobs is not None:
            if self._lps is None:
                self._lps = []
            self._lps.extend(logprobs)
        if prompt_logprobs is not None:
            self._prompt_lps = prompt_logprobs
        if text is not None:
            if self._texts is None:
                self._texts = []
            self._texts.append(text)
        if last is not None:
            self._last = last
        if self.sink is not None and self._common():
            self.sink()
        else:
            self._wake()

    def put_text(self, token_ids, text: str) -> None:
        """put(token_ids, text): the common delta (tokens and their text, no finish, no
        log-probs), as the pump's hot path hands it over."""
        self._ids += token_ids
        if self._texts is None:
            self._texts = [text]
        else:
            self._texts.append(text)
        if self.sink is not None and self._common():
            self.sink()
            return
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _common(self) -> bool:
        """Are the waiting deltas plain tokens with their text (what a sink takes)?"""
        return (self._last is None and self._error is None and self._lps is None
                and self._prompt_lps is None and self._texts is not None)

    def take_common(self) -> tuple[list[int], str] | None:
        """The sink's read: the waiting tokens and their text, if they are common (else
        None: they are the reader's)."""
        if not self._ids or not self._common():
            return None
        ids, texts = self._ids, self._texts
        self._ids, self._texts = [], None
        return ids, texts[0] if len(texts) == 1 else "".join(texts)

    def detach(self) -> None:
        """The sink is gone: the reader gets whatever it left."""
        self.sink = None
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def get(self) -> TokenDelta | RouterError:
        while self.empty():
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self._last is None and self._lps is None and self._prompt_lps is None and self._ids:
            ids, texts = self._ids, self._texts  # the common delta: tokens and their text
            self._ids, self._texts = [], None
            text = None if texts is None else texts[0] if len(texts) == 1 else "".join(texts)
            return TokenDelta(self.request_id, tuple(ids), False, None, None, text)
        if self._ids or self._last is not None:
            last = self._last
            text = "".join(self._texts) if self._texts is not None else None
            lps = tuple(self._lps) if self._lps is not None else None
            delta = TokenDelta(self.request_id, tuple(self._ids), last is not None,
                               last.finish_reason if last else None,
                               last.usage if last else None, text=text, logprobs=lps,
                               prompt_logprobs=self._prompt_lps)
            self._ids, self._texts, self._last = [], None, None
            self._lps = self._prompt_lps = None
            return delta
        return self._error


class StreamWriter:
    """A DeltaStream's sink that writes its common deltas from the put that brings them:
    `write(message)` is a coroutine function (grpc.aio's ServicerContext.write), driven
    here by hand and resumed by the Future it awaits (grpc's write completion), so a
    streamed message costs no task step, no Future of ours and no generator resumed,
    and a step's messages all start in the callback that delivers the step. One write
    is in flight at a time; tokens that come meanwhile go out together with the next.
    The reader writes the rest (first, last, log-probs) itself between `pause()` and
    `resume()`; a failed write (the call ended) detaches the writer."""

    __slots__ = ("stream", "_write", "_message", "_coro", "_idle", "_held", "closed",
                 "_sink")

    def __init__(self, stream: CommonStream, write: Callable, message: Callable):
        self.stream = stream
        self._write = write  # async (message) -> None
        self._message = message  # (token ids, text) -> message
        self._coro = None  # the write in flight
        self._idle: asyncio.Future | None = None
        self._held = False
        self.closed = False
        self._sink = self._ready
        stream.sink = self._sink

    def _ready(self) -> None:
        if self._coro is None and not self._held and not self.closed:
            self._next()

    def _next(self) -> None:
        got = self.stream.take_common()
        if got is not None:
            self._coro = self._write(self._message(*got))
            self._step(None)

    def _step(self, _done) -> None:
        try:
            fut = self._coro.send(None)
        except StopIteration:
            self._coro = None
            if not self._held and not self.closed:
                self._next()  # what came while it was on the wire
        except (Exception, asyncio.CancelledError) as e:  # the call ended under it
            log.debug("stream %s: write failed (%r)", self.stream.request_id, e)
            self._coro = None
            self.close()
        else:
            if fut is None:  # a bare yield: resume on the loop's next turn
                asyncio.get_running_loop().call_soon(self._step, None)
            else:
                fut._asyncio_future_blocking = False
                fut.add_done_callback(self._step)
            return
        if self._coro is None and self._idle is not None and not self._idle.done():
            self._idle.set_result(None)

    async def pause(self) -> None:
        """Hold the writes and wait out the one in flight (before the reader writes)."""
        self._held = True
        while self._coro is not None:
            self._idle = asyncio.get_running_loop().create_future()
            await self._idle

    def resume(self) -> None:
        self._held = False
        self._ready()

    def close(self) -> None:
        """Write no more; the reader gets whatever is left."""
        self.closed = True
        if self.stream.sink is self._sink:
            self.stream.detach()
