"""The simulator's decode admission is the router's own (cluster/router/admission.py
AdmissionCore, driven on the simulated clock by sim/admission.py): several reserve calls in
flight at once, one per decode worker, grants kept in arrival order, a waiter refused by
every worker blocks those behind it. Each run ends with the simulator's leak check."""

from __future__ import annotations

import pytest

from bench.workload import WorkloadRequest
from engine.costs.loader import load_costs
from sim.adapters import AdmissionCore, ServeConfig
from sim.cluster import Simulation
from sim.options import SimOptions
from sim.synthetic import synthetic_calibration

RPC_S = 0.001


def _sim(decode_workers: int, num_blocks: int = 256,
         reserve_with_add: bool = False, step_s: float = 0.001) -> tuple[Simulation, list]:
    """1P/nD, every call RPC_S one way; records (time, request, decode worker) of each
    placement (a kept grant). The queued admission's tests send no reserve with the add
    (as the router's: tests/unit/test_admission_parallel.py)."""
    cal = synthetic_calibration(prefill=lambda c, p: 0.010, decode=lambda b, L: step_s,
                                rpc_s=RPC_S)
    cfg = ServeConfig().with_values({
        "transfer.connector": "inproc", "cache.enable_prefix_caching": False,
        "cache.num_blocks": num_blocks, "cache.block_size": 16, "model.max_model_len": 2048,
        "pools.decode_workers": decode_workers, "pools.reserve_with_add": reserve_with_add})
    sim = Simulation(cfg, load_costs(cal), SimOptions(decode_order="least-kv-usage"))
    placed: list = []
    place = sim.router.place

    def record(flight, decode) -> None:
        placed.append((sim.loop.now, flight.req.request_id, decode.worker_id))
        place(flight, decode)

    sim.router.place = record
    return sim, placed


def _req(rid: str, prompt_len: int, at: float = 0.0, max_tokens: int = 4) -> WorkloadRequest:
    return WorkloadRequest(rid, at, list(range(1, prompt_len + 1)), max_tokens=max_tokens)


def test_the_simulator_runs_the_routers_admission_core() -> None:
    sim, _ = _sim(2)
    assert isinstance(sim.router.admission.core, AdmissionCore)


def test_a_burst_is_admitted_by_reserves_in_flight_on_every_worker_at_once() -> None:
    """Four requests at one instant, four decode workers: each waiter asks another worker
    and all four grants are kept when the answers land (the old head-only admission asked
    one worker at a time: four round trips)."""
    sim, placed = _sim(4)
    result = sim.run([_req(f"r{i}", 32) for i in range(4)])
    sim.check_quiescent()
    assert [rid for _, rid, _ in placed] == ["r0", "r1", "r2", "r3"]  # arrival order
    assert len({t for t, _, _ in placed}) == 1  # one round trip for all
    assert sorted(w for _, _, w in placed) == [f"decode-{i}" for i in range(4)]
    assert placed[0][0] < 3 * RPC_S  # reserve there, answer back (+ one step boundary)
    assert all(len(r.token_times) == 4 for r in result.records())


def test_a_waiter_refused_everywhere_keeps_its_place_ahead_of_smaller_ones() -> None:
    """Two workers of 10 blocks (160 tokens) each hold 100 tokens; 'big' (120 tokens)
    fits neither, then 'small' (16) would fit both: it waits behind big, which goes first
    once a holder finishes."""
    sim, placed = _sim(2, num_blocks=10)
    work = [_req("h0", 96, 0.0, max_tokens=40), _req("h1", 96, 0.0, max_tokens=400),
            _req("big", 110, 0.005), _req("small", 8, 0.006)]
    result = sim.run(work)
    sim.check_quiescent()
    order = [rid for _, rid, _ in placed]
    assert order == ["h0", "h1", "big", "small"]
    when = {rid: t for t, rid, _ in placed}
    h0_end = next(r.end_time for r in result.records() if r.request_id == "h0")
    assert when["big"] > h0_end  # it waited for room: it was refused by both
    assert when["small"] >= when["big"]  # and small did not go ahead of it
    assert all(r.success for r in result.records())


def test_a_later_waiters_tentative_grant_goes_back_when_the_head_needs_that_worker() -> None:
    """decode-0 is busy stepping 'h' and has no room for 'head'; 'next' (same instant)
    asks the idle decode-1, whose answer lands first: a tentative grant. Refused by
    decode-0, head asks decode-1, and next's room there is given back first."""
    sim, placed = _sim(2, num_blocks=10)
    calls: list[tuple[str, str]] = []
    d1 = sim.decode[1]
    reserve, abort = d1.reserve, d1.abort

    def on_reserve(task, reply) -> None:
        calls.append(("reserve", task.leg_id.split("#")[0]))
        reserve(task, reply)

    def on_abort(leg_id: str) -> None:
        calls.append(("abort", leg_id.split("#")[0]))
        abort(leg_id)

    d1.reserve, d1.abort = on_reserve, on_abort
    work = [_req("h", 96, 0.0, max_tokens=60), _req("head", 100, 0.010),
            _req("next", 8, 0.010)]
    result = sim.run(work)
    sim.check_quiescent()
    assert calls[:3] == [("reserve", "next"), ("abort", "next"), ("reserve", "head")], calls
    on = {rid: w for _, rid, w in placed}
    assert on["head"] == "decode-1" and [rid for _, rid, _ in placed][:2] == ["h", "head"]
    assert all(r.success for r in result.records())


def test_one_retry_tick_runs_every_retry_s_while_requests_wait() -> None:
    """As DecodeAdmission._retry: one tick RETRY_S after the queue stops being empty, then
    every RETRY_S until it is empty again; a tick left from an emptied queue does nothing.
    'big' waits ~0.6 s for room behind a holder of 60 decode steps of 10 ms."""
    from sim.adapters import ADMISSION_RETRY_S

    sim, placed = _sim(1, num_blocks=10, step_s=0.01)
    adm = sim.router.admission
    ticks: list[tuple[float, int]] = []
    retry = adm._retry

    def record(tick: int) -> None:
        if tick == adm._tick and adm.core.waiters:
            ticks.append((sim.loop.now, len(adm.core.waiters)))
        retry(tick)

    queued: list[float] = []  # when a request joined an empty queue
    enqueue = adm.enqueue

    def join(flight, refused=None) -> None:
        if not adm.core.waiters:
            queued.append(sim.loop.now)
        enqueue(flight, refused)

    adm._retry, adm.enqueue = record, join
    result = sim.run([_req("h", 96, 0.0, max_tokens=60), _req("big", 110, 0.005)])
    sim.check_quiescent()
    when = {rid: t for t, rid, _ in placed}
    t0 = queued[-1]  # big's (h's own wait ended at its grant, before big came)
    n = int((when["big"] - t0) // ADMISSION_RETRY_S)
    assert n >= 2  # it waited through ticks
    assert [t for t, _ in ticks] == pytest.approx(
        [t0 + k * ADMISSION_RETRY_S for k in range(1, n + 1)], abs=1e-12)
    assert all(w == 1 for _, w in ticks) and all(r.success for r in result.records())
