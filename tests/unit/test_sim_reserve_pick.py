"""The simulator's pipelined reserve pick (sim/router_reserve.py ``_least_promised``):
its shortcut with no reserve in flight on decode workers of one size (the most free
blocks, the admission's order for a tie) picks what the scan of every worker picks, over
many views with ties, every leg count order and prompts with and without room."""

from __future__ import annotations

import random

from engine.costs.loader import load_costs
from sim.adapters import ServeConfig
from sim.cluster import Simulation
from sim.options import SimOptions
from sim.synthetic import synthetic_calibration


def _router(decode: int = 6):
    cal = synthetic_calibration(prefill=lambda c, p: 0.002, decode=lambda b, L: 0.001)
    cfg = ServeConfig().with_values({
        "transfer.connector": "inproc", "cache.enable_prefix_caching": False,
        "cache.num_blocks": 64, "cache.block_size": 16, "model.max_model_len": 2048,
        "pools.decode_workers": decode})
    return Simulation(cfg, load_costs(cal), SimOptions(decode_order="least-legs")).router


def test_the_most_free_shortcut_picks_what_the_full_scan_picks() -> None:
    router, rng = _router(), random.Random(7)
    assert router.same_size and not router.reserving
    ids = list(router.promisable)
    picks = set()
    for _ in range(2000):
        for wid in ids:  # few distinct counts: many ties
            router.promisable[wid] = rng.choice((0, 1, 3, 40, 64))
            router.held[wid] = {f"leg{i}" for i in range(rng.randrange(3))}
            router._decode_load(wid)  # (the admission's order follows the leg counts)
        prompt = rng.choice((10, 47, 48, 700, 1100))
        fast = router._least_promised(prompt)
        router.same_size = False  # the scan of every worker
        try:
            scan = router._least_promised(prompt)
        finally:
            router.same_size = True
        assert fast is scan, (dict(router.promisable), prompt)
        picks.add(None if fast is None else fast.worker_id)
    assert None in picks and len(picks) > 3  # (no room, and several winners, were reached)
    for wid in ids:
        router.held[wid].clear()
