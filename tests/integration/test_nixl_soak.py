"""The chaos soak over `--connector nixl` (issue 40's Done-when): 1,000 requests over gRPC
on the tiny model, 30% cancelled at every phase, KV chaos (duplicated, reordered, delayed
frames), decode and prefill workers killed through Ray mid-run; every request ends with
one terminal status, nothing hangs or leaks, greedy tokens equal engine.LLM's. The same
service and checks as tests/integration/test_soak.py (tcp, 200 requests), five times as
long: slow, run by hand:

    .venv/bin/python -m pytest -m slow tests/integration/test_nixl_soak.py -s
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util

import pytest

from bench.soak import SoakConfig, router_phase_probe, run_soak
from bench.soak_plan import build_plan, queued_refusal
from cluster.config.serve import ServeConfig
from cluster.launch.faults import service_tag
from cluster.launch.launcher import LaunchOptions, build_disaggregated_router
from cluster.serve.server import BackgroundServer
from engine.loader import load_model_config
from tests.integration.test_soak import CHAOS

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec("nixl_cu12") is None, reason="the nixl package is not installed")]

SOAK = SoakConfig(requests=1000, rate=5.0, cancel_rate=0.3, kill_every_s=30.0, max_kills=4,
                  deadline_s=170.0, quiesce_timeout_s=120.0, seed=0, output_scale=0.5,
                  prompt_scale=0.8)


def test_a_1000_request_chaos_soak_over_nixl_ends_clean(ray_session, tiny_model):
    m = load_model_config(tiny_model)
    queued = queued_refusal(build_plan(SOAK, m.vocab_size, m.max_position_embeddings))
    cfg = ServeConfig.from_dict({
        "model": {"path": str(tiny_model), "device": "cpu"},
        "pools": {"cpus_per_worker": 0.5, "reserve_with_add": False},
        "cache": {"num_blocks": 128},
        "scheduler": {"max_prefill_chunk": 64, "max_num_batched_tokens": 256},
        "transfer": {"connector": "nixl"},
        "limits": {"request_timeout_s": 170, "kv_wait_timeout_s": 40, "restart_grace_s": 60},
        "server": {"port": 0},
    })
    chaos = {**CHAOS, "faults": [*CHAOS["faults"], queued]}
    router = build_disaggregated_router(cfg, LaunchOptions(fault_injection=chaos))
    srv = BackgroundServer(router, cfg, health_poll_s=0.2)
    srv.start()
    try:
        tag = service_tag(router.prefill[0].handle)
        run = dataclasses.replace(SOAK, addr=srv.address, actor_tag=tag, model=str(tiny_model))
        report = asyncio.run(run_soak(run, phase_probe=router_phase_probe(router)))
        print(report.table())
        assert report.ok, report.table()
        s = report.summary
        assert sum(s["outcomes"].values()) == 1000 and s["tokens_checked"] > 0
        assert s["kills_survived"] == len(report.kills) >= 2
        assert {k["role"] for k in report.kills} == {"decode", "prefill"}
        for phase in ("queued", "prefill", "transfer", "decode"):
            assert s["cancel_phases"][phase]["cancelled"] > 0, (phase, s["cancel_phases"])
    finally:
        srv.stop(drain_timeout_s=0)
