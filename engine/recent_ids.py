"""RecentIds: the one bounded "recently seen ids" set, with an optional note per id.

Workers remember ids that ended (or were aborted before they arrived) so that late
messages about them can be recognised; ids come from clients, so the memory is bounded:
past `capacity` the oldest id is forgotten. Used by engine/tombstones.py (and meant for
kv_transfer's closed-request and dead-request sets)."""

from __future__ import annotations

from collections import OrderedDict


class RecentIds:
    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._ids: OrderedDict[str, str] = OrderedDict()  # oldest first

    def add(self, id_: str, note: str = "") -> None:
        """Remember `id_` (as the newest), forgetting the oldest beyond capacity."""
        self._ids[id_] = note
        self._ids.move_to_end(id_)
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def pop(self, id_: str) -> bool:
        """Forget `id_`; True if it was remembered."""
        return self._ids.pop(id_, None) is not None

    def note(self, id_: str) -> str | None:
        """The note of a remembered id; None when it is not remembered."""
        return self._ids.get(id_)

    def __contains__(self, id_: object) -> bool:
        return id_ in self._ids

    def __len__(self) -> int:
        return len(self._ids)
