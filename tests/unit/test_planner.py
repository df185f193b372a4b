"""The live planner (cluster/serve/planner.py): PlannerCore's rule -- a cold start's
trickle, a split within the margin, one window's win and a switch inside the dwell decide
nothing; a clear win confirmed over windows moves one worker -- and Planner.step driving a
router of scripted workers (tests/scripted_workers.py) through a real switch with a fake
advisor; the simulator's own advisor (sim/plan.py) prefers more prefill workers for long
documents than for chat."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import generate_latest

from cluster.config.serve import ServeConfig, slo_pairs
from cluster.metrics import ServiceMetrics
from cluster.serve.planner import Planner, PlannerConfig, PlannerCore, SplitScore, Window
from tests.scripted_workers import make_router
from tests.unit.test_router_races import assert_router_clean

CFG = PlannerConfig(window_s=10, dwell_s=30, margin=0.1, confirm=2, min_requests=5)


def window(n: int, prefill: int = 1, decode: int = 2) -> Window:
    return Window(tuple((i * 0.1, 64, 16, "default") for i in range(n)), 10.0, prefill, decode)


def scores(cur: float, other: float) -> list[SplitScore]:
    return [SplitScore(1, 2, cur, 100.0, 5.0), SplitScore(2, 1, other, 50.0, 6.0)]


def test_the_rule_holds_until_a_clear_win_is_confirmed_outside_the_dwell():
    core = PlannerCore(CFG)
    assert core.decide(window(3), scores(1.0, 9.0), 0.0).action == "hold"  # cold start
    d = core.decide(window(50), scores(1.0, 1.05), 1.0)
    assert d.action == "hold" and "within 10%" in d.reason  # the margin
    d = core.decide(window(50), scores(1.0, 2.0), 2.0)
    assert d.action == "hold" and "won 1 of the 2" in d.reason  # one window is not enough
    d = core.decide(window(50), scores(1.0, 2.0), 3.0)
    assert d.action == "to_prefill" and d.target.split == "2P1D" and d.current.split == "1P2D"
    core.switched(3.0)
    d = core.decide(window(50, 2, 1), [SplitScore(2, 1, 1.0, 1, 1), SplitScore(1, 2, 3.0, 1, 1)],
                    4.0)
    assert d.action == "hold"  # the streak starts over after a switch
    d = core.decide(window(50, 2, 1), [SplitScore(2, 1, 1.0, 1, 1), SplitScore(1, 2, 3.0, 1, 1)],
                    5.0)
    assert d.action == "hold" and "dwell" in d.reason
    d = core.decide(window(50, 2, 1), [SplitScore(2, 1, 1.0, 1, 1), SplitScore(1, 2, 3.0, 1, 1)],
                    40.0)
    assert d.action == "to_decode"


def test_bad_settings_and_slos_are_refused():
    with pytest.raises(ValueError):
        PlannerConfig(window_s=0)
    assert slo_pairs("ttft:300, tpot:25") == (("ttft", 300.0), ("tpot", 25.0))
    for bad in ("ttft", "lat:3", "ttft:-1", "ttft:x"):
        with pytest.raises(ValueError, match="slo"):
            slo_pairs(bad)
    for bad in ("ttft", ""):
        with pytest.raises(ValueError, match="planner_slo"):
            ServeConfig.from_dict({"pools": {"planner": True, "planner_slo": bad}})
    with pytest.raises(ValueError, match="role_switch"):
        ServeConfig.from_dict({"pools": {"planner": True, "decode_tp": 2}})


def test_the_window_counts_the_backlog_from_before_it_at_its_start():
    import time

    from cluster.router.flight import Flight
    from cluster.router.types import GenerateSpec
    from engine import SamplingParams

    router, _, _ = make_router(n_decode=2)
    planner = Planner(router, CFG, {}, advise=lambda w, c: [])
    now = time.monotonic()
    sp = SamplingParams(max_tokens=7)
    old = Flight(GenerateSpec("old", (1,) * 30, sp), None, now - 60)  # waiting since
    served = Flight(GenerateSpec("served", (1,) * 40, sp), None, now - 60)
    served.first_token_at = now - 50
    router.flights.update(old=old, served=served)
    w = planner.window(now)
    assert w.arrivals == ((0.0, 30, 7, "default"),)
    assert (w.prefill, w.decode) == (1, 2)


def test_planner_step_moves_one_worker_through_the_router():
    async def go():
        router, prefill, [d0, d1] = make_router(n_decode=2)
        calls = []

        def advise(w, serve_config):
            calls.append((w.prefill, w.decode, len(w.arrivals)))
            return scores(1.0, 3.0) if (w.prefill, w.decode) == (1, 2) else \
                [SplitScore(2, 1, 3.0, 1, 1), SplitScore(1, 2, 1.0, 1, 1)]

        planner = Planner(router, PlannerConfig(window_s=60, dwell_s=0, confirm=2,
                                                min_requests=5), {}, advise=advise,
                          metrics=ServiceMetrics())
        for _ in range(8):
            planner.observe(type("S", (), {"prompt_token_ids": (1,) * 64, "tenant": "t",
                                           "sampling": type("P", (), {"max_tokens": 9})})())
        first = await planner.step()
        second = await planner.step()
        third = await planner.step()
        await router.shutdown(0)
        return router, prefill, d0, d1, calls, (first, second, third), planner

    router, prefill, d0, d1, calls, ds, planner = asyncio.run(go())
    assert [d.action for d in ds] == ["hold", "to_prefill", "hold"]
    assert calls[:2] == [(1, 2, 8), (1, 2, 8)] and calls[2] == (2, 1, 8)
    assert len(router.prefill) == 2 and len(router.decode) == 1
    moved = next(w for w in (d0, d1) if w in router.prefill)
    assert moved.actor.calls_of("switch_role") == ["prefill"]
    assert [took is not None for _, d, took in planner.decisions] == [False, True, False]
    text = generate_latest(planner.metrics.registry).decode()
    assert 'pdserve:planner_decisions_total{action="hold"} 2.0' in text
    assert 'pdserve:planner_decisions_total{action="to_prefill"} 1.0' in text
    assert_router_clean(router, prefill, [w for w in (d0, d1) if w is not moved])


def test_the_simulators_advice_follows_the_mix():
    import sim.cli  # noqa: F401 - registers the advisor
    from cluster.serve.planner import advisor, best_of

    cfg = ServeConfig.from_dict({"model": {"emulate": "h200", "model_shape": "llama-3-8b",
                                           "dtype": "bfloat16"},
                                 "pools": {"prefill_workers": 1, "decode_workers": 2}})
    slos = (("ttft", 300.0), ("tpot", 30.0))
    docs = Window(tuple((i * 0.05, 6000, 16, "default") for i in range(200)), 10.0, 1, 2, slos)
    best = best_of(advisor()(docs, cfg.to_dict()))
    assert (best.prefill, best.decode) == (2, 1)
