"""Tombstones: ids aborted before they were known here, kept in RecentIds: the one
bounded "recently seen ids" set (ids come from clients: past its capacity the oldest id
is forgotten), meant for kv_transfer's closed- and dead-request sets too.

Worker actors run commands on several threads, so an abort sent after an add can run
first; the late add must then be dropped, not started as an orphan nobody will end.

An abort can also arrive *after* its request ended here (finished, failed, preempted or
aborted): the router ends every leg it opened. That abort is late, not early, and must
not bury the id: an id is free again the moment its request ends (docs/design.md §5), so a later
add/reserve of the same id is a new request. The engine therefore reports every end
(`ended`), and `bury` leaves no tombstone for an id that ended here recently.

What stays ambiguous without distinct ids: an id that ended here, then is added again
while the abort of that *new* add overtakes it, looks like a late abort of the old one.
The router gives every leg its own id, so the case does not arise from it; were it to,
the orphan would only hold resources until its KV wait times out.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TypeVar

T = TypeVar("T")


class RecentIds(OrderedDict[str, T]):
    """Ids seen recently, oldest first, each with an optional note (any value); bounded.

    An OrderedDict itself, so `id in recent`, `len` and `note` are the dict's own (C)
    methods: the KV links and the workers test ids against these sets on every frame
    and every request."""

    def __init__(self, capacity: int):
        super().__init__()
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity

    def add(self, id_: str, note: T = "") -> None:  # type: ignore[assignment]
        """Remember `id_` (as the newest), forgetting the oldest beyond capacity."""
        self[id_] = note
        self.move_to_end(id_)
        while len(self) > self.capacity:
            self.popitem(last=False)

    def pop(self, id_: str) -> bool:  # type: ignore[override]
        """Forget `id_`; True if it was remembered."""
        return super().pop(id_, None) is not None

    # the note of a remembered id; None when it is not remembered
    note = OrderedDict.get


class Tombstones:
    def __init__(self, capacity: int = 4096):
        self.capacity = capacity
        self.buried: RecentIds[str] = RecentIds(capacity)  # aborted before they arrived
        self.ended_ids: RecentIds[str] = RecentIds(capacity)  # ended here recently

    def ended(self, request_id: str) -> None:
        """`request_id` ended on this worker (any status): a later abort of it is late."""
        self.ended_ids.add(request_id)

    def bury(self, request_id: str) -> bool:
        """An abort for an id this worker does not hold. Leaves a tombstone (True) unless
        the id ended here recently: then the abort is late and the id stays free."""
        if request_id in self.ended_ids:
            return False  # late (possibly repeated) abort: the id stays ended, not buried
        self.buried.add(request_id)
        return True

    def claim(self, request_id: str) -> bool:
        """An add/reserve arrives: True (and forgets it) when its abort overtook it.
        Otherwise the id starts a new request here, so it no longer counts as ended.
        A no-op for an id in neither set: callers test `in buried` / `in ended_ids`
        first (two dict lookups) and call this only for a known id."""
        self.ended_ids.pop(request_id)
        return self.buried.pop(request_id)

    def __len__(self) -> int:
        return len(self.buried)
