"""The worker's collector: its pauses are counted, and startup's heap is kept off it."""

from __future__ import annotations

import gc

from runtime.gc_pauses import GcPauses, settle


def test_collections_are_counted_with_their_pause_time() -> None:
    pauses = GcPauses().install()
    try:
        gc.collect()  # a full collection
        gc.collect(0)  # a young one
        f = pauses.figures()
        assert f["gc_collections"] == 2 and f["gc_full_collections"] == 1
        assert 0.0 < f["gc_max_pause_s"] <= f["gc_pause_s"]
    finally:
        pauses.uninstall()
    gc.collect()
    assert pauses.figures()["gc_collections"] == 2  # uninstalled: no longer counted
    pauses.uninstall()  # twice is harmless


def test_settle_keeps_what_startup_built_off_the_collector() -> None:
    kept = [[i] for i in range(1000)]  # startup's long-lived objects
    try:
        settle()
        assert gc.get_freeze_count() >= len(kept)
        assert not any(o is kept for o in gc.get_objects())  # a collection no longer walks it
    finally:
        gc.unfreeze()


def test_a_process_has_one_recorder_however_many_workers_it_builds() -> None:
    from runtime.gc_pauses import process_gc_pauses

    first = process_gc_pauses()
    assert process_gc_pauses() is first
    assert sum(cb == first._on_gc for cb in gc.callbacks) == 1
