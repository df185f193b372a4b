"""Each request's drawn dispatch and first-token delivery (tools/sim_scaled.py ScaledCosts
``arrival``, measured per request by tools/sim_validate_fits.py arrival_residuals): a
request draws one real request's pair, the router's add waits its dispatch part and the
prefill worker's first token its delivery part."""

from __future__ import annotations

import pytest

from bench.workload import WorkloadSpec, build_workload
from engine.costs.analytic import analytic_calibration
from engine.costs.loader import load_costs
from sim.adapters import ServeConfig
from sim.cluster import Simulation
from sim.options import SimOptions
from tools.sim_scaled import ScaledCosts

MS = 1e-3
BASE = load_costs(analytic_calibration("h200", "llama-3-8b"))


def _costs(arrival=(), seed: int = 0) -> ScaledCosts:
    return ScaledCosts(BASE, {"prefill": 1.0, "decode": 1.0}, "t", arrival=arrival, seed=seed)


def _run(arrival=(), n: int = 1):
    cfg = ServeConfig().with_values({"pools.prefill_workers": 1, "pools.decode_workers": 1})
    sim = Simulation(cfg, _costs(arrival), SimOptions(interconnect="infiniband", trace=True))
    out = sim.run(build_workload(WorkloadSpec(num_requests=n, request_rate=2, seed=1,
                                              vocab_range=(1, 1000))))
    sim.check_quiescent()
    chunks = {e.request_id.split("#")[0]: e.start for e in reversed(out.events)
              if e.phase == "prefill_chunk"}  # each request's first chunk
    return {r.request_id: (r.token_times[0] - r.send_time, chunks[r.request_id] - r.send_time)
            for r in out.records()}


def test_a_request_waits_its_drawn_dispatch_before_its_add_and_delivery_after_its_prefill(
) -> None:
    (rid, (ttft, start)), = _run().items()
    (_, (ttft2, start2)), = _run([(3 * MS, 2 * MS)]).items()
    assert start2 - start == pytest.approx(3 * MS, abs=1e-9)
    assert ttft2 - ttft == pytest.approx(5 * MS, abs=1e-9)
    # faster than the model: the message and the delivery take no less than nothing
    (_, (ttft3, start3)), = _run([(-1.0, -1.0)]).items()
    assert start3 < start and ttft3 < ttft and start3 >= 0


def test_a_request_draws_one_real_requests_pair_by_its_id_and_each_seed_others() -> None:
    pairs = [(k * MS, -k * MS) for k in range(16)]
    ids = [f"r{i}" for i in range(64)]
    draws = {seed: [_costs(pairs, seed).arrival_extra_s(r) for r in ids] for seed in (0, 1)}
    assert set(draws[0]) <= set(pairs)  # a real request's two figures, together
    assert draws[0] == [_costs(pairs).arrival_extra_s(r) for r in reversed(ids)][::-1]
    assert draws[0] != draws[1]
    assert len(set(draws[0])) > 8  # spread over the measured requests
    assert _costs().arrival_extra_s("r0") == (0.0, 0.0) and not _costs().arrival_spread
    assert "first-token delivery drawn from 16 real requests" in _costs(pairs).label
    with pytest.raises(ValueError, match="arrival spread must be finite"):
        _costs([(float("inf"), 0.0)])


def test_every_request_of_a_run_draws_its_own_and_nothing_is_left_behind() -> None:
    plain, drawn = _run(n=12), _run([(k * MS, 0.0) for k in range(8)], n=12)
    moved = [drawn[r][1] - plain[r][1] for r in plain]
    assert len({round(x, 6) for x in moved}) > 2 and min(moved) >= -1e-9
