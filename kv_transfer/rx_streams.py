"""The receiving side's bookkeeping of one request: a link's identity, each KV-head
range's stream of frames (seq 0..final, parts per seq), when a request is complete, and
why a closed request id stays closed."""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import NamedTuple

from kv_transfer.frames import Ack
from kv_transfer.heads import HeadRange

_link_uids = itertools.count(1)


class RxLink(ABC):
    """The receiving end of one sender's link: where acks for its frames go."""

    name: str = "?"
    closed: bool = False  # set by ``_link_closed``: frames still arriving on it are dropped
    _uid: int = 0

    @property
    def uid(self) -> int:
        """A number no other link of this process has (ids of dead objects get reused)."""
        if not self._uid:
            self._uid = next(_link_uids)
        return self._uid

    @abstractmethod
    def send_acks(self, acks: list[Ack]) -> None:
        """Queue acks towards the sender; never blocks for long, never raises."""


@dataclass(eq=False)
class RxStream:
    """One head range of a request: its frames come over one link, seq 0..final."""

    link: RxLink
    parts_left: dict[int, int] = field(default_factory=dict)  # seq -> parts still missing
    seen: dict[tuple[int, int], int] = field(default_factory=dict)  # (seq, part) -> tx
    final_seq: int | None = None

    @property
    def done(self) -> bool:
        return self.final_seq is not None and all(
            self.parts_left.get(s, 1) == 0 for s in range(self.final_seq + 1))


@dataclass(eq=False)
class RxRequest:
    """A request's streams by head range; complete when they are all done and tile the
    heads this receiver serves (its ``head_range``, else all ``total`` heads)."""

    total: int
    streams: dict[tuple[int, int], RxStream] = field(default_factory=dict)

    def on_link(self, link: RxLink) -> bool:
        return any(s.link is link for s in self.streams.values())

    def complete(self, want: HeadRange | None) -> bool:
        lo, hi = (want.start, want.end) if want is not None else (0, self.total)
        for (hs, he), s in sorted(self.streams.items()):
            if hs != lo or not s.done:
                return False
            lo = he
        return lo == hi


class ClosedId(NamedTuple):
    """Why a request id is closed; for a completed one, the highest transmission it took
    per link (uid), which tells a late copy from a new frame reusing the id."""

    why: str
    max_tx: dict[int, int] | None = None
