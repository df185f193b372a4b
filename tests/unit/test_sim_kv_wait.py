"""KV-wait expiry on the simulated clock: a decode reservation whose prefill waits in a
queue longer than ``limits.kv_wait_timeout_s`` expires and its leg is re-dispatched, as
DecodeEngine._expire does; the router's keepalive (every ``kv_keepalive_s``) restarts the
wait of legs whose prefill is still queued, so a timeout longer than the keepalive
period never fires. Fast stepping gives the run exact stepping gives."""

from __future__ import annotations

import pytest

from bench.workload import LengthDist, WorkloadSpec, build_workload
from engine.costs.analytic import analytic_calibration
from engine.costs.loader import load_costs
from sim.adapters import RouterConfig, ServeConfig
from sim.cluster import Simulation
from sim.decode import SimDecode
from sim.options import SimOptions

KEEPALIVE_S = RouterConfig().kv_keepalive_s


def queued_run(timeout_s: float, stepping: str = "fast"):
    """40 prompts of ~3000 tokens at once on 1P1D: the last waits seconds in the queue
    while its decode reservation holds."""
    cfg = ServeConfig().with_values({
        "pools.prefill_workers": 1, "pools.decode_workers": 1, "model.max_model_len": 4096,
        "limits.kv_wait_timeout_s": timeout_s})
    spec = WorkloadSpec(num_requests=40, request_rate=4000, mix="long-doc", seed=5,
                        vocab_range=(1, 1000), prompt_len=LengthDist.uniform(2800, 3200),
                        output_len=LengthDist.uniform(16, 32))
    sim = Simulation(cfg, load_costs(analytic_calibration("h200", "llama-3-8b")),
                     SimOptions(interconnect="infiniband", decode_stepping=stepping))
    result = sim.run(build_workload(spec))
    sim.check_quiescent()
    return sim, result


def test_a_reservation_waiting_longer_than_the_timeout_expires_and_is_redispatched():
    timeout = KEEPALIVE_S / 5
    _, result = queued_run(timeout)
    queue_s = max(f.timing.get("queue_s", 0.0) for f in result.flights)
    failures = sum(f.failures for f in result.flights)
    assert failures > 0, f"no expiry (longest prefill queue {queue_s:.2f} s)"
    _, exact = queued_run(timeout, "exact")
    assert exact.records() == result.records()
    assert [f.failures for f in exact.flights] == [f.failures for f in result.flights]


@pytest.mark.parametrize("timeout_factor", [1.5, 60.0])
def test_keepalives_keep_a_queued_reservation_alive(timeout_factor):
    sim, result = queued_run(KEEPALIVE_S * timeout_factor)
    assert all(f.failures == 0 and not f.error for f in result.flights)
    # the queue was longer than the timeout: only the keepalives kept the legs
    last = max(r.ttft for r in result.records())
    assert timeout_factor > 10 or last > KEEPALIVE_S * timeout_factor


class _ScanEveryStep(SimDecode):
    """DecodeEngine._expire as the real step runs it: a scan of the pending legs at every
    step, with no armed check to skip it."""

    def start_step(self):
        self._expiry_due = True
        return super().start_step()


def test_skipping_the_scan_before_the_armed_check_changes_nothing(monkeypatch):
    timeout = KEEPALIVE_S / 5
    _, skipped = queued_run(timeout)
    monkeypatch.setattr("sim.cluster.SimDecode", _ScanEveryStep)
    sim, scanned = queued_run(timeout)
    assert isinstance(sim.decode[0], _ScanEveryStep)
    assert sum(f.failures for f in scanned.flights) > 0
    assert scanned.records() == skipped.records()
    assert [f.failures for f in scanned.flights] == [f.failures for f in skipped.flights]
