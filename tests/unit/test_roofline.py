"""bench/roofline.py: the decode roof's bandwidth is the median of probes taken between
the timed decode steps (one probe per step), and both roofs come out of one engine run."""

from __future__ import annotations

import statistics

from bench import roofline
from engine import LLM


def test_bandwidth_is_the_median_of_probes_between_decode_steps(tiny_model):
    llm = LLM(str(tiny_model), compile="none", max_num_batched_tokens=64)
    times = roofline.step_times(llm, list(range(1, 40)), decode_steps=3, chunk=32)
    probe = times.bandwidth
    probe_bytes = probe.nbytes
    assert len(probe.copy_rates) == len(probe.read_rates) == 4  # steps after the prefill
    r = roofline.roofs(llm, times)
    assert r["memcpy_bytes_per_s"] == statistics.median(probe.copy_rates)
    assert r["read_bytes_per_s"] == statistics.median(probe.read_rates)
    assert r["bandwidth_probes"] == 4 and probe_bytes == 512 << 20
    assert r["decode_roof_s"] == r["weight_bytes"] / r["memcpy_bytes_per_s"]
    assert "median of 4 probes" in roofline.lines(r)[0]
    assert not llm.has_unfinished() and llm.block_manager.num_used_blocks == 0
