"""How fast this machine is right now: a fixed CPU job timed between real runs.

A shared host's speed moves by tens of percent within minutes (steal from neighbours,
frequency), which the load average does not show. The job is what a tiny-model worker
step is made of -- a few small float32 matmuls on one thread and an interpreter loop --
so its time moves as the workers' steps do. tools/sim_validate.py times it before every
real run of a row: when it moved between the runs the terms were fitted to and the
compared runs, the machine did, not the model. ``wake_s`` times the other thing a shared
host slows: a thread woken by another (every hop on a request's path is one; on this VM
its round trip ran ~65-90 us on a quiet host and ms-long on a crowded one).
"""

from __future__ import annotations

import statistics
import threading
import time

import torch

_SHAPE = (64, 512)  # a 64-token chunk through a 512-wide layer: ~1 ms for 20 of them
_MATMULS = 20
_LOOP = 100_000


def canary_s(repeats: int = 5) -> float:
    """The median wall time of ``repeats`` runs of the job (seconds), on one torch thread."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(_SHAPE, generator=gen)
        w = torch.randn(_SHAPE[1], _SHAPE[1], generator=gen) / _SHAPE[1] ** 0.5
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            y = x
            for _ in range(_MATMULS):
                y = torch.tanh(y @ w)
            s = 0
            for i in range(_LOOP):
                s += i & 7
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    finally:
        torch.set_num_threads(threads)


def wake_s(round_trips: int = 200) -> float:
    """The median round trip of two threads waking each other through Events (seconds)."""
    if round_trips < 1:
        raise ValueError(f"round_trips must be >= 1, got {round_trips}")
    ping, pong = threading.Event(), threading.Event()

    def peer() -> None:
        for _ in range(round_trips):
            ping.wait()
            ping.clear()
            pong.set()

    t = threading.Thread(target=peer, name="wake-canary", daemon=True)
    t.start()
    times = []
    for _ in range(round_trips):
        t0 = time.perf_counter()
        ping.set()
        pong.wait()
        pong.clear()
        times.append(time.perf_counter() - t0)
    t.join()
    return statistics.median(times)


def drift(before: list[float], after: list[float]) -> float | None:
    """The median of ``after`` over the median of ``before``, less 1 (+0.2: the machine
    ran 20% slower); None when either is empty."""
    if not before or not after:
        return None
    return statistics.median(after) / statistics.median(before) - 1.0
