"""AckWriter: the thread of a receiving link that sends the owner's acks back.

It batches acks into control messages (at most 128 acks each, far below
``MAX_HEADER_BYTES``) and, after ``heartbeat_s`` without one, sends a heartbeat, so the
sender can tell a live receiver from a dead or hung one within ``failure_timeout_s``.
The transports differ only in how a link ends, so both endings are explicit:

* ``stop(flush=False)``: send nothing more; unsent acks are dropped. For a link whose
  connection is being torn down (tcp ``close``) or whose peer is gone (torchdist
  "quiet": a gloo send to a peer that will not receive blocks for the whole timeout).
* ``stop(flush=True)``: send the acks already given, then ``farewell`` (torchdist's
  "bye", which the sender answers so both ends stop at once), then end.

A later ``stop(flush=False)`` still silences a writer asked to flush (the peer turned
out to be gone); a ``stop(flush=True)`` never revives a silenced one.

Acks given after ``stop`` are dropped. A write that raises one of ``errors`` (the
transport's "peer unreachable") ends the writer after a log line, then ``on_error``
runs (tcp closes the link so its reader wakes up too).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kv_transfer.wire import Ack, encode_control

log = logging.getLogger(__name__)
ACKS_PER_MESSAGE = 128
HEARTBEAT = encode_control({"k": "hb"})


class AckWriter:
    def __init__(self, name: str, heartbeat_s: float, write: Callable[[bytes], None], *,
                 errors: tuple[type[BaseException], ...],
                 on_error: Callable[[], None] | None = None,
                 farewell: bytes | None = None) -> None:
        self.name = name
        self._hb = heartbeat_s
        self._write = write
        self._errors = errors
        self._on_error = on_error
        self._farewell = farewell
        self._cond = threading.Condition()
        self._acks: list[Ack] = []
        self._stop: bool | None = None  # None: running; else: stop(flush=...)
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"kv-ack->{name}")

    def start(self) -> AckWriter:
        self._thread.start()
        return self

    def send(self, acks: list[Ack]) -> None:
        with self._cond:
            if self._stop is None:
                self._acks.extend(acks)
                self._cond.notify()

    def stop(self, *, flush: bool) -> None:
        """End the writer (see the module doc)."""
        with self._cond:
            if self._stop is None or not flush:
                self._stop = flush
                self._cond.notify()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout=timeout)

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    if not self._acks and self._stop is None:
                        self._cond.wait(self._hb)
                    if self._stop is False:
                        return
                    acks, self._acks, flush = self._acks, [], self._stop is True
                for i in range(0, len(acks), ACKS_PER_MESSAGE):
                    batch = [list(a) for a in acks[i : i + ACKS_PER_MESSAGE]]
                    self._write(encode_control({"k": "ack", "a": batch}))
                if flush:
                    if self._farewell is not None:
                        self._write(self._farewell)
                    return
                if not acks:
                    self._write(HEARTBEAT)
        except self._errors as e:  # incl. a timeout: a sender not reading acks is gone
            log.info("kv link %s: ack writer stopped: %s", self.name, e)
            if self._on_error is not None:
                self._on_error()
