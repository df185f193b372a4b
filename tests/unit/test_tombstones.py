"""RecentIds: the one bounded set of recently seen ids (tombstones use it)."""

from __future__ import annotations

import pytest

from engine.tombstones import RecentIds, Tombstones


def test_the_oldest_id_is_forgotten_past_capacity_and_a_repeat_becomes_the_newest():
    ids = RecentIds(3)
    for i in "abc":
        ids.add(i)
    ids.add("a", "again")  # now the newest: "b" is the oldest
    ids.add("d")
    assert "b" not in ids and [i in ids for i in "acd"] == [True] * 3 and len(ids) == 3
    assert ids.note("a") == "again" and ids.note("b") is None
    assert ids.pop("a") and not ids.pop("a") and len(ids) == 2
    with pytest.raises(ValueError, match="capacity"):
        RecentIds(0)


def test_tombstones_stay_bounded_under_a_flood_of_early_aborts():
    t = Tombstones(capacity=8)
    for i in range(100):
        assert t.bury(f"leg-{i}")
    assert len(t) == 8
    assert t.claim("leg-99") and not t.claim("leg-0")  # the oldest were forgotten
