"""Stop strings applied to the generated text (OpenAI's `stop`), for streamed output.

Text arrives in deltas; a stop string may straddle two of them. `StopStrings.push` returns
the text that is safe to release: everything before a match (the stop string itself is not
released unless `include`), or, while nothing matched, all but the longest tail that is
the beginning of a stop string: that tail is held back until later text decides. The
final push releases what is held.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStrings:
    def __init__(self, stops: Sequence[str], include: bool = False):
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self.stops = tuple(stops)
        self.include = include
        self._text = ""
        self._released = 0
        self.matched: str | None = None  # the stop string that ended the text

    @property
    def text(self) -> str:
        """Everything released so far."""
        return self._text[:self._released]

    def push(self, delta: str, final: bool = False) -> str:
        """Add generated text; returns the newly releasable part. After a match, ''."""
        if self.matched is not None:
            return ""
        self._text += delta
        # released text never begins a match (its tail was held while it could)
        hit = self._first_match(self._released)
        if hit is not None:
            pos, stop = hit
            self.matched = stop
            return self._release(pos + (len(stop) if self.include else 0))
        end = len(self._text) if final else len(self._text) - self._held_tail()
        return self._release(end)

    def _held_tail(self) -> int:
        """Length of the longest unreleased tail that a stop string begins with."""
        longest = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self._text) - self._released), longest, -1):
                if self._text.endswith(stop[:k]):
                    longest = k
                    break
        return longest

    def _first_match(self, start: int) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self.stops:
            pos = self._text.find(stop, start)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, stop)
        return best

    def _release(self, end: int) -> str:
        out = self._text[self._released:end]
        self._released = max(self._released, end)
        return out
