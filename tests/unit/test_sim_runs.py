"""Whole simulated runs: determinism (event order, hash seeds), fast decode stepping equal
to the real scheduler run step by step (preemptions included), bench metrics from arrays
equal to bench.metrics over records, and every run ends with nothing held anywhere."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.metrics import compute_metrics
from bench.workload import LengthDist, TenantSpec, WorkloadSpec, build_workload
from engine.costs.analytic import analytic_calibration
from engine.costs.loader import load_costs
from sim.adapters import ServeConfig
from sim.cluster import Simulation
from sim.loop import EventLoop
from sim.metrics import fast_metrics
from sim.options import SimOptions

ROOT = Path(__file__).resolve().parents[2]


def pressure_run(stepping: str, **overrides) -> tuple[Simulation, list]:
    """2P2D on an analytic H200 with a decode pool small enough to preempt."""
    cfg = ServeConfig().with_values({
        "pools.prefill_workers": 2, "pools.decode_workers": 2, "model.max_model_len": 4096,
        "cache.num_blocks": 300, "scheduler.fairness_policy": "srpt", **overrides})
    spec = WorkloadSpec(num_requests=240, request_rate=60, mix="mixed", seed=3,
                        vocab_range=(1, 1000), long_prompt_len=LengthDist.uniform(1000, 3000),
                        tenants=(TenantSpec("gold", 0.3, 2.0), TenantSpec("free", 0.7, 1.0)))
    sim = Simulation(cfg, load_costs(analytic_calibration("h200", "llama-3-8b")),
                     SimOptions(interconnect="infiniband", decode_stepping=stepping))
    result = sim.run(build_workload(spec))
    sim.check_quiescent()
    return sim, result


def test_event_loop_runs_in_time_order_and_ties_in_scheduling_order() -> None:
    loop, seen = EventLoop(), []
    loop.at(2.0, seen.append, "c")
    loop.at(1.0, seen.append, "a")
    loop.at(1.0, seen.append, "b")
    loop.at(1.0, lambda: loop.after(0.0, seen.append, "d"))  # same time, scheduled later
    loop.run()
    assert seen == ["a", "b", "d", "c"] and loop.now == 2.0
    with pytest.raises(ValueError, match="before now"):
        loop.at(1.5, seen.append, "x")


def test_fast_stepping_gives_the_run_the_real_scheduler_gives_step_by_step() -> None:
    exact_sim, exact = pressure_run("exact")
    fast_sim, fast = pressure_run("fast")
    assert sum(f.preemptions for f in exact.flights) > 10  # the pool was under pressure
    assert exact.records() == fast.records()
    assert [f.preemptions for f in exact.flights] == [f.preemptions for f in fast.flights]
    steps = {w.worker_id: w.num_steps for w in exact_sim.decode}
    assert steps == {w.worker_id: w.num_steps for w in fast_sim.decode}
    assert fast.events_run < exact.events_run  # runs of steps went as one event


def test_array_metrics_equal_bench_metrics_over_the_records() -> None:
    _, result = pressure_run("fast")
    kw = {"slos": {"ttft": 50.0, "tpot": 8.0}, "long_prompt_threshold": 512,
          "tenant_weights": {"gold": 2.0, "free": 1.0}}
    want = compute_metrics(result.records(), **kw)
    got = fast_metrics(result.timelines(), **kw)
    assert want.short_ttft_with_long is not None and want.request_goodput
    assert got == want  # dataclass equality: every figure, bit for bit


SCRIPT = """
import hashlib, json
from tests.unit.test_sim_runs import pressure_run
_, r = pressure_run("fast")
print(hashlib.sha256(json.dumps([(x.request_id, x.token_times, x.queue_s)
                                 for x in r.records()]).encode()).hexdigest())
"""


def test_a_run_is_the_same_under_any_hash_seed() -> None:
    digests = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        digests.add(out.stdout.strip())
    assert len(digests) == 1


def test_a_study_configuration_runs_in_the_simulator_and_gives_a_real_runs_record() -> None:
    from bench.studies.config_run import ConfigRun
    from bench.studies.service import DISAGG, RunOutput
    from sim.cluster import simulate_config
    from sim.synthetic import synthetic_calibration

    cfg = ServeConfig().with_values({"transfer.connector": "inproc", "cache.num_blocks": 512,
                                     "model.max_model_len": 2048})
    costs = load_costs(synthetic_calibration(prefill=lambda c, p: 0.001 + 1e-5 * c,
                                             decode=lambda b, L: 0.003, rpc_s=1e-4))
    work = build_workload(WorkloadSpec(num_requests=20, request_rate=10, vocab_range=(1, 1000)))
    out = simulate_config(cfg, work, costs, SimOptions(trace=True))
    assert isinstance(out, RunOutput) and len(out.records) == 20
    run = ConfigRun("sim", cfg, DISAGG, out)  # the studies' own figures from it
    assert run.metrics.completed == 20
    assert {s["role"] for s in out.worker_stats.values()} == {"prefill", "decode"}
    assert {e.phase for e in out.events} >= {"prefill_chunk", "kv_send", "decode_step"}


@pytest.mark.parametrize("stepping", ["fast", "exact"])
def test_a_run_makes_no_cyclic_garbage_and_leaves_the_collector_on(stepping: str) -> None:
    """Simulation.run turns the cyclic collector off while its events run (all it frees
    goes by reference count): preemptions, aborts and re-dispatches leave no cycle behind,
    and the collector is back on afterwards."""
    import gc

    gc.collect()
    sim, result = pressure_run(stepping)
    assert sum(f.preemptions for f in result.flights) > 10
    assert gc.isenabled()
    assert gc.collect() == 0  # nothing the run dropped was left for the collector
