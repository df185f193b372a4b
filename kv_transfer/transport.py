"""LinkTransport: what a connector implements for the sending side of one link.

The sender core (``sender.ThreadedSender``) owns queueing, pacing, credits and stats;
a transport only moves frames. ``connect``, ``transmit``, ``heartbeat`` and ``release``
run on the link's own thread; ``close`` may come from any thread. A transport reports
back through the events object it was built with: ``on_acks(list[Ack])`` when credit
returns, ``on_failure(reason)`` when the link is dead, and may ask ``busy()`` for
(frames in flight, active requests).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

from kv_transfer.wire import Ack, Piece


class LinkEvents(Protocol):
    """The sender side a transport reports to (implemented by the sender's link)."""

    def on_acks(self, acks: list[Ack]) -> None:
        """Credit is back for these frames (or they were discarded/rejected)."""

    def on_failure(self, reason: str) -> None:
        """The link is dead: its requests fail, the next send reconnects."""

    def busy(self) -> tuple[int, int]:
        """(frames in flight, active requests) on this link."""


class LinkTransport(ABC):
    """One connection to one receiver; ``connect``/``transmit`` run on the link thread."""

    @abstractmethod
    def connect(self) -> None:
        """Reach and authenticate the receiver; raise on failure."""

    @abstractmethod
    def transmit(self, pieces: list[Piece]) -> None:
        """Write the frames (in order); raise on failure."""

    @abstractmethod
    def close(self) -> None:
        """Release the connection; must be safe from any thread, more than once."""

    def heartbeat(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Called on the link thread after ``failure_timeout_s / 3`` without a write while
        the link has active requests, so the receiver can tell a hung sender from a slow one."""

    def release(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Called last, on the link thread, after ``close``: free OS resources (fds) that
        must not be freed while the link thread might still be using them."""
