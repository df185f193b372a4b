"""The garbage collector's pauses in a worker process, and keeping its startup off them.

A worker process holds torch, the model and its pools: hundreds of thousands of tracked
objects that never die. A full collection walks all of them and stops the step loop for
as long (tens of ms on a 2-core host), at moments nothing else explains. ``settle()``
moves what startup built off the collector (as ``cluster.serve.server.serve`` does for the
front door), and ``GcPauses`` counts the collections that still run and how long they held
the process, so a worker's stats show them.
"""

from __future__ import annotations

import gc
import time


def settle() -> None:
    """Collect startup's garbage, then keep what survives off the collector for good."""
    gc.collect()
    gc.freeze()


class GcPauses:
    """Collections in this process (``gc.callbacks``), their count and pause time."""

    def __init__(self) -> None:
        self.collections = 0
        self.full_collections = 0  # generation 2: the ones that walk the whole heap
        self.pause_s = 0.0
        self.max_pause_s = 0.0
        self._started: float | None = None

    def install(self) -> GcPauses:
        gc.callbacks.append(self._on_gc)
        return self

    def uninstall(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        # the collector holds the GIL: start and stop of one collection pair up
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:  # installed mid-collection
            return
        pause = time.perf_counter() - self._started
        self._started = None
        # no lock: a collection can start inside any allocation, a reader's included
        self.collections += 1
        self.full_collections += info.get("generation") == 2
        self.pause_s += pause
        self.max_pause_s = max(self.max_pause_s, pause)

    def figures(self) -> dict[str, float]:
        """Cumulative since install: what the worker's stats carry."""
        return {"gc_collections": self.collections,
                "gc_full_collections": self.full_collections,
                "gc_pause_s": self.pause_s, "gc_max_pause_s": self.max_pause_s}


_PROCESS: GcPauses | None = None


def process_gc_pauses() -> GcPauses:
    """This process's one recorder, installed on first use (a test process may build
    several workers: each would otherwise count every collection again)."""
    global _PROCESS
    if _PROCESS is None:
        _PROCESS = GcPauses().install()
    return _PROCESS
