"""The disaggregated service on the emulated accelerator (engine/emulate/), on local Ray:
real actors, gRPC and KV bytes on the small 'tiny' shape. A 200-request soak with
cancels ends clean, its greedy tokens equal to engine.LLM on the same emulated device,
every KV range checked, with the decode worker's host one step ahead (scheduler.overlap); the workers' stats and the bench report the device's accounting
with its label; nothing is left in flight."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from bench.emulated import device_report, device_snapshot, format_report
from bench.soak import SoakConfig, run_soak
from cluster.config.serve import ServeConfig
from cluster.grpc.client import PdserveClient
from cluster.launch.launcher import build_disaggregated_router
from cluster.serve.server import BackgroundServer
from engine.emulate.offline import emulated_engine_config
from engine.llm import LLM
from engine.request import SamplingParams

LABEL = "emulated h200, tiny: analytic, not measured"


@pytest.fixture(scope="module")
def service(ray_session):
    cfg = ServeConfig.from_dict({
        "model": {"emulate": "h200", "model_shape": "tiny", "dtype": "bfloat16",
                  "device": "cpu", "max_model_len": 1024},
        "pools": {"cpus_per_worker": 0.5},
        "cache": {"num_blocks": 256},
        # the decode host one step ahead (scheduler.overlap, the default; test_pd_grpc's
        # service runs the serial loop)
        "scheduler": {"max_prefill_chunk": 64, "max_num_batched_tokens": 256,
                      "overlap": True},
        "transfer": {"connector": "tcp"},
        "limits": {"request_timeout_s": 120, "kv_wait_timeout_s": 40},
        "server": {"port": 0},
    })
    router = build_disaggregated_router(cfg)
    srv = BackgroundServer(router, cfg, health_poll_s=0.2)
    srv.start()
    yield srv, router
    srv.stop(drain_timeout_s=0)


def test_emulated_tokens_equal_the_offline_emulated_engine_and_stats_carry_the_device(
        service):
    srv, _ = service
    before = asyncio.run(device_snapshot(srv.address))
    assert {role for role, _ in before.values()} == {"prefill", "decode"}
    prompt = list(range(5, 90))
    with PdserveClient(srv.address, timeout=120) as client:
        got = client.complete(prompt, max_tokens=12, temperature=0.0, ignore_eos=True)
    want = LLM.from_config(emulated_engine_config("h200", "tiny", max_model_len=1024)).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    assert list(got.token_ids) == want.token_ids and got.finish_reason == "length"
    after = asyncio.run(device_snapshot(srv.address))
    report = device_report(before, after)
    for role in ("prefill", "decode"):
        r = report[role]
        assert r["workers"] == 1 and r["device_busy_s"] > 0 and 0 < r["busy_ratio"] <= 1
    text = format_report(report, LABEL, output_tokens=12)
    assert text.splitlines()[0] == f"Emulated device: {LABEL}"
    assert "Device busy (decode): " in text and "Host lag p50/p99: decode " in text
    assert "Host CPU per output token (us): decode " in text
    assert report["decode"]["process_cpu_s"] > 0


def test_a_200_request_soak_with_cancels_on_the_emulated_service_ends_clean(service):
    srv, router = service
    cfg = SoakConfig(addr=srv.address, requests=200, rate=40.0, cancel_rate=0.3, seed=5,
                     ray_address=None, deadline_s=100.0, quiesce_timeout_s=60.0,
                     output_scale=0.5, prompt_scale=0.5, emulate="h200", model_shape="tiny")
    report = asyncio.run(run_soak(cfg))
    print(report.table())
    assert report.ok, report.table()
    assert report.table().splitlines()[1] == f"service on the {LABEL}"
    s = report.summary
    assert sum(s["outcomes"].values()) == 200 and s["outcomes"]["finished"] > 0
    assert s["tokens_checked"] > 0  # greedy streams equal engine.LLM on the emulated device
    with PdserveClient(srv.address, timeout=60) as client:
        stats = client.stats()
    decode = [w for w in stats.workers if w.role == "decode"][0]
    assert decode.extra["device_busy_ratio"] > 0 and decode.num_running == 0
    assert all(w.kv_blocks_used == 0 for w in stats.workers if w.role == "decode")
    assert dataclasses.asdict(report)["leaks"] == []


def test_a_quick_study_runs_on_the_emulated_device_and_says_so(ray_session, tmp_path):
    from bench.studies.common import StudyContext, StudyOptions
    from bench.study import run_study

    ctx = StudyContext(StudyOptions(out=tmp_path, quick=True, model=LABEL, progress=False,
                                    num_requests=6, emulate="h200", model_shape="tiny",
                                    configs=("chunk-64",)))  # one service: quick
    try:
        # the link is emulated at the emulated device's transfer/compute ratio: its
        # reference is the cost model's, far faster than this CPU's tiny model
        assert ctx.reference.prefill_s < 1e-3
        assert ctx.describe().endswith(f"on the {LABEL} (Ray workers, router, KV connector)")
        run_study("chunk-size", ctx, echo=lambda _: None)
    finally:
        ctx.close()
    data = json.loads((tmp_path / "chunk-size.json").read_text())
    assert data["options"]["model"] == LABEL
    assert LABEL in (tmp_path / "chunk-size.md").read_text()
    assert [r["config"] for r in data["rows"]] == ["chunk-64"]
    for row in data["rows"]:
        assert row["completed"] == 6 and row["failed"] == 0
    trace = json.loads((tmp_path / data["configs"]["chunk-64"]["files"]["trace"]).read_text())
    assert trace["otherData"]["device"] == LABEL
    stats = [w for d in data["configs"].values() for w in d["worker_stats"].values()]
    assert stats and all(w.get("device_busy_s", 0) > 0 for w in stats if w["role"] == "decode")
