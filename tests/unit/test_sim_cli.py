"""`pdserve calibrate --quick` on the tiny model writes a file `pdserve simulate` accepts;
simulate takes bench's workload flags and serve's configuration flags literally, prints
bench's metric block and writes bench's JSON keys."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from cluster.cli import build_parser, main
from engine.costs.calibration import Calibration

LIMITS = ["--max-model-len", "128", "--max-num-batched-tokens", "64", "--max-num-seqs", "4"]


def _options(parser: argparse.ArgumentParser, command: str, group: str | None = None) -> set[str]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    p = sub.choices[command]
    groups = [g for g in p._action_groups if group is None or g.title == group]
    return {s for g in groups for a in g._group_actions for s in a.option_strings}


def test_simulate_takes_bench_workload_flags_and_serve_config_flags_literally() -> None:
    parser = build_parser()
    workload = _options(parser, "bench", "workload")
    assert {"--num-prompts", "--request-rate", "--mix", "--tenants", "--seed"} <= workload
    assert workload == _options(parser, "simulate", "workload")
    serve = _options(parser, "serve") - {"-h", "--help"}
    assert "--max-prefill-chunk" in serve and "--send-policy" in serve
    assert serve <= _options(parser, "simulate")


def test_calibrate_quick_on_tiny_writes_a_file_simulate_accepts(tmp_path: Path, capsys) -> None:
    cal_path = tmp_path / "cal.json"
    rc = main(["calibrate", "--model", "tiny", "--quick", "--repeats", "1", "--connectors",
               "inproc", "--rpc-ms", "0.5", "--out", str(cal_path), *LIMITS])
    out = capsys.readouterr().out
    assert rc == 0, out
    cal = Calibration.load(cal_path)
    assert cal.kind == "measured" and cal.get("model.num_layers") == 2
    assert cal.get("dtype") == "float32" and cal.get("hardware.device") == "cpu"
    assert cal.source_of("control.rpc_s") == "assumed: --rpc-ms 0.5"
    assert cal.get("prefill.fit.single_chunk.mean_rel_err") is not None
    assert cal.number("overheads.decode_join_s") >= 0  # a step that a leg joins, timed
    assert "prefill single_chunk: mean error" in out  # the fit error is reported

    out_json = tmp_path / "sim.json"
    trace = tmp_path / "trace.json"
    rc = main(["simulate", "--calibration", str(cal_path), *LIMITS, "--max-prefill-chunk", "32",
               "--connector", "inproc", "--prefill-workers", "1", "--decode-workers", "2",
               "--num-prompts", "30", "--request-rate", "20", "--prompt-len", "16:100",
               "--output-len", "4:20", "--slo", "ttft:500", "--json", str(out_json),
               "--trace-out", str(trace)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "Serving Benchmark Result (simulated)" in out and "Mean TTFT (ms):" in out
    assert cal.label in out
    doc = json.loads(out_json.read_text())
    assert {"addr", "backend", "workload", "max_concurrency", "metrics", "records"} <= set(doc)
    m = doc["metrics"]
    assert m["completed"] == 30 and m["failed"] == 0
    assert {"request_throughput", "request_goodput", "output_throughput", "mean_ttft_ms",
            "median_tpot_ms", "p99_itl_ms", "p90_e2el_ms", "jain_tenant",
            "mean_prefill_ms"} <= set(m)  # bench's (vllm bench serve) key names
    assert len(doc["records"]) == 30 and doc["simulation"]["label"] == cal.label
    t = json.loads(trace.read_text())
    assert t["otherData"]["clock"].startswith("simulated")
    assert {e.get("cat") for e in t["traceEvents"]} >= {"prefill_chunk", "kv_send",
                                                        "decode_step", "decode_admit"}


def test_simulate_says_which_calibration_entry_is_missing(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "pdserve-calibration/1", "kind": "measured"}))
    rc = main(["simulate", "--calibration", str(bad), "--num-prompts", "2"])
    assert rc == 2
    assert "missing entry 'prefill.chunk'" in capsys.readouterr().err


@pytest.mark.parametrize("profile", ["h200"])
def test_simulate_on_an_analytic_profile_says_so(profile: str, capsys) -> None:
    rc = main(["simulate", "--analytic", profile, "--model-shape", "qwen2-0.5b",
               "--interconnect", "nvlink", "--max-model-len", "1024", "--num-prompts", "20",
               "--request-rate", "50"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "analytic, not measured" in out
