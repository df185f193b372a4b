"""CUDA timing for the GPU benchmarks: median CUDA-event time of a call, per-call time from
CUDA-graph replays (eager fallback, said), and the device's read-only and copy bandwidth."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import Any

import torch


def median_event_ms(fn: Callable[[], None], reps: int) -> float:
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_per_call_ms(calls: list[Callable[[], Any]], graph_ms: float) -> tuple[float, str]:
    """Mean ms of one call (rotating over `calls`), from CUDA-graph replays when capture works."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compile, autotune caches, workspaces
        for _ in range(2):
            for c in calls:
                c()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    def eager() -> None:
        for c in calls:
            c()

    est = median_event_ms(eager, 3) / len(calls)
    # calls per replay: ~graph_ms of work, at most ~1000 captured calls (capture cost)
    inner = max(1, min(1000 // len(calls), math.ceil(graph_ms / max(est, 1e-3) / len(calls))))
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(inner):
                eager()
        graph.replay()
        torch.cuda.synchronize()
        ms = median_event_ms(graph.replay, 7) / (inner * len(calls))
        del graph
        return ms, "cuda-graph"
    except Exception as exc:  # fall back to eager timing, and say so
        print(f"  (graph capture failed: {type(exc).__name__}: {exc}; timing eagerly)")
        torch.cuda.synchronize()
        reps = max(5, min(200, math.ceil(graph_ms / max(est, 1e-3) / len(calls))))
        return median_event_ms(lambda: [eager() for _ in range(reps)], 5) / (reps * len(calls)), "eager"


def read_bandwidth_gbps(gib: float) -> float:
    """Read-only bandwidth: a sum over `gib` GiB (the write is one scalar; GB/s, 1e9)."""
    n = int(gib * (1 << 30)) // 4
    src = torch.empty(n, dtype=torch.float32, device="cuda").uniform_()
    for _ in range(3):
        src.sum()
    torch.cuda.synchronize()
    ms = median_event_ms(lambda: src.sum(), 10)
    return 4 * n / (ms * 1e-3) / 1e9


def copy_bandwidth_gbps(gib: float) -> float:
    """Device-to-device copy bandwidth, counting bytes read + written (GB/s, 1e9)."""
    n = int(gib * (1 << 30))
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    src.random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    ms = median_event_ms(lambda: dst.copy_(src), 10)
    return 2 * n / (ms * 1e-3) / 1e9  # src/dst are freed on return
