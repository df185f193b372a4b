"""`pdserve plan`: every xPyD split of N GPUs simulated on one workload with the service's
policy code, a table, the recommendation and the config to serve it; the answer follows
the workload (decode-heavy traffic wants decode workers, long documents want prefill)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from cluster.cli import main
from cluster.config.serve import ServeConfig

BASE = ["plan", "--analytic", "h200", "--model-shape", "llama-3-8b", "--interconnect",
        "infiniband", "--gpus", "3", "--slo", "ttft:1000,tpot:50"]
CHAT = ["--prompt-len", "64", "--output-len", "512", "--request-rate", "300",
        "--num-prompts", "200"]
DOCS = ["--prompt-len", "4000", "--output-len", "4", "--request-rate", "40",
        "--num-prompts", "120"]


def plan(tmp_path: Path, workload: list[str], capsys) -> tuple[dict, str, ServeConfig]:
    js, cfg = tmp_path / "plan.json", tmp_path / "serve.yaml"
    assert main([*BASE, *workload, "--json", str(js), "--out-config", str(cfg)]) == 0
    out = capsys.readouterr().out
    data = json.loads(js.read_text())
    return data, out, ServeConfig.from_dict(yaml.safe_load(cfg.read_text()))


@pytest.mark.parametrize("workload,more", [(CHAT, "decode_workers"), (DOCS, "prefill_workers")])
def test_the_plan_recommends_the_split_with_the_most_goodput(tmp_path, capsys, workload, more):
    data, out, served = plan(tmp_path, workload, capsys)
    rows = data["candidates"]
    assert [(r["prefill_workers"], r["decode_workers"]) for r in rows] == [(1, 2), (2, 1)]
    best = data["recommendation"]
    assert best["goodput_rps"] == max(r["goodput_rps"] for r in rows)
    less = "prefill_workers" if more == "decode_workers" else "decode_workers"
    assert best[more] > best[less]  # the traffic decides, not a default
    assert all(r["completed"] + r["failed"] == data["workload"]["num_requests"] for r in rows)
    assert f"{best['split']}       " in out and "<- best" in out
    assert f"recommendation: {best['prefill_workers']} prefill + {best['decode_workers']} " \
           "decode workers" in out
    assert "analytic, not measured" in out
    # the config written serves that split; the printed YAML names it too
    assert (served.pools.prefill_workers, served.pools.decode_workers) == \
        (best["prefill_workers"], best["decode_workers"])
    printed = yaml.safe_load(out.split("# pdserve plan:", 1)[1].split("\n", 1)[1]
                             .split("\nwrote ", 1)[0])
    assert printed["pools"] == {"prefill_workers": best["prefill_workers"],
                                "decode_workers": best["decode_workers"]}


def test_chunk_sizes_multiply_the_candidates(tmp_path, capsys):
    js = tmp_path / "p.json"
    assert main([*BASE, *DOCS[:-1], "40", "--chunk-sizes", "128,512", "--json", str(js)]) == 0
    rows = json.loads(js.read_text())["candidates"]
    assert sorted((r["prefill_workers"], r["chunk"]) for r in rows) == \
        [(1, 128), (1, 512), (2, 128), (2, 512)]


def test_bad_plans_are_refused_with_a_clear_error(capsys):
    assert main([*BASE[:-4], "--gpus", "1", "--slo", "ttft:100"]) == 2
    assert "--gpus must be >= 2" in capsys.readouterr().err
    assert main([*BASE[:-2], "--slo", "speed:1"]) == 2
    assert "speed" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(BASE[:-2])  # --slo is required
