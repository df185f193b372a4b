"""The HTTP client's side of an OpenAI request: noticing that it went away (before the
answer is ready: `unless_gone`; while streaming: Starlette cancels the body), and the
SSE response that frees the request however its stream ends.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable

from starlette.requests import Request
from starlette.responses import StreamingResponse


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_gone(request: Request, work: Awaitable):
    """`await work`, unless the client disconnects first (then ClientGone, work cancelled)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    if task.cancelled():
        raise ClientGone()
    return task.result()


class EventStream(StreamingResponse):
    """SSE response that runs `on_close` however the stream ends (finished, or the
    client gone: Starlette then cancels the body iterator, which is closed here)."""

    def __init__(self, events: AsyncIterator[str], on_close, headers: dict[str, str]):
        super().__init__(events, media_type="text/event-stream",
                         headers={**headers, "Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()
            await self._on_close()
