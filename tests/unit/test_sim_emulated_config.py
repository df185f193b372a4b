"""The simulator on an emulated service's configuration (`pdserve study --simulate`,
`pdserve plan` and the live planner on a `--emulate` config, tools/sim_validate_emulated.py):
the simulator charges every KV byte itself, so `--emulate-kv-fraction`, which scales an
emulated service's links, pacer and credit window to the bytes it sends, must not scale
the simulated ones (it made the simulated link 32 times slower at a fraction of 1/32)."""

from __future__ import annotations

from cluster.config.serve import ServeConfig
from engine.costs.analytic import analytic_calibration
from engine.costs.loader import load_costs
from sim.cluster import Simulation
from sim.options import SimOptions


def test_an_emulated_configs_kv_fraction_leaves_the_simulated_links_whole() -> None:
    costs = load_costs(analytic_calibration("h200", "llama-3-8b", "bfloat16"))
    base = {"transfer": {"link_gbps": 400.0, "send_policy": "paced", "rate_gbps": 200.0}}
    plain = ServeConfig.from_dict(base)
    emulated = ServeConfig.from_dict({**base, "model": {
        "emulate": "h200", "model_shape": "llama-3-8b", "emulate_kv_fraction": 1 / 32}})
    link = SimOptions(interconnect="infiniband")
    a = Simulation(plain, costs, link).plan.transfer
    b = Simulation(emulated, costs, link).plan.transfer
    assert b.link_rate_bytes_per_s == a.link_rate_bytes_per_s == 400e9 / 8
    assert b.rate_bytes_per_s == a.rate_bytes_per_s == 200e9 / 8
    assert b.credit_window_bytes == a.credit_window_bytes
