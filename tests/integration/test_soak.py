"""A short soak of the disaggregated service on the tiny model (1 prefill + 1 decode
worker, tcp KV link, light KV chaos: duplicated, reordered and delayed frames): 200
requests over gRPC, 30% cancelled at every phase, one decode and one prefill worker
killed through Ray mid-run. The requests whose cancel aims at the admission queue are
refused by the decode worker until cancelled (bench.soak_plan.queued_refusal), so that
phase is reached by construction, not by a full pool at the right moment. Every request ends with one terminal status, nothing hangs
or leaks (workers, router and metrics endpoint), and greedy tokens equal engine.LLM's.
Then the same service answers malformed requests with INVALID_ARGUMENT and keeps
serving exact tokens.

The long version is a documented command (README / bench/soak.py):
    pdserve soak --addr HOST:PORT --requests 1000 --cancel-rate 0.3 --kill-every 30 ...

First, a small ``--pressure`` soak on a service of its own (KV pools of 384 tokens per
worker: 2-3 requests fit on each side): shared prefixes, Abort RPCs at every phase,
client deadlines, reused ids, preemptions and a drain, with the same pass criteria.
    pdserve soak --pressure --requests 1000 --model tiny
"""

from __future__ import annotations

import asyncio
import dataclasses
import re

import pytest

from bench.soak import SoakConfig, router_phase_probe, run_soak
from bench.soak_plan import ABORT_PHASES, TERMINAL, build_plan, queued_refusal
from bench.soak_service import PressureService, PressureServiceSpec
from cluster.config.serve import ServeConfig
from cluster.grpc.client import PdserveClient
from cluster.launch.faults import find_worker_actors, service_tag
from cluster.launch.launcher import LaunchOptions, build_disaggregated_router
from cluster.metrics import ServiceMetrics, refresh_loop, serve_metrics
from cluster.serve.server import BackgroundServer
from engine import LLM, SamplingParams
from engine.loader import load_model_config
from tests.integration.test_grpc_fuzz import MALFORMED, assert_rejected

CHAOS = {"seed": 11, "faults": [
    {"kind": "duplicate", "probability": 0.02},
    {"kind": "reorder", "probability": 0.02},
    {"kind": "delay", "probability": 0.01, "delay_s": 0.05},
]}


def test_pressure_soak_on_small_pools_ends_clean(ray_session, tiny_model):
    # a healthy service ends each of these in well under a second even when queued:
    # 20 s without an end is a hang (the drain may not abort anything before that)
    spec = PressureServiceSpec(model=str(tiny_model), cpus_per_worker=0.5,
                               request_timeout_s=60, kv_wait_timeout_s=20, drain_timeout_s=20)
    cfg = SoakConfig(requests=60, rate=3.0, seed=3, pressure=True, mix=(0.3, 0.2, 0.5),
                     cancel_rate=0.1, abort_rate=0.3, client_deadline_rate=0.1,
                     reuse_rate=0.15, drain=True, drain_share=0.1, model=str(tiny_model),
                     deadline_s=20.0, quiesce_timeout_s=30.0)
    with PressureService(spec) as svc:
        report = asyncio.run(run_soak(dataclasses.replace(cfg, addr=svc.addr),
                                      hooks=svc.hooks()))
    print(report.table())
    p = report.summary["pressure"]
    # the pools were under pressure: 2-3 requests fit on either side
    assert p["pools_tokens"] == {"prefill": 384, "decode": 384}
    assert p["fit_prefill"] < 4 and p["fit_decode"] < 4
    assert all(p["aborts"][ph]["planned"] > 0 for ph in ABORT_PHASES)
    assert p["reuses"]["planned"] > 0 and p["client_deadlines"]["planned"] > 0
    assert p["drain"].startswith("drained") and p["after_drain"]["planned"] > 0
    assert report.ok, report.table()
    assert set(report.summary["outcomes"]) <= set(TERMINAL), report.summary["outcomes"]


SOAK = SoakConfig(requests=200, rate=5.0, cancel_rate=0.3, kill_every_s=6.0, max_kills=2,
                  deadline_s=170.0, quiesce_timeout_s=90.0, seed=0, output_scale=0.5,
                  prompt_scale=0.8)


@pytest.fixture(scope="module")
def queued_fault(tiny_model) -> dict:
    """The refuse_admission fault that holds SOAK's "queued" targets in the admission
    queue (the plan is the one the soak builds: same config and model limits)."""
    m = load_model_config(tiny_model)
    return queued_refusal(build_plan(SOAK, m.vocab_size, m.max_position_embeddings))


@pytest.fixture(scope="module")
def service(ray_session, tiny_model, queued_fault):
    cfg = ServeConfig.from_dict({
        "model": {"path": str(tiny_model), "device": "cpu"},
        # half a CPU each: modules before this one may still hold CPUs of the session's Ray
        # (reserve first: a reserve sent with the add puts a refused request on a prefill
        # worker until its refusal returns, where the probe sees "prefill", not "queued";
        # test_pd_reserve_with_add covers that path)
        "pools": {"cpus_per_worker": 0.5, "reserve_with_add": False},
        # a small decode cache (a long prompt takes over half of it): some pool pressure
        "cache": {"num_blocks": 128},
        "scheduler": {"max_prefill_chunk": 64, "max_num_batched_tokens": 256},
        "transfer": {"connector": "tcp"},
        # a killed worker is back in ~15-30 s here: queued requests wait for it
        "limits": {"request_timeout_s": 170, "kv_wait_timeout_s": 40, "restart_grace_s": 60},
        "server": {"port": 0},
    })
    chaos = {**CHAOS, "faults": [*CHAOS["faults"], queued_fault]}
    router = build_disaggregated_router(cfg, LaunchOptions(fault_injection=chaos))
    router.metrics = ServiceMetrics()
    port = serve_metrics(router.metrics, 0)
    srv = BackgroundServer(router, cfg, health_poll_s=0.2)
    srv.start()
    refresher = asyncio.run_coroutine_threadsafe(refresh_loop(router, router.metrics), srv.loop)
    yield srv, router, f"http://127.0.0.1:{port}/metrics"
    refresher.cancel()
    srv.stop(drain_timeout_s=0)


def test_soak_with_cancels_and_worker_kills_ends_clean(service, tiny_model, queued_fault):
    srv, router, metrics_url = service
    tag = service_tag(router.prefill[0].handle)
    assert {w.role for w in find_worker_actors(tag)} == {"prefill", "decode"}
    cfg = dataclasses.replace(SOAK, addr=srv.address, actor_tag=tag, model=str(tiny_model),
                              metrics_url=metrics_url)
    report = asyncio.run(run_soak(cfg, phase_probe=router_phase_probe(router)))
    print(report.table())
    assert report.ok, report.table()
    s = report.summary
    assert sorted(k["role"] for k in report.kills) == ["decode", "prefill"]
    assert s["kills_survived"] == 2 and all(w.restarts >= 1 for w in router.workers)
    assert s["outcomes"]["finished"] > 0 and s["tokens_checked"] > 0
    assert sum(s["outcomes"].values()) == 200
    # the fault named the run's own "queued" targets (the fixture's plan is the soak's)
    refused = re.compile(queued_fault["request_filter"])
    assert {r["request_id"] for r in report.requests if refused.search(r["request_id"] + "#")
            } == {r["request_id"] for r in report.requests if r["cancel_planned"] == "queued"}
    for phase in ("queued", "prefill", "transfer", "decode"):
        assert s["cancel_phases"][phase]["cancelled"] > 0, (phase, s["cancel_phases"])


def test_after_the_soak_malformed_requests_are_rejected_and_tokens_stay_exact(service,
                                                                               tiny_model):
    srv, router, _ = service
    with PdserveClient(srv.address, timeout=120) as client:
        for name, (body, _) in MALFORMED.items():
            assert_rejected(client, body, name)
        prompt = list(range(5, 60))
        got = client.complete(prompt, max_tokens=8, temperature=0.0, ignore_eos=True)
        want = LLM(str(tiny_model)).generate([prompt], SamplingParams(
            temperature=0.0, max_tokens=8, ignore_eos=True))[0].token_ids
        assert list(got.token_ids) == want and got.finish_reason == "length"
