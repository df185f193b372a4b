"""DeltaStream: one request's outgoing deltas between the router and its front door.

The router puts TokenDeltas (or a RouterError) with `put_nowait`, as into the
asyncio.Queue it replaces; the front door's `get()` returns everything put since its
last get as one delta (tokens and text concatenated, the finish and usage of the last).
Log-probs (when asked for) are concatenated as the tokens are; the prompt's ride with the
first delta. So a client that reads slower than tokens arrive gets fewer, larger messages
and costs nothing extra, and nothing is lost; a reader waits on one Future per wait, never
one per token. Tokens put before an error are handed out before it.
"""

from __future__ import annotations

import asyncio

from cluster.types import RouterError, TokenDelta
from engine.logprobs import PromptLogprobs, TokenLogprobs


class DeltaStream:
    __slots__ = ("request_id", "_ids", "_texts", "_lps", "_prompt_lps", "_last", "_error",
                 "_waiter")

    def __init__(self, request_id: str):
        self.request_id = request_id
        self._ids: list[int] = []
        self._texts: list[str] | None = None  # None: deltas without text
        self._lps: list[TokenLogprobs] | None = None  # None: deltas without log-probs
        self._prompt_lps: PromptLogprobs | None = None
        self._last: TokenDelta | None = None  # the finishing delta, once put
        self._error: RouterError | None = None
        self._waiter: asyncio.Future | None = None

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
