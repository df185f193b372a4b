"""The front door's event loop: uvloop where it is installed, else asyncio's own.

Each streamed message costs the front door's loop a few wake-ups (the stream's delivery,
grpc's write completion) and their callbacks; uvloop runs that machinery (call_soon,
handles, the selector) in C where asyncio's loop runs it in Python. Measured with
`python -m tools.control_plane` (issue 15): about 15% less front-door CPU per streamed
message at 256 streams, and a faster idle first token. grpc.aio, uvicorn and Ray's
awaitables all run on it.

    run(main(), cfg.server.event_loop)   # "auto" | "uvloop" | "asyncio"
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
EVENT_LOOPS = ("auto", "uvloop", "asyncio")  # server.event_loop's choices


def resolve(kind: str) -> str:
    """The loop `kind` runs on: "auto" is uvloop when it is importable."""
    if kind not in EVENT_LOOPS:
        raise ValueError(f"unknown event loop {kind!r} (choose from {', '.join(EVENT_LOOPS)})")
    if kind == "auto":
        return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    if kind == "uvloop" and importlib.util.find_spec("uvloop") is None:
        raise ValueError("server.event_loop=uvloop, but uvloop is not installed "
                         "(pip install uvloop, or choose 'auto' or 'asyncio')")
    return kind


def run(main: Coroutine[Any, Any, T], kind: str = "auto") -> T:
    """asyncio.run(main) on the event loop `kind` resolves to."""
    try:
        loop = resolve(kind)
    except ValueError:
        main.close()  # never awaited: no "coroutine was never awaited" warning
        raise
    if loop == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)


def running_loop_name() -> str:
    """"uvloop" or "asyncio": the loop this coroutine runs on (for logs and benchmarks)."""
    return "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") \
        else "asyncio"
