"""Open-loop sending: each request at its arrival offset from the start, at most
``max_concurrency`` in flight (later arrivals wait for a slot, as ``vllm bench serve
--max-concurrency``). Shared by the gRPC/HTTP client (bench/client.py) and the in-process
router driver (bench/router_driver.py), which differ only in how one request is sent.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, TypeVar

R = TypeVar("R")
Clock = Callable[[], float]


class Arriving(Protocol):
    @property
    def arrival_s(self) -> float: ...


Q = TypeVar("Q", bound=Arriving)


async def send_at_arrivals(requests: Sequence[Q], send: Callable[[Q], Awaitable[R]], *,
                           max_concurrency: int | None = None,
                           on_done: Callable[[R], None] | None = None,
                           clock: Clock = time.monotonic) -> list[R]:
    """``send(request)`` for every request at ``start + request.arrival_s``; results in
    input order. ``on_done(result)`` is called as each one ends (progress bars)."""
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    t0 = clock()

    async def one(req: Q) -> R:
        await asyncio.sleep(max(0.0, t0 + req.arrival_s - clock()))
        if limit is None:
            result = await send(req)
        else:
            async with limit:
                result = await send(req)
        if on_done is not None:
            on_done(result)
        return result

    return list(await asyncio.gather(*(one(r) for r in requests)))
