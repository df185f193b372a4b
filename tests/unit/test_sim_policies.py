"""The simulator runs the real policies: changing the fairness policy, the chunk size or
the placement policy changes the simulated outcome the way the real schedulers decide."""

from __future__ import annotations

import statistics

from bench.workload import WorkloadRequest
from engine.costs.loader import load_costs
from sim.adapters import ServeConfig
from sim.cluster import Simulation
from sim.options import SimOptions
from sim.synthetic import synthetic_calibration

LONG = 2000


def workload(longs: int = 1) -> list[WorkloadRequest]:
    """Long prompts first, then ten short ones while they are being prefilled."""
    reqs = [WorkloadRequest(f"long-{i}", 0.0005 * i, [7 + i] * LONG, max_tokens=4, kind="long")
            for i in range(longs)]
    reqs += [WorkloadRequest(f"short-{i}", 0.002 + 0.001 * i, [i + 1] * 50, max_tokens=4)
             for i in range(10)]
    return reqs


def run(overrides: dict, options: SimOptions | None = None,
        longs: int = 1) -> tuple[dict, Simulation]:
    cal = synthetic_calibration(prefill=lambda c, p: 0.001 + 1e-4 * c,
                                decode=lambda b, L: 0.005, rpc_s=1e-4)
    cfg = ServeConfig().with_values({
        "transfer.connector": "inproc", "cache.num_blocks": 1024, "model.max_model_len": 4096,
        "scheduler.max_num_batched_tokens": 512, "scheduler.max_prefill_chunk": 512,
        "cache.enable_prefix_caching": False, **overrides})
    sim = Simulation(cfg, load_costs(cal), options)
    records = sim.run(workload(longs)).records()
    sim.check_quiescent()
    assert all(r.success for r in records)
    return {r.request_id: r.ttft for r in records}, sim


def short_ttft(ttft: dict) -> float:
    return statistics.median(v for k, v in ttft.items() if k.startswith("short"))


def test_srpt_serves_short_prompts_before_the_long_one_fcfs_does_not() -> None:
    fcfs, _ = run({"scheduler.fairness_policy": "fcfs"})
    srpt, _ = run({"scheduler.fairness_policy": "srpt"})
    # fcfs: the long prompt keeps the whole 512-token budget for its 4 steps (4 x 52 ms);
    # srpt: the shorts that arrived during its first step all go in the second one
    assert short_ttft(fcfs) > 0.2
    assert short_ttft(srpt) < short_ttft(fcfs) / 2
    assert srpt["long-0"] > fcfs["long-0"]  # and pays for it


def test_smaller_chunks_leave_budget_to_short_prompts_under_fcfs() -> None:
    big, sim_big = run({"scheduler.max_prefill_chunk": 512})
    small, sim_small = run({"scheduler.max_prefill_chunk": 128})
    assert short_ttft(small) < short_ttft(big) / 3
    # the real chunk policy cut the long prompt: 15 chunks of 128 and the 80-token tail
    sizes = sim_small.prefill[0].engine.chunk_sizes
    assert sizes[128] == 15 and sizes[80] == 1
    assert sim_big.prefill[0].engine.chunk_sizes[512] == 3


def test_length_buckets_keep_short_prompts_off_the_long_prompts_workers() -> None:
    two = {"pools.prefill_workers": 2}
    least, _ = run(two, SimOptions(placement="least-outstanding"), longs=2)
    buckets, sim = run(two, SimOptions(placement="length-buckets", length_buckets=(100,)),
                       longs=2)
    per_worker = {w.worker_id: sum(n * k for n, k in w.engine.chunk_sizes.items())
                  for w in sim.prefill}
    assert per_worker == {"prefill-0": 500, "prefill-1": 2 * LONG}
    # least-outstanding spread the two long prompts, so every short waits behind one
    assert short_ttft(buckets) < short_ttft(least) / 3
    assert max(buckets["long-0"], buckets["long-1"]) > max(least["long-0"], least["long-1"])


def test_streaming_kv_sends_start_decode_earlier_than_holding_them_to_the_end() -> None:
    """Over an emulated slow link, eager sends overlap the long prompt's KV transfer with
    its later chunks; at_end (the real send policy's hold) starts it after the last."""
    second = {}
    for policy in ("eager", "at_end"):
        # 2000 tokens x 512 B at 2.5 MB/s: 0.4 s on the wire (a 64 KiB pacer burst)
        cfg = {"scheduler.max_prefill_chunk": 256, "transfer.send_policy": policy,
               "transfer.link_gbps": 0.02, "transfer.burst_mb": 0.0625}
        _, sim = run(cfg)
        long = next(f for f in sim.router.finished if f.req.request_id == "long-0")
        w, first, _, _ = long.tokens[1]  # the decode leg's: (worker, first step, n, seen)
        second[policy] = w.step_times[first]
    # the prefill takes 8 steps of 26.6 ms: at_end sends after them, eager during them
    assert second["at_end"] > 0.2 + 0.4
    assert second["eager"] < second["at_end"] - 0.1
