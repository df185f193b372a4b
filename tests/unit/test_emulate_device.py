"""The emulated accelerator (engine/emulate/): its device timeline and host accounting,
the KV pattern's write and check, pseudo-tokens, and the worker engines on it -- greedy
streams identical colocated and disaggregated, a corrupted KV frame caught end to end,
no block leaked."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.config import CacheConfig, EmulateConfig, EngineConfig, SchedulerConfig
from engine.emulate.device import EmulatedDevice
from engine.emulate.kv_pattern import ROOT, KVPattern, PatternError, chain
from engine.emulate.model_dir import emulated_model_dir
from engine.emulate.runner import EmulatedRunner
from engine.llm import LLM
from engine.loader import load_model_config
from engine.request import SamplingParams
from runtime.messages import EventKind
from tests.pd_harness import PDPair, corrupt_once, greedy

TINY = EmulateConfig("h200", "tiny")


@pytest.fixture(scope="module")
def emu_dir():
    return emulated_model_dir("tiny")


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def test_a_step_submitted_late_starts_late_and_only_a_continuing_step_counts_host_lag():
    clock = FakeClock()
    dev = EmulatedDevice(clock, clock.sleep)
    end = dev.submit(0.010)  # idle device: starts now
    assert end == pytest.approx(100.010)
    end2 = dev.submit(0.005, continues=True)  # queued behind the first: no lag
    assert end2 == pytest.approx(100.015)
    dev.wait(end2)
    assert clock.t == pytest.approx(100.015)
    clock.t += 0.003  # the host took 3 ms after the device went idle
    dev.submit(0.002, continues=True)
    clock.t += 1.0  # idle: nothing to run
    dev.submit(0.002, continues=False)
    s = dev.stats()
    assert s["host_lag_steps"] == 2 and s["host_lag_s"] == pytest.approx(0.003)
    assert s["device_busy_s"] == pytest.approx(0.019)
    assert s["device_busy_ratio"] == pytest.approx(0.019 / (clock.t - 100.0))


def _pattern_kv(runner, tokens: list[int]) -> torch.Tensor:
    """A prompt's KV as a prefill worker sends it: the pattern of ``tokens`` from 0."""
    m, n = runner.config.model, len(tokens)
    data = torch.zeros((m.num_layers, 2, n, m.num_kv_heads, m.head_dim), dtype=runner.dtype)
    runner.pattern.write(data.view(torch.int64), list(range(n)), chain(ROOT, tokens),
                         list(range(n)))
    return data


def test_a_kv_import_runs_on_the_copy_engine_and_a_joining_leg_waits_for_its_own_alone(
        emu_dir):
    """As the CUDA cache's side stream: an import queues on the copy engine after the
    steps queued before it (its blocks may have been freed by one), not on the steps'
    queue; a step of legs that ran before goes on beside it, and the step a leg joins
    starts once the imports into that leg's blocks end -- not another leg's, queued
    later on the copy engine."""
    from engine.execute import ScheduledItem
    from engine.request import Request

    model = load_model_config(emu_dir)
    cfg = EngineConfig(str(emu_dir), model, CacheConfig(16, None, 1 << 30, True),
                       SchedulerConfig(64, 16, 16, True, 1024), dtype="bfloat16",
                       emulate=TINY)
    runner = EmulatedRunner(cfg, num_blocks=64)
    clock = FakeClock()
    runner.accel = dev = EmulatedDevice(clock, clock.sleep)
    kv, costs = runner.kv, runner.costs

    def at(t):  # a time on the device's clock (~100 s: approx's relative 1e-6 is 0.1 ms)
        return pytest.approx(t, rel=0, abs=1e-9)

    running = Request("running", [1, 2, 3], greedy(8))
    running.block_ids = [0]
    for s in runner.launch([ScheduledItem(running, 0, 3, True)]).result():
        s.request.append_token(s.token_id)
    t0 = dev.free_at
    first = list(range(7, 7 + 512))  # a long prompt's KV, for a leg still pending
    kv.import_tokens(list(range(10, 42)), 0, _pattern_kv(runner, first))
    assert kv.import_ends[10] == at(t0 + costs.kv_import_s(512))
    assert dev.free_at == t0 and dev.copy_s == pytest.approx(costs.kv_import_s(512))
    alone = runner.launch([ScheduledItem(running, 3, 1, False)])  # it ran in the last step
    assert runner.step_window[0] == at(t0)  # beside the copy
    t1 = dev.free_at
    joiner = Request("joiner", list(range(5, 45)), greedy(8))  # its KV from a prefill worker
    joiner.block_ids = [1, 2, 3]
    kv.charge_import(joiner.block_ids, 0, 40)  # at hand-off (the intake's order)
    kv.copy_in(joiner.block_ids, 0, _pattern_kv(runner, joiner.prompt_token_ids))
    own = t1 + costs.kv_import_s(40)  # after the step queued before it
    assert list(kv.import_ends[:5]) == at([0.0, own, own, own, 0.0])
    later = [100 + i for i in range(100)]  # another pending leg's, queued after the joiner's
    kv.import_tokens(list(range(42, 49)), 0, _pattern_kv(runner, later))
    assert kv.import_ends[42] == at(own + costs.kv_import_s(100))
    for s in alone.result():
        s.request.append_token(s.token_id)
    joiner.append_token(runner._draw(joiner, chain(ROOT, joiner.prompt_token_ids)[-1])[0])
    both = runner.launch([ScheduledItem(running, 4, 1, False),  # the joiner joins
                          ScheduledItem(joiner, 40, 1, False)])
    assert clock.t == at(t1) and t1 < own  # the device was free: it waited for
    assert runner.step_window[0] == at(own)  # its own import, not the later one
    out = both.result()
    assert [s.request for s in out] == [running, joiner] and kv.checked_ranges == 3
    h = chain(ROOT, joiner.prompt_token_ids + joiner.output_token_ids)[-1]
    assert out[1].token_id == runner._draw(joiner, h)[0]  # read off the imported KV


def test_the_kv_pattern_checks_out_where_written_and_catches_a_flipped_byte_or_a_shift():
    layers, kvh, d = 3, 2, 16
    pat = KVPattern(layers, 64)
    cache = torch.zeros((layers, 2, 32, kvh, d), dtype=torch.bfloat16)
    words = cache.view(torch.int64)
    states = chain(ROOT, [5, 9, 11, 3, 7])
    pat.write(words, [10, 11, 12, 13, 14], states, list(range(5)))
    assert pat.state_at(words, [12], [2]) == [states[2]]
    payload = cache[:, :, 10:15].clone()  # positions 0..4
    pat.check(payload, 0)  # what was written checks out
    pat.check(payload[1:], 0, layer_start=1)  # a frame of later layers too
    bad = payload.clone()
    bad.view(torch.uint8)[2, 1, 3, 1, 5] ^= 0x10  # one byte of layer 2, V, position 3
    with pytest.raises(PatternError, match="position 3, layer 2 V"):
        pat.check(bad, 0)
    with pytest.raises(PatternError, match="emulated KV check failed"):
        pat.check(payload, 1)  # the same bytes placed one position later
    with pytest.raises(PatternError):
        pat.check(payload[1:], 0)  # layers 1.. presented as layers 0..


def _llm(emu_dir, chunk=16) -> LLM:
    model = load_model_config(emu_dir)
    cfg = EngineConfig(str(emu_dir), model, CacheConfig(16, None, 1 << 30, True),
                       SchedulerConfig(64, 16, chunk, True, 1024), dtype="bfloat16",
                       emulate=TINY)
    return LLM.from_config(cfg)


PROMPTS = [list(range(1, 41)), list(range(1, 33)) + [7, 7, 7], [9] * 5, [100 + i for i in range(70)]]


def test_greedy_streams_are_identical_colocated_and_disaggregated_and_every_range_checks(
        emu_dir):
    llm = _llm(emu_dir)
    colocated = [o.token_ids for o in llm.generate(PROMPTS, greedy(12))]
    assert all(0 <= t < 2048 for out in colocated for t in out)
    assert len({tuple(o) for o in colocated}) == len(PROMPTS)  # prompts differ, streams too
    pair = PDPair(emu_dir, p_block=16, d_block=8, chunk=16, budget=32, emulate=TINY)
    try:
        for i, p in enumerate(PROMPTS):
            assert pair.submit(f"r{i}", p, greedy(12))
        pair.run()
        assert [pair.outputs[f"r{i}"] for i in range(len(PROMPTS))] == colocated
        assert pair.decode.runner.kv.checked_ranges >= len(PROMPTS)
        stats = pair.decode.runner.stats()
        assert stats["device_steps"] > 0 and 0 < stats["device_busy_ratio"] <= 1
        _stats_reach_metrics(pair)
        pair.leak_check()
    finally:
        pair.close()


def _stats_reach_metrics(pair: PDPair) -> None:
    """The device's accounting in the workers' stats (GetStats' figures) and /metrics."""
    from prometheus_client import generate_latest

    from cluster.metrics import ServiceMetrics
    from cluster.router.types import WorkerStats

    workers = []
    for eng in (pair.prefill, pair.decode):
        s = eng.stats()
        assert s.emulated.startswith("emulated h200, tiny: analytic, not measured")
        assert s.device_busy_s > 0 and s.device_wall_s >= s.device_busy_s
        assert s.host_lag_steps > 0 and s.host_lag_p99_s >= s.host_lag_p50_s >= 0
        assert s.process_cpu_s > 0
        figures = s.figures()
        assert figures["device_busy_ratio"] == pytest.approx(s.device_busy_s / s.device_wall_s)
        workers.append(WorkerStats(eng.worker_id, s.role, True, extra=figures))
    metrics = ServiceMetrics()
    metrics.update_workers(workers)
    metrics.emulated = TINY.label
    text = generate_latest(metrics.registry).decode()
    assert f'pdserve:emulated_device_info{{device="{TINY.label}"}} 1.0' in text
    for w in ("prefill-0", "decode-0"):
        assert f'pdserve:device_busy_ratio{{role="{w[:-2]}",worker="{w}"}}' in text
        assert f'pdserve:host_lag_seconds{{quantile="0.99",role="{w[:-2]}",worker="{w}"}}' in text


def test_seeded_streams_repeat_and_logprobs_have_their_usual_shape(emu_dir):
    llm = _llm(emu_dir)
    sp = SamplingParams(temperature=0.8, seed=7, max_tokens=6, ignore_eos=True, logprobs=3)
    a, b = llm.generate([PROMPTS[0], PROMPTS[0]], sp)
    assert a.token_ids == b.token_ids
    greedy_out = llm.generate([PROMPTS[0]], greedy(6))[0]
    assert a.token_ids != greedy_out.token_ids  # the seed is part of the draw
    assert len(a.logprobs) == 6 and all(len(lp.top) == 3 and lp.rank == 1 for lp in a.logprobs)
    assert [lp.token_id for lp in a.logprobs] == a.token_ids
    stop = llm.generate([PROMPTS[0]], replace(greedy(6), stop_token_ids=(greedy_out.token_ids[2],)))
    assert stop[0].token_ids == greedy_out.token_ids[:3]  # a stop token ends it as usual


def test_a_corrupted_kv_frame_fails_its_request_with_a_clear_error_and_leaks_nothing(emu_dir):
    pair = PDPair(emu_dir, chunk=16, budget=32, emulate=TINY)
    hit = corrupt_once(pair, "bad")
    try:
        assert pair.submit("good", PROMPTS[0], greedy(5))
        assert pair.submit("bad", PROMPTS[3], greedy(5))
        pair.run()
        assert hit and pair.finished["bad"] == EventKind.FAILED
        failed = [e for e in pair.events if e.kind == EventKind.FAILED]
        assert {e.leg_id for e in failed} == {"bad"}  # (decode's, then the sender's)
        assert failed[0].worker_id == "decode-0"
        assert "emulated KV check failed at position" in failed[0].message
        assert "corrupted or misplaced in transfer" in failed[0].message
        assert len(pair.outputs["good"]) == 5 and pair.finished["good"] != EventKind.FAILED
        pair.prefill.abort("bad")  # the router's part: end the prefill leg too
        pair.leak_check()
    finally:
        pair.close()


def test_a_kv_pool_that_cannot_hold_one_request_is_a_clear_error(emu_dir):
    model = load_model_config(emu_dir)
    cfg = EngineConfig(str(emu_dir), model, CacheConfig(16, None, 16 * 256 * 10),
                       SchedulerConfig(max_model_len=1024), dtype="bfloat16", emulate=TINY)
    with pytest.raises(ValueError, match="less than one request of max_model_len 1024"):
        EmulatedRunner(cfg)


def test_an_unknown_profile_or_shape_is_named():
    with pytest.raises(ValueError, match="neither an analytic profile"):
        EmulateConfig("h300", "tiny")
    with pytest.raises(ValueError, match="unknown model shape 'llama-9'"):
        EmulateConfig("h200", "llama-9")
    assert EmulateConfig("h200", "llama-3-8b").label == \
        "emulated h200, llama-3-8b: analytic, not measured"


def test_a_kv_fraction_sends_part_of_each_chunk_and_the_link_is_charged_in_full(emu_dir):
    half = EmulateConfig("h200", "tiny", kv_fraction=0.5)
    assert half.layers_sent(2) == 1 and half.layers_sent(32) == 16
    assert "KV sent: 0.5 of each chunk's bytes" in half.label
    colocated = [o.token_ids for o in _llm(emu_dir).generate(PROMPTS[:2], greedy(6))]
    sent = {}
    for em in (TINY, half):
        pair = PDPair(emu_dir, chunk=16, budget=32, emulate=em)
        try:
            for i, p in enumerate(PROMPTS[:2]):
                assert pair.submit(f"r{i}", p, greedy(6))
            pair.run()
            assert [pair.outputs[f"r{i}"] for i in range(2)] == colocated
            sent[em.kv_fraction] = pair.prefill.stats().kv_bytes_sent
            pair.leak_check()
        finally:
            pair.close()
    assert sent[0.5] < sent[1.0] and sent[0.5] > 0  # one layer of two (and frame headers)
    from cluster.config.serve import ServeConfig
    from cluster.launch.worker_specs import transfer_config

    def link(fraction: float):
        cfg = ServeConfig.from_dict({"model": {"emulate": "h200", "model_shape": "tiny",
                                               "emulate_kv_fraction": fraction},
                                     "transfer": {"link_gbps": 8.0}})
        return transfer_config(cfg, load_model_config(emu_dir), b"s" * 32)

    full, part = link(1.0), link(0.5)
    assert part.link_rate_bytes_per_s == pytest.approx(full.link_rate_bytes_per_s / 2)
    assert part.credit_window_bytes == pytest.approx(full.credit_window_bytes / 2, abs=1)


def test_a_calibration_file_drives_the_device_and_a_step_costs_what_it_says(emu_dir, tmp_path):
    from sim.synthetic import synthetic_calibration

    cal = synthetic_calibration(prefill=lambda c, p: 1e-4 * c, decode=lambda b, L: 2e-3 + 1e-5 * b,
                                sample_s=1e-5)
    path = cal.save(tmp_path / "cal.json")
    em = EmulateConfig(str(path), "tiny")
    assert em.label == "emulated cal.json, tiny: calibration file"
    model = load_model_config(emu_dir)
    runner = EmulatedRunner(EngineConfig(str(emu_dir), model, CacheConfig(16, 64),
                                         SchedulerConfig(max_model_len=1024), dtype="bfloat16",
                                         emulate=em))
    assert runner.label.startswith(em.label) and "synthetic, not measured" in runner.label
    from engine.execute import ScheduledItem
    from engine.request import Request

    r = Request("r0", list(range(1, 33)), greedy(4))
    r.block_ids = [0, 1]
    out = runner.execute_and_sample([ScheduledItem(r, 0, 32, True)])
    assert len(out) == 1 and 0 <= out[0].token_id < model.vocab_size
    s = runner.stats()  # one prefill step of 32 tokens that samples one row
    assert s["device_busy_s"] == pytest.approx(1e-4 * 32 + 1e-5)


def test_serve_and_simulate_take_the_same_emulate_flags():
    import argparse

    from cluster.config.serve import ServeConfig
    from sim.cli import add_simulate_args, load_cost_model

    cfg = ServeConfig.from_dict({"model": {"emulate": "h100", "model_shape": "llama-3-8b"}})
    assert cfg.model.emulate_config.label == "emulated h100, llama-3-8b: analytic, not measured"
    assert cfg.model.resolve_path().name == "emulated-llama-3-8b"
    with pytest.raises(ValueError, match="needs model.model_shape"):
        ServeConfig.from_dict({"model": {"emulate": "h200"}})
    with pytest.raises(ValueError, match="unknown model shape 'gpt-9'"):
        ServeConfig.from_dict({"model": {"emulate": "h200", "model_shape": "gpt-9"}})
    p = argparse.ArgumentParser()
    add_simulate_args(p)
    costs = load_cost_model(p.parse_args(["--emulate", "h100", "--model-shape", "qwen2.5-7b"]))
    assert "H100" in costs.label and "qwen2.5-7b" in costs.label


def test_simulate_client_ms_is_the_analytic_profiles_client_trip():
    import argparse

    from sim.cli import add_simulate_args, load_cost_model

    p = argparse.ArgumentParser()
    add_simulate_args(p)
    base = ["--emulate", "h200", "--model-shape", "llama-3-8b"]
    assert load_cost_model(p.parse_args(base)).client_s == 0.0  # an in-process client
    assert load_cost_model(p.parse_args([*base, "--client-ms", "0.5"])).client_s == 0.0005
    with pytest.raises(SystemExit, match="client-ms"):
        load_cost_model(p.parse_args([*base, "--client-ms", "-1"]))
