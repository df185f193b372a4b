"""EmulatedLink: a link of a given rate and one-way latency over a real transport.

Studies run on hardware whose KV link is far faster, relative to compute, than the links
they want to study. The emulated link is a property of the *transport*, beneath the send
policy, the queue discipline, the credit window and the pacer (kv_transfer/link_scheduler.py),
which stay exactly as configured:

- **rate**: the wire serializes bytes. A write of n bytes occupies it for n / rate from
  the moment the previous write left it (back to back when busy), and the link thread
  that writes is blocked meanwhile, as a sender is on a saturated wire. A token bucket
  of depth zero: nothing goes faster than the rate, nothing is held longer than it needs.
- **latency**: frames reach the real transport ``latency`` after their last byte left
  the wire, and acks (credit) reach the sender ``latency`` after the receiver sent them;
  both travel on a delay line (one thread each), so frames in flight overlap as on a wire.

The wrapped transport then does the actual write (loopback, Ray, TCP), on the frame delay
line's thread; its own cost comes on top (sim/link.py models the same arithmetic).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from kv_transfer.pacing import Clock, monotonic_clock
from kv_transfer.transport import LinkEvents, LinkTransport
from kv_transfer.wire import Ack, Piece

# A write that starts within this long after the wire went idle continues its schedule
# (a sleep that overslept does not lower the rate of a busy link).
BACK_TO_BACK_S = 1e-3


class DelayLine:
    """Runs calls at given times, in the order given (the times never decrease)."""

    def __init__(self, name: str, clock: Clock, on_error: Callable[[BaseException], None]):
        self._clock, self._on_error = clock, on_error
        self._queue: deque[tuple[float, Callable[..., Any], tuple]] = deque()
        self._cond = threading.Condition()
        self._stopped = False
        self._last_due = float("-inf")
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, due: float, fn: Callable[..., Any], *args: Any) -> None:
        with self._cond:
            if self._stopped:
                return
            self._last_due = due = max(due, self._last_due)
            self._queue.append((due, fn, args))
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._stopped:
                        return
                    if self._queue:
                        wait = self._queue[0][0] - self._clock()
                        if wait <= 0:
                            _, fn, args = self._queue.popleft()
                            break
                        self._cond.wait(wait)
                    else:
                        self._cond.wait()
            try:
                fn(*args)
            except Exception as e:  # the transport failed: the link fails, the line stops
                self.stop()
                self._on_error(e)
                return

    def stop(self) -> None:
        """Drop what is queued; the thread ends after the call it may be running."""
        with self._cond:
            self._stopped = True
            self._queue.clear()
            self._cond.notify()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)


class _DelayedEvents:
    """The events the wrapped transport reports to: acks come ``latency`` late."""

    def __init__(self, link: EmulatedLink, events: LinkEvents):
        self._link, self._events = link, events

    def on_acks(self, acks: list[Ack]) -> None:
        link = self._link
        link.acks.put(link.clock() + link.latency_s, self._events.on_acks, acks)

    def on_failure(self, reason: str) -> None:
        self._events.on_failure(reason)

    def busy(self) -> tuple[int, int]:
        return self._events.busy()


class EmulatedLink(LinkTransport):
    """Build it with the sender's link events, build the real transport with
    ``.events``, then ``.wrap(transport)``; the sender uses this object as its transport."""

    def __init__(self, rate_bytes_per_s: float, latency_s: float, events: LinkEvents, *,
                 clock: Clock = monotonic_clock, sleep: Callable[[float], None] = time.sleep,
                 name: str = "kv-link"):
        if not (rate_bytes_per_s >= 0 and latency_s >= 0):
            raise ValueError(f"emulated link needs rate >= 0 and latency >= 0, got "
                             f"{rate_bytes_per_s} B/s and {latency_s} s")
        self.rate, self.latency_s = float(rate_bytes_per_s), float(latency_s)
        self.clock, self._sleep = clock, sleep
        self._link_events = events
        self.events = _DelayedEvents(self, events)
        self.inner: LinkTransport | None = None
        self.wire_free_at = float("-inf")  # when the wire has sent every byte given so far
        fail = self._fail
        self.frames = DelayLine(f"{name}-frames", clock, fail)
        self.acks = DelayLine(f"{name}-acks", clock, fail)

    def wrap(self, inner: LinkTransport) -> EmulatedLink:
        self.inner = inner
        return self

    def _fail(self, e: BaseException) -> None:
        self._link_events.on_failure(f"send over the emulated link failed: "
                                     f"{type(e).__name__}: {e}")

    def wire_schedule(self, nbytes: int, now: float) -> float:
        """When the last of ``nbytes`` written at ``now`` leaves the wire (and the wire
        is free again)."""
        free = self.wire_free_at
        start = free if free >= now - BACK_TO_BACK_S else now  # busy: back to back
        self.wire_free_at = start + (nbytes / self.rate if self.rate > 0 else 0.0)
        return self.wire_free_at

    # ---- LinkTransport ----
    def connect(self) -> None:
        assert self.inner is not None, "EmulatedLink.wrap(transport) before use"
        self.inner.connect()

    def transmit(self, pieces: list[Piece]) -> None:
        assert self.inner is not None
        now = self.clock()
        sent = self.wire_schedule(sum(p.nbytes for p in pieces), now)
        if sent > now:
            self._sleep(sent - now)  # the wire is busy with these bytes
        self.frames.put(sent + self.latency_s, self.inner.transmit, pieces)

    def heartbeat(self) -> None:
        assert self.inner is not None
        self.frames.put(self.clock() + self.latency_s, self.inner.heartbeat)

    def close(self) -> None:
        self.frames.stop()
        self.acks.stop()
        if self.inner is not None:
            self.inner.close()

    def release(self) -> None:
        self.frames.join(timeout=5.0)
        self.acks.join(timeout=5.0)
        if self.inner is not None:
            self.inner.release()
