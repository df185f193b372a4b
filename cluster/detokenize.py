"""The front door's detokenizer thread: every request's text deltas of a step decoded in
one pass (engine/detokenize.py's `BatchDecoder` over each stream's `IncrementalDetokenizer`),
off the front door's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

from engine.detokenize import BatchDecoder, IncrementalDetokenizer

log = logging.getLogger(__name__)


class DetokenizerThread:
    """Detokenizes the front door's token deltas on its own thread.

    `submit(items, deliver)` (on the event loop) queues a step's [(holder, ids, final)];
    the thread pushes them all through one BatchDecoder call (each holder keeps its
    IncrementalDetokenizer in `holder.detok`, touched by this thread only) and hands the
    texts back with `deliver(items, texts)` on the loop, in submission order."""

    def __init__(self, tokenizer: Any, loop: asyncio.AbstractEventLoop):
        self.decoder = BatchDecoder(tokenizer)
        self.loop = loop
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="pdserve-detokenize",
                                        daemon=True)
        self._thread.start()

    def submit(self, items: list[tuple[Any, Sequence[int], bool]],
               deliver: Callable[[list, list[str]], None]) -> None:
        self._queue.put((items, deliver))

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            jobs = [job]
            while True:  # take whatever queued meanwhile: one decode call for all of it
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._queue.put(None)
                    break
                jobs.append(more)
            items = [it for its, _ in jobs for it in its]
            for holder, _, _ in items:
                if holder.detok is None:
                    holder.detok = IncrementalDetokenizer()
            try:
                texts = self.decoder.push_many([(h.detok, ids, f) for h, ids, f in items])
            except Exception:  # a tokenizer failure must not stop every stream's text
                log.exception("detokenizing a step failed")
                texts = [""] * len(items)
            i = 0
            for its, deliver in jobs:
                self._hand_back(deliver, its, texts[i:i + len(its)])
                i += len(its)

    def _hand_back(self, deliver, items, texts) -> None:
        try:
            self.loop.call_soon_threadsafe(deliver, items, texts)
        except RuntimeError:  # the loop closed (shutdown)
            pass

    def stop(self) -> None:
        self._queue.put(None)
