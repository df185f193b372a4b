"""Study plumbing without a service: tables, result files, stats deltas, teaching claims,
and the `pdserve bench` / `pdserve study` command lines."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import teaching as t
from bench import teaching_report as tr
from bench.studies.common import (
    Column,
    StudyOptions,
    StudyResult,
    parse_table,
    write_result,
)
from bench.studies.link import LinkEmulation, Reference
from bench.studies.service import mean_step_s, stats_delta
from engine.tracing import TraceEvent

REF = Reference(512, 0.1, 0.005, 512)


def fake_ctx(out: Path) -> SimpleNamespace:
    return SimpleNamespace(out=out, opts=StudyOptions(out=out, quick=True), model_dir=out,
                           link=LinkEmulation.from_ratio(REF, 0.15, 16),
                           describe=lambda: "real services on this machine (test)")


def test_markdown_table_and_json_rows_agree(tmp_path: Path) -> None:
    cols = [Column("config", "config"), Column("ttft", "TTFT (ms)"),
            Column("share", "share", "{:.2f}"), Column("ok", "ok")]
    rows = [{"config": "a", "ttft": 12.345, "share": 0.5, "ok": True},
            {"config": "b", "ttft": None, "share": float("nan"), "ok": 3}]
    res = StudyResult("demo", "Demo", "what it shows", cols, rows, {"a": {"files": {
        "trace": "demo-a.trace.json"}}}, plots=["demo.png"])
    paths = write_result(fake_ctx(tmp_path), res)
    table = parse_table(paths["md"].read_text())
    assert table == [["config", "TTFT (ms)", "share", "ok"], ["a", "12.3", "0.50", "yes"],
                     ["b", "n/a", "n/a", "3"]]
    data = json.loads(paths["json"].read_text())
    assert data["rows"][0]["ttft"] == 12.345 and data["link"]["transfer_compute_ratio"] == 0.15
    assert [c["key"] for c in data["columns"]] == ["config", "ttft", "share", "ok"]
    md = paths["md"].read_text()
    assert "![demo.png](demo.png)" in md and "[trace](demo-a.trace.json)" in md
    assert "transfer/compute ratio 0.15" in md


def test_stats_delta_gives_this_runs_mean_step_time() -> None:
    before = {"p": {"role": "prefill", "num_steps": 10, "mean_step_s": 0.02, "kv_bytes_sent": 100},
              "d": {"role": "decode", "num_steps": 0, "mean_step_s": 0.0}}
    after = {"p": {"role": "prefill", "num_steps": 30, "mean_step_s": 0.03, "kv_bytes_sent": 900},
             "d": {"role": "decode", "num_steps": 4, "mean_step_s": 0.01}}
    d = stats_delta(before, after)
    assert d["p"]["steps"] == 20 and d["p"]["mean_step_s"] == pytest.approx(0.7 / 20)
    assert d["p"]["kv_bytes_sent"] == 800
    assert mean_step_s(d, "prefill") == pytest.approx(0.035)
    assert mean_step_s(d, "decode") == pytest.approx(0.01)
    assert mean_step_s(d, "colocated") is None


def test_device_timing_is_busy_per_step_and_lag_per_continuing_step() -> None:
    from bench.studies.service import device_timing

    dev = {"device_busy_s": 1.0, "device_wall_s": 10.0, "host_lag_s": 0.0,
           "host_lag_steps": 0.0, "process_cpu_s": 0.0}
    before = {"p": {"role": "prefill", "num_steps": 10, "mean_step_s": 0.01, **dev},
              "d": {"role": "decode", "num_steps": 10, "mean_step_s": 0.01}}
    after = {"p": {"role": "prefill", "num_steps": 30, "mean_step_s": 0.01,
                   **dev, "device_busy_s": 1.4, "device_wall_s": 12.0, "host_lag_s": 0.1,
                   "host_lag_steps": 10.0},
             "d": {"role": "decode", "num_steps": 20, "mean_step_s": 0.01}}
    t = device_timing(stats_delta(before, after), "prefill")
    assert t == pytest.approx({"kernel_s": 0.4 / 20, "gap_s": 0.01, "busy_ratio": 0.2,
                               "lag_share": 0.25})
    assert device_timing(stats_delta(before, after), "decode") is None  # not emulated


def test_a_runs_garbage_collections_are_its_own_and_merged_runs_sum_them() -> None:
    from bench.studies.service import RunOutput, merge_runs

    before = {"d": {"role": "decode", "num_steps": 5, "mean_step_s": 0.01,
                    "gc_collections": 40, "gc_full_collections": 3, "gc_pause_s": 0.30}}
    after = {"d": {"role": "decode", "num_steps": 9, "mean_step_s": 0.01,
                   "gc_collections": 43, "gc_full_collections": 3, "gc_pause_s": 0.31}}
    d = stats_delta(before, after)["d"]
    assert d["gc_collections"] == 3 and d["gc_full_collections"] == 0
    assert d["gc_pause_s"] == pytest.approx(0.01)
    run = RunOutput([], [], {"d": d})
    assert merge_runs([run, run]).worker_stats["d"]["gc_collections"] == 6


def scenario(chunks: int, step: float) -> tuple[list[TraceEvent], float]:
    """S decodes every 10 ms; L arrives at 1.0 and prefills in ``chunks`` steps of ``step``
    seconds, each step also decoding S (a colocated engine)."""
    ev, t0 = [], 0.0
    for i in range(5):  # S alone
        t0 = 0.96 + 0.01 * i - 0.04
        ev += [TraceEvent(t.S_ID, "decode_step", t.WORKER, t0, t0 + 0.01),
               TraceEvent(t.S_ID, "token", t.WORKER, t0 + 0.01, t0 + 0.01)]
    start = 1.0
    for c in range(chunks):
        a, b = start + c * step, start + (c + 1) * step
        ev += [TraceEvent(t.L_ID, "prefill_chunk", t.WORKER, a, b, token_start=c * 64,
                          token_end=(c + 1) * 64),
               TraceEvent(t.S_ID, "decode_step", t.WORKER, a, b),
               TraceEvent(t.S_ID, "token", t.WORKER, b, b)]
    end = start + chunks * step
    ev += [TraceEvent(t.L_ID, "token", t.WORKER, end, end)]
    return ev, 1.0


def test_teaching_timings_and_claims_from_traces() -> None:
    whole = t.timings(*scenario(1, 0.030))
    chunked = t.timings(*scenario(4, 0.012))
    assert whole["s_next_token_ms"] == pytest.approx(30.0)
    assert chunked["s_next_token_ms"] == pytest.approx(12.0)
    assert whole["l_ttft_ms"] == pytest.approx(30.0) and chunked["l_ttft_ms"] == pytest.approx(48.0)
    assert (chunked["l_prefill_steps"], chunked["l_steps_shared_with_s"]) == (4, 4)
    res = {"spec": {"long_prompt": 256, "chunk": 64}, "whole": {"timings": whole},
           "chunked": {"timings": chunked}}
    claims = tr.claims(res)
    assert all(claims[k] for k in claims if not k.startswith("disagg"))
    assert all(claims[k] is None for k in claims if k.startswith("disagg"))
    assert "(b) chunked (64)" in tr.side_by_side(res)


def test_cli_parsers_and_plugin_registration(capsys) -> None:
    from bench.workload_args import parse_length, parse_tenants
    from cluster.cli import COMMANDS, PLUGIN_MODULES, build_parser

    assert parse_length("128").kind == "fixed"
    u = parse_length("64:256")
    assert (u.kind, u.lo, u.hi) == ("uniform", 64, 256)
    assert parse_length("lognormal:100:0.5:10:400").hi == 400
    gold, free = parse_tenants("gold:0.3:4:500,free:0.7:1")
    assert (gold.weight, gold.ttft_deadline_ms, free.share) == (4.0, 500.0, 0.7)
    parser = build_parser()
    args = parser.parse_args(["bench", "--addr", "h:1", "--num-prompts", "5", "--slo",
                              "ttft:100", "--prompt-len", "8:16", "--mix", "mixed"])
    assert args.num_prompts == 5 and args.prompt_len.hi == 16
    args = parser.parse_args(["study", "chunk-size", "--out", "x", "--quick",
                              "--transfer-compute-ratio", "0.3"])
    assert args.name == "chunk-size" and args.transfer_compute_ratio == 0.3
    from bench.cli import study_options
    from bench.studies.context import DEFAULT_SLOS, EMULATED_SLOS

    assert study_options(args).slos == DEFAULT_SLOS and study_options(args).emulate is None
    em = study_options(parser.parse_args(["study", "chunk-size", "--out", "x", "--emulate",
                                          "h200", "--emulate-kv-fraction", "0.25"]))
    assert em.slos == EMULATED_SLOS and em.emulate_kv_fraction == 0.25
    assert "KV sent: 0.25" in em.model and em.emulate_config.kv_fraction == 0.25
    with pytest.raises(ValueError, match="needs --emulate"):
        study_options(parser.parse_args(["study", "chunk-size", "--out", "x",
                                         "--emulate-kv-fraction", "0.5"]))
    with pytest.raises(SystemExit):
        parser.parse_args(["study", "chunk-size", "--out", "x", "--link-gbps", "1",
                           "--transfer-compute-ratio", "0.3"])
    capsys.readouterr()
    # every plug-in module named exists (one named a module that did not), and registers
    assert all(importlib.util.find_spec(m) is not None for m in PLUGIN_MODULES)
    assert {"bench", "study"} <= set(COMMANDS)


def offline_ctx(tmp_path: Path, tiny_model: Path, quick: bool):
    """A StudyContext whose reference timing is given (nothing measured or launched)."""
    from bench.studies.common import StudyContext
    from bench.studies.service import ServicePool

    ctx = StudyContext.__new__(StudyContext)
    ctx.opts, ctx.out, ctx.model_dir = StudyOptions(out=tmp_path, quick=quick), tmp_path, tiny_model
    ctx.pool = ServicePool()
    ctx.__dict__["reference"] = REF
    return ctx


@pytest.mark.parametrize("quick", [True, False])
def test_every_study_configuration_is_valid_and_the_default_is_shared(tmp_path, tiny_model,
                                                                       quick) -> None:
    from bench.studies import chunk_size, fairness, interference, pacing
    from bench.studies.service import DISAGG, config_key

    ctx = offline_ctx(tmp_path, tiny_model, quick)
    base = ctx.base_config()
    assert base.transfer.link_gbps == pytest.approx(ctx.link.link_gbps)
    cfgs = {f"chunk-{c}": base.with_values({"scheduler.max_prefill_chunk": c,
                                           "scheduler.max_num_batched_tokens": c})
            for c in (chunk_size.CHUNKS_QUICK if quick else chunk_size.CHUNKS_FULL)}
    cfgs.update({f"pacing-{n}": base.with_values(v) for n, v in pacing.configs(ctx).items()})
    for name in fairness.config_names(quick):
        if "-bound/" in name:
            cfgs[f"fairness-{name}"] = fairness.scenario_config(base, name)
            continue
        policy, queue = name.split("+")
        cfgs[f"fairness-{name}"] = base.with_values({"scheduler.fairness_policy": policy,
                                                     "transfer.send_queue": queue})
    spec = interference.workload_spec(ctx)
    for layout in interference.LAYOUTS.values():
        interference.layout_config(base, layout, spec.long_prompt)
    shared = [n for n, c in cfgs.items() if config_key(c, DISAGG) == config_key(base, DISAGG)]
    # (decode-bound/fcfs is the default's service: fcfs everywhere on the default's KV)
    assert shared == ["chunk-256", "pacing-eager", "fairness-fcfs+fcfs",
                      *([] if quick else ["fairness-decode-bound/fcfs"])]
    # every send policy runs on the same emulated link, the window as configured
    assert cfgs["pacing-at_end"].transfer.link_gbps == base.transfer.link_gbps
    assert cfgs["pacing-at_end"].transfer.send_policy == "at_end"
    if not quick:
        small = next(c for n, c in cfgs.items() if n.startswith("pacing-credit-"))
        assert small.transfer.credit_window_chunks == 0
        assert small.transfer.credit_window_mb < base.transfer.credit_window_mb
    assert len(fairness.config_names(False)) == 10 + len(fairness.path_names())
    assert len(cfgs) == len(set(map(str, cfgs)))


def test_study_all_and_run_all_reject_bad_selections_before_launching(tmp_path, capsys) -> None:
    from bench.cli import study_main

    out = str(tmp_path / "out")
    assert study_main(["all", "--out", out, "--configs", "chunk-64"]) == 2
    assert study_main(["all", "--out", out, "--studies", "chunk-size,nope"]) == 2
    err = capsys.readouterr().err
    assert "--configs picks configurations of one study" in err and "unknown ['nope']" in err
    assert not (tmp_path / "out").exists()  # nothing was started or written
