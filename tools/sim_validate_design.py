"""What tools/sim_validate.py runs: its configurations, load levels and workload, and the
service configuration each one is served with."""

from __future__ import annotations

from typing import Any

# name -> (pools P, D, prefill chunk, send policy, fairness policy); a fractional design
# over the factors (each level of each factor appears; ~1 min per configuration here)
CONFIGS: dict[str, tuple[int, int, int, str, str]] = {
    "1P1D-c256-eager-fcfs": (1, 1, 256, "eager", "fcfs"),
    "1P1D-c64-eager-fcfs": (1, 1, 64, "eager", "fcfs"),
    "1P1D-c512-eager-srpt": (1, 1, 512, "eager", "srpt"),
    "1P2D-c128-paced-srpt": (1, 2, 128, "paced", "srpt"),
    "1P2D-c256-eager-fcfs": (1, 2, 256, "eager", "fcfs"),
}
QUICK = ("1P1D-c256-eager-fcfs", "1P2D-c128-paced-srpt")
LOADS = {"low": 2.0, "high": 5.0}  # requests per second
PACED_GBPS = 0.05  # 6 MB/s: a 1,000-token prompt's KV (512 KiB on tiny) takes ~85 ms
MAX_MODEL_LEN = 2048


def base_config(model_dir: str):
    from cluster.config.serve import ServeConfig

    return ServeConfig.from_dict({
        "model": {"path": model_dir, "device": "cpu", "max_model_len": MAX_MODEL_LEN},
        "pools": {"cpus_per_worker": 1.0, "max_restarts": 0},
        "cache": {"kv_cache_memory_gb": 0.25, "enable_prefix_caching": False},
        "transfer": {"connector": "tcp"},
    })


def config_for(base, spec: tuple[int, int, int, str, str]):
    p, d, chunk, policy, fairness = spec
    values: dict[str, Any] = {
        "pools.prefill_workers": p, "pools.decode_workers": d,
        "scheduler.max_prefill_chunk": chunk, "scheduler.max_num_batched_tokens": 512,
        "scheduler.fairness_policy": fairness, "transfer.send_policy": policy}
    if policy == "paced":
        values.update({"transfer.rate_gbps": PACED_GBPS, "transfer.burst_mb": 0.0625})
    return base.with_values(values)


def workload(n: int, rate: float, vocab: int, seed: int) -> list:
    from bench.workload import LengthDist, WorkloadSpec, build_workload

    return build_workload(WorkloadSpec(
        num_requests=n, request_rate=rate, mix="mixed", seed=seed, vocab_range=(1, vocab - 1),
        prompt_len=LengthDist.uniform(32, 192), output_len=LengthDist.uniform(16, 48),
        long_prompt_len=LengthDist.uniform(600, 1400), long_output_len=LengthDist.uniform(8, 16),
        long_fraction=0.25, max_model_len=MAX_MODEL_LEN, id_prefix=f"v{rate:g}-"))
