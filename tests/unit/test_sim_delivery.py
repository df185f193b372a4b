"""The control plane's delivery model (engine/costs/delivery.py), its fit to measured streams, its
use in a simulated run, and the contention-scaled cost model (tools/sim_scaled.py)."""

from __future__ import annotations

import numpy as np
import pytest

from bench.workload import WorkloadRequest
from engine.costs.calibration import Calibration, CalibrationError
from engine.costs.delivery import Delivery, fit_delivery
from engine.costs.loader import load_costs
from engine.costs.model import TableCosts
from sim.adapters import ServeConfig
from sim.cluster import Simulation
from sim.options import SimOptions
from sim.synthetic import synthetic_calibration
from tools.sim_scaled import ScaledCosts

MS = 1e-3


def test_without_a_gap_each_step_arrives_token_s_after_it() -> None:
    ends = np.array([0.0, 1.0, 2.5]) * MS
    assert Delivery(0.0, 0.4 * MS).arrivals(ends) == pytest.approx(ends + 0.4 * MS)


def test_steps_that_end_while_the_path_is_busy_go_together_once_it_is_free() -> None:
    d = Delivery(0.0, 0.5 * MS, gap_s=2.5 * MS, scope="worker")
    # step 0 taken at once; the path is busy until 2.5 ms: steps 1 and 2 go then; busy
    # again until 5 ms: step 3 goes then; busy until 7.5 ms: step 4 (6 ms) goes then;
    # step 5 ends after the path is free again: taken at once
    ends = np.array([0.0, 1.0, 2.0, 3.0, 6.0, 10.5]) * MS
    assert d.arrivals(ends) / MS == pytest.approx([0.5, 3.0, 3.0, 5.5, 8.0, 11.0])


def test_an_event_in_the_gap_after_an_empty_poll_waits_for_the_next_poll() -> None:
    d = Delivery(0.0, 0.0, gap_s=1 * MS, scope="worker", poll_timeout_s=50 * MS)
    # after step 0 the next poll is armed at 1 ms, times out at 51 ms, re-armed at 52 ms
    inside = d.arrivals(np.array([0.0, 50.5 * MS]))
    in_gap = d.arrivals(np.array([0.0, 51.5 * MS]))
    assert inside[1] == pytest.approx(50.5 * MS)
    assert in_gap[1] == pytest.approx(52 * MS)


def test_bad_delivery_figures_are_rejected_by_name() -> None:
    with pytest.raises(ValueError, match="gap_s"):
        Delivery(0.0, 0.0, gap_s=-1.0)
    with pytest.raises(ValueError, match="scope"):
        Delivery(0.0, 0.0, scope="nowhere")


def test_the_fit_reproduces_the_delays_of_the_mechanism_that_made_the_streams() -> None:
    truth = Delivery(0.0, 0.6 * MS, gap_s=1.8 * MS, scope="worker", poll_timeout_s=0.05,
                     stall_s=8 * MS, stall_every=8)
    rng = np.random.default_rng(0)
    streams = []
    for _ in range(6):
        ends = np.cumsum(rng.uniform(0.5, 1.5, 24)) * MS
        streams.append((ends, truth.arrivals(ends)))
    got, err = fit_delivery(streams, first_token_s=0.0, scope="worker", poll_timeout_s=0.05)
    assert err < 0.3 * MS  # the truth lies between grid points
    lags = lambda d: np.concatenate([d.arrivals(e) - e for e, _ in streams])  # noqa: E731
    # the distribution, not the figures: a shorter token_s with a shorter gap fits too
    assert np.percentile(lags(got), 50) == pytest.approx(np.percentile(lags(truth), 50),
                                                         abs=0.4 * MS)
    assert np.percentile(lags(got), 99) == pytest.approx(np.percentile(lags(truth), 99),
                                                         rel=0.15)
    assert got.stall_every > 0  # the long delays come from stalls, not from a long gap


def test_a_stall_holds_every_nth_delivery_longer() -> None:
    d = Delivery(0.0, 0.0, gap_s=1 * MS, scope="worker", stall_s=5 * MS, stall_every=2)
    # deliveries at 0 (path busy to 1 ms) and 1 ms (2nd: busy to 1 + 1 + 5 = 7 ms)
    ends = np.array([0.0, 0.5, 2.0, 3.0]) * MS
    assert d.arrivals(ends) / MS == pytest.approx([0.0, 1.0, 7.0, 7.0])


def test_exp_stalls_come_in_many_sizes_with_the_fixed_ones_mean() -> None:
    kw = {"gap_s": 1 * MS, "scope": "worker", "stall_s": 5 * MS, "stall_every": 2}
    fixed, exp = Delivery(0.0, 0.0, **kw), Delivery(0.0, 0.0, **kw, stall_shape="exp")
    steps = np.arange(20_000) * 0.1 * MS  # a step every 0.1 ms: each delivery takes what queued

    def stalls(d: Delivery) -> np.ndarray:  # the path's hold beyond the gap, per delivery
        return np.diff(np.unique(d.arrivals(steps))) - d.gap_s

    assert stalls(fixed)[:8] / MS == pytest.approx([0, 5, 0, 5, 0, 5, 0, 5], abs=1e-6)
    got = stalls(exp)
    assert got[0::2][:64] == pytest.approx(0.0, abs=1e-9)  # still every 2nd delivery
    sizes = got[1::2][:64]  # one cycle of the multipliers: the fixed stall's mean
    assert np.mean(sizes) == pytest.approx(5 * MS, rel=1e-6)
    assert len(set(np.round(sizes / MS, 6))) == 64 and sizes.max() > 4 * 5 * MS
    with pytest.raises(ValueError, match="stall_shape"):
        Delivery(0.0, 0.0, stall_shape="gamma")


def _sim(delivery: Delivery, *, stream_interval: int = 1, decode_workers: int = 1,
         decode_order: str = "least-kv-usage") -> Simulation:
    cal = synthetic_calibration(prefill=lambda c, p: 0.010, decode=lambda b, L: 0.001,
                                rpc_s=0.001, delivery=delivery)
    cfg = ServeConfig().with_values({
        "transfer.connector": "inproc", "cache.enable_prefix_caching": False,
        "cache.num_blocks": 256, "model.max_model_len": 2048,
        "server.stream_interval": stream_interval, "pools.decode_workers": decode_workers})
    return Simulation(cfg, load_costs(cal), SimOptions(decode_order=decode_order))


def test_a_run_delivers_the_first_token_and_coalesced_decode_tokens_as_measured() -> None:
    req = WorkloadRequest("r0", 0.0, list(range(1, 33)), max_tokens=9)
    plain = _sim(Delivery(0.001, 0.001)).run([req]).records()[0]
    slow = _sim(Delivery(0.0015, 0.001, gap_s=0.0025, scope="worker")).run([req]).records()[0]
    # the first token 0.5 ms later (still before decode's first step: see below); the
    # decode steps (1 ms apart) reach the client in groups: the first alone, then what
    # ended during each 2.5 ms gap
    assert slow.ttft == pytest.approx(plain.ttft + 0.0005, abs=1e-12)
    assert min(plain.itls[1:]) == pytest.approx(0.001, abs=1e-12)
    decode_itls = np.array(slow.itls[1:])
    assert (decode_itls < 1e-9).sum() >= 3  # tokens that came together
    assert slow.token_times[-1] >= plain.token_times[-1]


def test_a_late_prefill_message_loses_the_first_token_to_decodes_first_step() -> None:
    """cluster/router/events.py: decode's first step of a leg carries its first token, and
    the router streams whichever copy comes first (the other is dropped)."""
    req = WorkloadRequest("r0", 0.0, list(range(1, 33)), max_tokens=9)
    plain = _sim(Delivery(0.001, 0.001)).run([req]).records()[0]
    late = _sim(Delivery(0.050, 0.001)).run([req]).records()[0]
    assert plain.token_times[1] - plain.token_times[0] > 0.0005  # prefill's copy first
    # 49 ms late: the first token comes with decode's first step's (token 2) delivery,
    # once, and the decode tokens are not held for the prefill's message
    assert len(late.token_times) == len(plain.token_times) == 9
    assert late.token_times[0] == late.token_times[1] == plain.token_times[1]
    assert late.token_times[1:] == plain.token_times[1:]


def test_the_delivery_model_survives_the_calibration_file() -> None:
    d = Delivery(0.001, 0.0005, gap_s=0.0002, scope="router", stall_s=0.004, stall_every=8)
    cal = synthetic_calibration(prefill=lambda c, p: 0.01, decode=lambda b, L: 0.001,
                                delivery=d)
    assert TableCosts(Calibration(cal.data, "cal.json")).delivery == d


def test_a_calibration_without_its_delivery_model_is_an_error_naming_it() -> None:
    data = synthetic_calibration(prefill=lambda c, p: 0.01, decode=lambda b, L: 0.001).data
    del data["control"]["delivery"]
    with pytest.raises(CalibrationError, match=r"missing entry 'control.delivery'"):
        _ = TableCosts(Calibration(data, "cal.json")).delivery


def test_contention_factors_scale_compute_per_role_and_the_control_plane_links_on_request(
        ) -> None:
    base = load_costs(synthetic_calibration(
        prefill=lambda c, p: 0.01, decode=lambda b, L: 0.002, sample_s=1e-4,
        step_overhead_s=2e-4, link_latency_s=5e-4, rpc_s=1e-3))
    s = ScaledCosts(base, {"prefill": 1.5, "decode": 2.0}, "probe")
    assert s.prefill_s([(64, 0)]) == pytest.approx(0.015)
    assert s.step_overhead_s("prefill", 1) == pytest.approx(3e-4)
    assert s.decode_s(1, 100) == pytest.approx(0.004)
    assert s.sample_s(1) == pytest.approx(2e-4)
    assert s.step_overhead_s("decode", 1) == pytest.approx(4e-4)
    assert s.link("inproc") == base.link("inproc")
    assert s.rpc_s == base.rpc_s and s.delivery == base.delivery
    assert "x1.50 prefill, x2.00 decode, control plane x1.00, KV link x1.00 (probe)" in s.label
    c = ScaledCosts(base, {"prefill": 1.0, "decode": 1.0, "control": 3.0}, "probe")
    assert c.rpc_s == pytest.approx(3e-3)
    assert c.delivery.token_s == pytest.approx(3 * base.delivery.token_s)
    assert c.prefill_s([(64, 0)]) == pytest.approx(0.01)
    with pytest.raises(ValueError, match="contention factors"):
        ScaledCosts(base, {"prefill": 1.0}, "probe")
    with pytest.raises(ValueError, match="contention factors"):
        ScaledCosts(base, {"prefill": 1.0, "decode": 1.0, "link": 0.0}, "probe")


def test_a_link_factor_slows_every_write_and_a_delivery_under_load_replaces_the_idle_one(
        ) -> None:
    base = load_costs(synthetic_calibration(
        prefill=lambda c, p: 0.01, decode=lambda b, L: 0.002, link_latency_s=5e-4,
        rpc_s=1e-3))
    loaded = Delivery(0.004, 0.002, gap_s=0.001, scope="router", stall_s=0.01, stall_every=8)
    s = ScaledCosts(base, {"prefill": 1.0, "decode": 1.0, "control": 2.0, "link": 3.0},
                    "probe", delivery=loaded)
    idle = base.link("inproc")
    assert s.link("inproc").write_s(1 << 20) == pytest.approx(3 * idle.write_s(1 << 20))
    assert s.delivery == loaded  # fitted under load: not scaled again
    assert s.rpc_s == pytest.approx(2e-3)
    assert "KV link x3.00, delivery fitted under load (probe)" in s.label


def test_stream_interval_releases_decode_tokens_k_at_a_time_after_the_first() -> None:
    req = WorkloadRequest("r0", 0.0, list(range(1, 33)), max_tokens=8)
    one = _sim(Delivery(0.001, 0.001)).run([req]).records()[0]
    sim = _sim(Delivery(0.001, 0.001), stream_interval=3)
    t = sim.run([req]).records()[0].token_times
    u = one.token_times
    # the first at once; decode tokens 1-3 with the 3rd, 4-6 with the 6th, the 7th alone
    assert t == pytest.approx((u[0], u[3], u[3], u[3], u[6], u[6], u[6], u[7]), abs=1e-12)


def test_one_router_path_coalesces_the_steps_of_every_decode_worker() -> None:
    reqs = [WorkloadRequest(f"r{i}", 0.0, list(range(1 + i, 33 + i)), max_tokens=12)
            for i in range(2)]

    def deliveries(scope: str) -> np.ndarray:
        sim = _sim(Delivery(0.001, 0.001, gap_s=0.0015, scope=scope), decode_workers=2,
                   decode_order="least-legs")
        out = sim.run(reqs).records()
        assert all(len(s.step_times) for s in sim.decode)  # both workers decoded
        return np.unique(np.concatenate([r.token_times[1:] for r in out]))

    # one path for the router: its deliveries are a gap apart whichever worker they serve;
    # a path per worker: the two workers' deliveries interleave closer than that
    assert np.diff(deliveries("router")).min() >= 0.0015 - 1e-12
    assert np.diff(deliveries("worker")).min() < 0.0015 - 1e-9


def test_the_fit_finds_a_coalescing_gap_between_its_grid_points() -> None:
    # a gap just above the decode period sets the ITL p50: the grid's 10% steps are refined
    truth = Delivery(0.0, 0.1 * MS, gap_s=0.5 * MS, scope="router")
    rng = np.random.default_rng(1)
    streams = []
    for _ in range(8):
        ends = np.cumsum(rng.uniform(0.4, 0.55, 40)) * MS
        streams.append((ends, truth.arrivals(ends)))
    got, err = fit_delivery(streams, first_token_s=0.0, scope="router", poll_timeout_s=None)
    itl = lambda d: np.concatenate([np.diff(d.arrivals(e)) for e, _ in streams])  # noqa: E731
    assert np.median(itl(got)) == pytest.approx(np.median(itl(truth)), rel=0.02)
    assert got.gap_s == pytest.approx(0.5 * MS, rel=0.02) and err < 0.02 * MS
