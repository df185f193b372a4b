"""The compiled simulator (`make sim-fast`, sim/compiled.py) gives the interpreted one's
results: the same events and the same `pdserve simulate --json` output but for the
wall-clock figures, on small runs that go through every compiled module's branches
(preemption, exact stepping, paced / at_end sends, wfq queues, adaptive and tail-merge
chunks, shared prefixes, an emulated link, length buckets, a concurrency cap).

Opt-in: skipped unless a compiled build made from the current source is present.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sim import compiled

WHY = compiled.unusable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"opt-in: {WHY}")

BASE = ["--analytic", "h200", "--model-shape", "llama-3-8b", "--interconnect", "infiniband",
        "--seed", "3"]
PREEMPT = ["--prefill-workers", "2", "--decode-workers", "2", "--num-blocks", "300",
           "--fairness-policy", "srpt", "--send-policy", "paced", "--rate-gbps", "50",
           "--send-queue", "wfq", "--request-rate", "40", "--num-prompts", "200"]
CONFIGS = {
    "8p24d-chat": ["--prefill-workers", "8", "--decode-workers", "24", "--request-rate", "100",
                   "--num-prompts", "400", "--decode-order", "least-legs"],
    "2p2d-preempt-fast": PREEMPT,
    "2p2d-preempt-exact": [*PREEMPT, "--decode-stepping", "exact"],
    "prefix-at-end-adaptive": ["--prefill-workers", "2", "--decode-workers", "4", "--mix",
                               "shared-prefix", "--num-prefix-groups", "4", "--prefix-len",
                               "256", "--send-policy", "at_end", "--chunk-policy", "adaptive",
                               "--max-concurrency", "16", "--request-rate", "60",
                               "--num-prompts", "200"],
    "emulated-link-buckets": ["--prefill-workers", "4", "--decode-workers", "4", "--mix", "mixed",
                              "--link-gbps", "25", "--link-latency-us", "20", "--chunk-policy",
                              "tail-merge", "--fairness-policy", "wfq", "--tenants",
                              "gold:1:4,free:3:1", "--placement", "length-buckets",
                              "--request-rate", "40", "--num-prompts", "200"],
}
WALL_CLOCK = (("simulation", "wall_s"), ("simulation", "speedup_vs_real_time"),
              ("simulation", "calibration", "created_unix_s"))


def simulate(args: list[str], code: str, out: Path) -> tuple[dict, str]:
    pdserve = Path(sys.executable).parent / "pdserve"
    done = subprocess.run([str(pdserve), "simulate", *BASE, *args, "--code", code,
                           "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    data = json.loads(out.read_text())
    for path in WALL_CLOCK:
        parent = data
        for key in path[:-1]:
            parent = parent[key]
        del parent[path[-1]]
    return data, done.stdout


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_compiled_gives_the_interpreted_result(name: str, tmp_path: Path) -> None:
    fast, fast_out = simulate(CONFIGS[name], "compiled", tmp_path / "compiled.json")
    slow, slow_out = simulate(CONFIGS[name], "interpreted", tmp_path / "interpreted.json")
    assert "code: compiled (mypyc" in fast_out
    assert "code: interpreted" in slow_out
    assert fast["simulation"]["events"] == slow["simulation"]["events"]
    assert json.dumps(fast, indent=2, default=str) == json.dumps(slow, indent=2, default=str)
    if name.startswith("2p2d-preempt"):  # (the runs do reach what they are meant to)
        assert slow["simulation"]["preemptions"] > 0
