"""Tombstones: ids aborted before they were known here.

Worker actors run commands on several threads, so an abort sent after an add can run
first; the late add must then be dropped, not started as an orphan nobody will end."""

from __future__ import annotations

from collections import OrderedDict


class Tombstones:
    def __init__(self, capacity: int = 4096):
        self.capacity = capacity
        self._ids: OrderedDict[str, None] = OrderedDict()

    def bury(self, request_id: str) -> None:
        self._ids[request_id] = None
        self._ids.move_to_end(request_id)
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def claim(self, request_id: str) -> bool:
        """True (and forgets it) when `request_id` was aborted before it arrived."""
        return self._ids.pop(request_id, 0) is None

    def __len__(self) -> int:
        return len(self._ids)
