"""Tenant-aware decode admission (cluster/router/policies.py TenantFairOrder, driven by the
real AdmissionCore): with both tenants backlogged on a pool that admits one request at a
time, each tenant's share of the admitted promised tokens follows its weight; a tenant
flooding the queue cannot starve another's waiter; one tenant alone, or 'fcfs', keeps
arrival order; and the core counts each tenant's share of contended admissions."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.router.admission import AdmissionCore
from cluster.router.flight import RouterConfig
from cluster.router.policies import TenantFairOrder, make_admission_order
from tests.unit.test_admission_core import Driver, Leg, Task


def admit_all(core: AdmissionCore, d: Driver, limit: int) -> list[str]:
    """A pool with room for one request at a time: the worker grants whoever asks, the
    admitted leg leaves, the next asks. Returns the admitted legs in order."""
    out: list[str] = []
    while core.waiters and len(out) < limit:
        leg, worker, _ = d.asks[-1]
        wt = next(w for w in core.waiters if w.task.leg_id == leg)
        core.answered(wt, worker, True, core.round)
        assert core.take(wt) == worker
        out.append(leg)
        core.leave(wt)
    return out


def queue(core: AdmissionCore, tenant: str, n: int, tokens: int, t0: float = 0.0) -> None:
    for i in range(n):
        name = f"{tenant}-{i}"
        core.enqueue(Leg(name), t0 + i * 1e-3, Task(name, tenant, tokens))


def test_backlogged_tenants_share_admitted_tokens_by_weight() -> None:
    d = Driver(["w0"])
    core = AdmissionCore(d, TenantFairOrder({"gold": 2.0, "free": 1.0}))
    queue(core, "free", 60, 100)  # free arrived first: fcfs would admit all of it first
    queue(core, "gold", 60, 100, t0=1.0)
    core.pump()
    first = admit_all(core, d, 45)
    gold = sum(name.startswith("gold") for name in first)
    assert gold == 30  # 2:1 over the first 45 admissions, while both are backlogged
    shares = core.contended_tokens
    assert shares["gold"] / (shares["gold"] + shares["free"]) == pytest.approx(2 / 3)
    admit_all(core, d, 1000)
    assert not core.waiters and not core.busy  # everyone admitted, nothing held


def test_shares_count_promised_tokens_not_requests() -> None:
    d = Driver(["w0"])
    core = AdmissionCore(d, TenantFairOrder())  # equal weights
    queue(core, "big", 20, 400)
    queue(core, "small", 80, 100)
    core.pump()
    first = admit_all(core, d, 50)
    big = sum(n.startswith("big") for n in first)
    tokens = {"big": 400 * big, "small": 100 * (len(first) - big)}
    assert tokens["big"] == pytest.approx(tokens["small"], rel=0.1)


def test_one_tenant_alone_and_fcfs_keep_arrival_order() -> None:
    for order in (TenantFairOrder({"a": 3.0}), make_admission_order("fcfs")):
        d = Driver(["w0"])
        core = AdmissionCore(d, order)
        for i, size in enumerate([50, 900, 10, 300, 10]):
            core.enqueue(Leg(f"r{i}"), float(i), Task(f"r{i}", "a", size))
        core.pump()
        assert admit_all(core, d, 10) == [f"r{i}" for i in range(5)]


@settings(max_examples=40, deadline=None)
@given(weight=st.floats(0.05, 20.0), flood=st.integers(50, 300),
       sizes=st.lists(st.integers(1, 2000), min_size=1, max_size=5))
def test_a_flooding_tenant_cannot_starve_another(weight, flood, sizes) -> None:
    """Whatever the weights and sizes, a light tenant's waiter is admitted after a bounded
    number of the heavy tenant's, however many more of those keep arriving."""
    d = Driver(["w0"])
    core = AdmissionCore(d, TenantFairOrder({"light": weight, "heavy": 1.0}))
    queue(core, "heavy", 5, 100)
    for i, size in enumerate(sizes):
        core.enqueue(Leg(f"light-{i}"), 0.5, Task(f"light-{i}", "light", size))
    core.pump()
    admitted: list[str] = []
    bound = sum(sizes) / weight / 100 + 5 + len(sizes)  # heavy ones before the last light one
    for k in range(int(bound) + flood):  # the heavy tenant: one more arriving per admission
        core.enqueue(Leg(f"heavy-x{k}"), 1.0 + k, Task(f"heavy-x{k}", "heavy", 100))
        if d.asks and d.asks[-1][0] not in admitted:
            admitted += admit_all(core, d, 1)
    light_done = [i for i, n in enumerate(admitted) if n.startswith("light")]
    assert len(light_done) == len(sizes) and light_done[-1] <= bound


def test_the_router_config_names_the_order_and_rejects_unknown_or_bad_weights() -> None:
    assert RouterConfig(admission_order="wfq", tenant_weights={"g": 2.0}).admission_order == "wfq"
    with pytest.raises(ValueError, match="unknown decode admission order 'lottery'"):
        RouterConfig(admission_order="lottery")
    with pytest.raises(ValueError, match="tenant weights must be > 0"):
        RouterConfig(admission_order="wfq", tenant_weights={"g": 0.0})


def test_the_fair_order_forgets_tenants_once_they_are_behind_or_the_queue_empties() -> None:
    d = Driver(["w0"])
    core = AdmissionCore(d, order := TenantFairOrder())
    for i in range(300):  # one-off tenants (clients name them), each tagged at its turn
        core.enqueue(Leg(f"c{i}"), float(i), Task(f"c{i}", f"client-{i}", 10))
        core.enqueue(Leg(f"s{i}"), float(i), Task(f"s{i}", "steady", 10))
    core.pump()
    admit_all(core, d, 400)
    assert len(order._finish) <= len(core.waiters) + 2  # noqa: SLF001 - the memory bound
    admit_all(core, d, 1000)
    assert not core.waiters and not order._finish  # noqa: SLF001
    assert order.key(0.0, "late", 10)[0] == order.vtime  # a newcomer starts at the present


def test_the_contended_admissions_reach_the_stats_and_the_fairness_study() -> None:
    from types import SimpleNamespace

    from bench.studies.fairness import admission_shares
    from bench.studies.service import RunOutput, merge_runs
    from cluster.grpc.convert import stats_from_proto, stats_to_proto
    from cluster.router.types import ClusterStats

    stats = ClusterStats((), admission_contended_tokens={"gold": 600, "free": 300})
    back = stats_from_proto(stats_to_proto(stats, serving=True))  # GetStats' wire
    assert back.admission_contended_tokens == {"gold": 600, "free": 300}
    runs = [RunOutput([], [], admission_tokens={"gold": 400, "free": 100}),
            RunOutput([], [], admission_tokens={"gold": 200, "free": 200})]
    merged = merge_runs(runs)
    assert merged.admission_tokens == {"gold": 600, "free": 300}
    shares = admission_shares(SimpleNamespace(output=merged))
    assert shares == pytest.approx({"gold": 2 / 3, "free": 1 / 3})
    alone = RunOutput([], [], admission_tokens={"gold": 5})
    assert admission_shares(SimpleNamespace(output=alone)) is None  # one tenant: no contention


def admit_holding(core: AdmissionCore, d: Driver, limit: int) -> list[str]:
    """admit_all, where each admitted leg holds its tokens from then on (as the router
    holds a placed leg's until it ends)."""
    out: list[str] = []
    answered = 0
    while core.waiters and len(out) < limit and answered < len(d.asks):
        leg, worker, _ = d.asks[answered]  # every ask is granted, in the order they went
        answered += 1
        wt = next((w for w in core.waiters if w.task.leg_id == leg), None)
        if wt is None or wt.asking != worker:
            continue  # (a grant given back: an earlier waiter asks that worker again)
        core.answered(wt, worker, True, core.round)
        for w in [w for w in core.waiters if w.granted is not None]:
            assert core.take(w) == worker
            core.hold(w.task.tenant, w.task.prompt_len)
            out.append(w.task.leg_id)
            core.leave(w)
    return out


def test_a_tenant_holding_its_share_of_the_room_waits_while_another_is_within_its_own():
    """free holds 400 of a 900-token pool (its share beside gold at 2 : 1 is 300): gold's
    waiters go first, though free's came first, until gold holds its 600; then the queue's
    order again. Alone, a tenant past any share is served (the pool is work-conserving)."""
    d = Driver(["w0"])
    d.room = 900
    core = AdmissionCore(d, TenantFairOrder({"gold": 2.0, "free": 1.0}))
    core.hold("free", 400)
    queue(core, "free", 4, 100)
    queue(core, "gold", 8, 100, t0=1.0)
    core.pump()
    order = admit_holding(core, d, 12)
    assert order[:6] == [f"gold-{i}" for i in range(6)]  # gold reaches its 600
    assert core.held == {"free": 800, "gold": 800} and not core.waiters
    for tenant, n in (("free", 800), ("gold", 800)):
        core.unhold(tenant, n)
    assert core.held == {}  # nothing kept of a tenant that holds nothing
    core.hold("free", 900)
    queue(core, "free", 2, 100, t0=2.0)
    core.pump()
    assert admit_holding(core, d, 2) == ["free-0", "free-1"]  # alone: past its share, served


def test_within_share_is_the_tenants_weighted_share_of_the_live_pool():
    d = Driver(["w0"])
    d.room = 900
    core = AdmissionCore(d, TenantFairOrder({"gold": 2.0}))
    core.hold("free", 250)
    core.hold("gold", 100)
    assert core.within_share("free", 50) and not core.within_share("free", 51)  # 300 of 900
    assert core.within_share("gold", 500) and not core.within_share("gold", 501)  # 600
    # a third tenant beside both (weights 2 + 1 + 1): a quarter; a waiting one counts too
    assert core.within_share("new", 225) and not core.within_share("new", 226)
    assert not core.within_share("free", 1, waiting=("new",))  # now 225 of 900: past it
    core.unhold("gold", 100)
    core.unhold("free", 250)
    assert core.within_share("free", 10**6)  # alone: all of it
    fcfs = AdmissionCore(d, make_admission_order("fcfs"))
    fcfs.hold("free", 10**6)
    assert fcfs.within_share("free", 10**6)  # arrival order shares nothing
