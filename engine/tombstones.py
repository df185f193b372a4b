"""Tombstones: ids aborted before they were known here.

Worker actors run commands on several threads, so an abort sent after an add can run
first; the late add must then be dropped, not started as an orphan nobody will end.

An abort can also arrive *after* its request ended here (finished, failed, preempted or
aborted): the router ends every leg it opened. That abort is late, not early, and must
not bury the id: an id is free again the moment its request ends (DESIGN §8), so a later
add/reserve of the same id is a new request. The engine therefore reports every end
(`ended`), and `bury` leaves no tombstone for an id that ended here recently.

What stays ambiguous without distinct ids: an id that ended here, then is added again
while the abort of that *new* add overtakes it, looks like a late abort of the old one.
The router gives every leg its own id, so the case does not arise from it; were it to,
the orphan would only hold resources until its KV wait times out.
"""

from __future__ import annotations

from engine.recent_ids import RecentIds


class Tombstones:
    def __init__(self, capacity: int = 4096):
        self.capacity = capacity
        self._buried = RecentIds(capacity)  # aborted before they arrived
        self._ended = RecentIds(capacity)  # ended here recently

    def ended(self, request_id: str) -> None:
        """`request_id` ended on this worker (any status): a later abort of it is late."""
        self._ended.add(request_id)

    def bury(self, request_id: str) -> bool:
        """An abort for an id this worker does not hold. Leaves a tombstone (True) unless
        the id ended here recently: then the abort is late and the id stays free."""
        if request_id in self._ended:
            return False  # late (possibly repeated) abort: the id stays ended, not buried
        self._buried.add(request_id)
        return True

    def claim(self, request_id: str) -> bool:
        """An add/reserve arrives: True (and forgets it) when its abort overtook it.
        Otherwise the id starts a new request here, so it no longer counts as ended."""
        self._ended.pop(request_id)
        return self._buried.pop(request_id)

    def __len__(self) -> int:
        return len(self._buried)
