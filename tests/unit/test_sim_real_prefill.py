"""The simulator's prefill workers run prefill_worker/engine.py PrefillEngine itself (on
sim/executor.py's clock, runner and sender), not a copy: a change to the engine shows up
in a simulated run with no edit under sim/."""

from __future__ import annotations

from bench.workload import WorkloadRequest
from engine.costs.loader import load_costs
from prefill_worker.engine import PrefillEngine
from runtime.messages import EventKind
from sim.adapters import ServeConfig
from sim.cluster import Simulation
from sim.synthetic import synthetic_calibration

MAX_LEN = 1024


def run() -> tuple[list, Simulation]:
    cal = synthetic_calibration(prefill=lambda c, p: 0.001 + 1e-5 * c,
                                decode=lambda b, L: 0.004, rpc_s=1e-4)
    cfg = ServeConfig().with_values({
        "transfer.connector": "inproc", "cache.num_blocks": 512, "model.max_model_len": MAX_LEN,
        "scheduler.max_prefill_chunk": 256, "cache.enable_prefix_caching": False})
    sim = Simulation(cfg, load_costs(cal))
    reqs = [WorkloadRequest(f"r{i}", 0.003 * i, [i + 1] * (300 + 50 * i), max_tokens=8)
            for i in range(6)]
    records = sim.run(reqs).records()
    sim.check_quiescent()
    return records, sim


def test_the_engines_first_token_event_is_what_the_client_sees_first(monkeypatch) -> None:
    """Drop the FIRST_TOKEN event of PrefillEngine's first-token path: the first token
    then reaches the client only in the decode's first step (it rides the final KV
    chunk), later; and no leg reports a prefill phase."""
    base, sim = run()
    assert all(r.success for r in base)
    assert sum(w.engine.num_steps for w in sim.prefill) > 0
    ship = PrefillEngine._ship

    def no_first_token_event(self, *args, **kwargs):
        return [e for e in ship(self, *args, **kwargs) if e.kind is not EventKind.FIRST_TOKEN]

    monkeypatch.setattr(PrefillEngine, "_ship", no_first_token_event)
    changed, _ = run()
    assert all(r.success for r in changed)
    assert [r.output_len for r in changed] == [r.output_len for r in base]
    assert all(r.prefill_s == 0.0 for r in changed) and all(r.prefill_s > 0 for r in base)
    for a, b in zip(base, changed, strict=True):
        assert b.ttft > a.ttft, (a.request_id, a.ttft, b.ttft)


def test_a_prompt_the_real_worker_refuses_fails_in_the_simulator() -> None:
    """PrefillEngine.add refuses a prompt that leaves no room for a generated token
    (validate_prompt); the simulated request fails as the service's does."""
    cal = synthetic_calibration(prefill=lambda c, p: 0.001, decode=lambda b, L: 0.004)
    cfg = ServeConfig().with_values({
        "transfer.connector": "inproc", "cache.num_blocks": 512, "model.max_model_len": MAX_LEN})
    sim = Simulation(cfg, load_costs(cal))
    reqs = [WorkloadRequest("ok", 0.0, [3] * (MAX_LEN - 1), max_tokens=1),
            WorkloadRequest("long", 0.001, [3] * MAX_LEN, max_tokens=1)]
    ok, long = sim.run(reqs).records()
    sim.check_quiescent()
    assert ok.success
    assert not long.success and "max_model_len" in long.error
