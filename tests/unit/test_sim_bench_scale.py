"""tools/sim_bench_scale.py's profile split: the time of pdserve's real policy code against the
simulator's own, a builtin's time counted on the side of its caller."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tools.sim_bench_scale import policy_share

ROOT = "/repo/"


def test_policy_share_gives_builtins_to_their_callers_side() -> None:
    alloc = (ROOT + "engine/block_manager.py", 144, "allocate")
    step = (ROOT + "sim/decode.py", 241, "start_step")
    other = ("/usr/lib/python3.11/heapq.py", 1, "x")
    stats = SimpleNamespace(stats={
        alloc: (10, 10, 0.30, 0.50, {step: (10, 10, 0.30, 0.50)}),
        step: (5, 5, 0.40, 1.20, {}),
        other: (1, 1, 0.05, 0.05, {}),
        ("~", 0, "<built-in method builtins.len>"): (30, 30, 0.25, 0.25, {
            alloc: (20, 20, 0.20, 0.20), step: (10, 10, 0.05, 0.05)}),
    })
    share = policy_share(stats, ROOT)
    assert share == pytest.approx({"policy": 0.50, "simulator": 0.45, "other": 0.05})


def test_bench_scale_prints_the_split_of_a_short_profiled_run(capsys) -> None:
    from tools import sim_bench_scale as bench_scale

    args = bench_scale.parse(["--duration", "2", "--rate", "20", "--prefill", "1",
                              "--decode", "2", "--policy-share"])
    r = bench_scale.simulate(args, 2, "fast")
    line = capsys.readouterr().out
    assert r["metrics"].completed == r["requests"] == 40
    assert line.startswith("profiled: policy ") and "if the simulator's own code" in line
