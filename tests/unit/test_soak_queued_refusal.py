"""bench.soak_plan.queued_refusal: the fault that keeps the soak's "queued" targets in
the router's admission queue names exactly those requests, every leg of each."""

from __future__ import annotations

import pytest

from bench.soak_plan import SoakConfig, build_plan, queued_refusal
from kv_transfer.faults import FaultInjector, FaultPlan


def _refuses(fault: dict, leg_id: str) -> bool:
    return FaultInjector(FaultPlan.parse([fault]), "decode-0").refuse_admission(leg_id)


def test_it_refuses_every_leg_of_the_queued_targets_and_nothing_else():
    plan = build_plan(SoakConfig(requests=200, cancel_rate=0.3, seed=0), 1000, 2048)
    fault = queued_refusal(plan)
    queued = [r for r in plan if r.cancel_phase == "queued"]
    assert len(queued) == 15
    for r in queued:  # a re-dispatched leg (#2) or another router's tag is refused too
        assert _refuses(fault, f"{r.request_id}#a1b2c31#1")
        assert _refuses(fault, f"{r.request_id}#ffffff9#2")
    for r in plan:
        if r.cancel_phase != "queued":
            assert not _refuses(fault, f"{r.request_id}#a1b2c31#1"), r.cancel_phase
    # an id that only starts like a target's is not one
    assert not _refuses(fault, f"{queued[0].request_id}0#a1b2c31#1")


def test_a_reused_id_is_left_out_and_a_plan_without_queued_targets_is_an_error():
    cfg = SoakConfig(requests=100, seed=5, pressure=True, pool_tokens=384, cancel_rate=0.1,
                     abort_rate=0.25, reuse_rate=0.1)
    plan = build_plan(cfg, 1000, 2048)
    fault = queued_refusal(plan)
    reused = {r.request_id for r in plan if r.reuses is not None}
    aimed = {r.request_id for r in plan if r.aimed_phase == "queued"}
    assert aimed - reused and aimed & reused  # (aborts aimed at "queued" count too)
    for rid in aimed:
        assert _refuses(fault, f"{rid}#t1#1") == (rid not in reused)
    with pytest.raises(ValueError, match="queued"):
        queued_refusal(build_plan(SoakConfig(requests=10, cancel_rate=0.0), 1000, 2048))
