"""The decode engine with the host one step ahead of the device (scheduler.overlap;
docs/design.md §3, "Overlap"): step N + 1 is scheduled while N runs, N's events built
while N + 1 runs.

- A stateful property test drives the overlapped engine with a fake runner (no model)
  through KV arrivals, stop tokens, max_tokens, aborts, link failures and preemptions at
  tiny pools, many of them landing while the leg's step is in flight. After every rule:
  every batch fed the token the leg's previous step produced, at the next position;
  no leg reports a token after it ended nor past its stop token or max_tokens; a leg
  that finished reported exactly its whole stream; promises and block integrity hold;
  once drained, every block is free. The same machine runs with overlap off.
- On the tiny real model and on the emulated device: greedy tokens, stop tokens,
  max_tokens and log-probs are the same with overlap on as off.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import decode_worker.engine as decode_engine
from decode_worker.engine import DecodeEngine
from decode_worker.scheduler import DecodeSchedulerConfig
from engine.config import EmulateConfig
from engine.execute import Sampled, StepLaunch
from engine.request import RequestStatus, SamplingParams
from kv_transfer.base import KVChunk, KVReceiver, ReceiveEvents
from runtime.messages import DecodeTask, EventKind
from tests.pd_harness import STREAM_PROMPTS, PDPair, engine_cfg, greedy, streams

STOP = 3  # the fake model's stop token
seen: Counter[str] = Counter()  # states the machines reached (checked below)
IDS = [f"id{i}" for i in range(5)]  # few names: ids are reused once their leg ended


def fake_token(seed: int, pos: int) -> int:
    """The fake model's token after position ``pos`` of the leg drawn with ``seed``."""
    h = (seed * 1_000_003 + pos * 7919) % 1009
    return STOP if h % 11 == 0 else 10 + h % 50


class _FakeKV:
    def import_tokens(self, *args, **kwargs) -> None:
        pass


class FakeRunner:
    """The runner's launch/collect interface; checks what each batch feeds."""

    samples_itself = True

    def __init__(self, machine):
        self.kv = _FakeKV()
        self.m = machine

    def launch(self, items) -> StepLaunch:
        out = []
        for it in items:
            r = it.request
            assert r.status == RequestStatus.RUNNING, f"{r.request_id}: launched {r.status}"
            leg = self.m.legs_by_req[id(r)]
            n = r.num_prompt_tokens
            assert it.start == leg["next_pos"], "a position skipped or fed twice"
            fed = it.to_chunk().token_ids[0]
            assert fed == leg["expected"][it.start - n], "fed another token than produced"
            leg["next_pos"] += 1
            out.append(Sampled(r, fake_token(r.sampling_params.seed, it.start)))
        self.m.launched += 1
        return StepLaunch(lambda: out)


class QueueReceiver(KVReceiver):
    """Each poll returns everything queued since the last one."""

    def __init__(self):
        self.ev = ReceiveEvents()

    endpoint = "fake://decode"

    def poll(self) -> ReceiveEvents:
        ev, self.ev = self.ev, ReceiveEvents()
        return ev

    def release(self, chunk) -> None:
        pass

    def abort(self, request_id) -> None:  # its frames not taken yet are dropped
        self.forget(request_id)

    def forget(self, rid: str) -> None:
        ev = self.ev
        ev.chunks[:] = [c for c in ev.chunks if c.request_id != rid]
        ev.completed[:] = [c for c in ev.completed if c != rid]
        ev.failed[:] = [f for f in ev.failed if f[0] != rid]

    def expect(self, request_id) -> None:
        pass

    def stats(self):
        return {}

    def close(self) -> None:
        pass


class OverlapMachine(RuleBasedStateMachine):
    overlap = True
    model_dir = None  # set by the test

    @initialize(num_blocks=st.integers(4, 12), block_size=st.integers(1, 4),
                headroom=st.integers(0, 3), max_seqs=st.integers(1, 4))
    def setup(self, num_blocks, block_size, headroom, max_seqs):
        self.rx = QueueReceiver()
        self.legs: dict[str, dict] = {}  # rid -> its current leg
        self.legs_by_req: dict[int, dict] = {}
        self.seeds = iter(range(1, 1 << 30))
        self.launched = 0
        self.runner = FakeRunner(self)
        cfg = replace(engine_cfg(self.model_dir, block_size), scheduler=replace(
            engine_cfg(self.model_dir, block_size).scheduler, max_model_len=64))
        real = decode_engine.make_runner
        decode_engine.make_runner = lambda *a, **k: self.runner
        try:
            self.eng = DecodeEngine("decode-0", cfg, DecodeSchedulerConfig(
                max_num_seqs=max_seqs, headroom_tokens=headroom, max_model_len=64,
                overlap=self.overlap), self.rx, num_blocks)
        finally:
            decode_engine.make_runner = real
        self.capacity = num_blocks * block_size
        self.m = cfg.model

    def live(self, state=None) -> list[str]:
        return [rid for rid, leg in self.legs.items()
                if not leg["ended"] and (state is None or leg["state"] == state)]

    @rule(rid=st.sampled_from(IDS), n=st.integers(1, 16), max_tokens=st.integers(2, 12))
    def reserve(self, rid, n, max_tokens):
        if rid in self.live() or n + 1 > self.eng.max_len:
            return
        self.rx.forget(rid)  # (a new leg of a reused id: nothing of the old one's)
        seed = next(self.seeds)
        while fake_token(seed, n - 1) == STOP:  # (a leg the prefill ended: never reserved)
            seed = next(self.seeds)
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, seed=seed,
                            stop_token_ids=(STOP,), ignore_eos=True)
        if not self.eng.reserve(DecodeTask(rid, n, sp)):
            return
        first = fake_token(seed, n - 1)
        # the whole stream the leg may produce: the prefill's token, then its own
        expected = [first] + [fake_token(seed, n + i) for i in range(64)]
        req = self.eng.scheduler.pending[rid].request
        leg = {"n": n, "seed": seed, "expected": expected, "reported": [], "ended": False,
               "state": "pending", "received": 0, "max_tokens": max_tokens,
               "next_pos": n, "finish": None, "req": req}
        self.legs[rid] = leg
        self.legs_by_req[id(req)] = leg

    @precondition(lambda self: hasattr(self, "eng") and self.live("pending"))
    @rule(pick=st.integers(0, 99), size=st.integers(1, 16))
    def chunk_arrives(self, pick, size):
        pend = self.live("pending")
        rid = pend[pick % len(pend)]
        leg = self.legs[rid]
        start = leg["received"]
        end = min(start + size, leg["n"])
        final = end == leg["n"]
        payload = torch.zeros(self.m.num_layers, 2, end - start, 1, 1)
        self.rx.ev.chunks.append(KVChunk(rid, 0, start, end, payload, is_final=final,
                                         first_token=leg["expected"][0] if final else None))
        if final:
            self.rx.ev.completed.append(rid)
            leg["state"] = "sent"
        leg["received"] = end

    @precondition(lambda self: hasattr(self, "eng") and self.live())
    @rule(pick=st.integers(0, 99))
    def abort(self, pick):
        live = self.live()
        rid = live[pick % len(live)]
        seen["abort in flight"] += self._in_flight(rid)
        self.eng.abort(rid)
        self.legs[rid]["ended"] = True

    @precondition(lambda self: hasattr(self, "eng") and self.eng._inflight is not None)
    @rule(pick=st.integers(0, 99))
    def abort_in_flight(self, pick):
        """An abort (a stop string, a client gone) landing while the leg's step runs."""
        fly = [i.request.request_id for i in self.eng._inflight.items]
        rid = fly[pick % len(fly)]
        if self.legs[rid]["ended"]:
            return
        seen["abort in flight"] += 1
        self.eng.abort(rid)
        self.legs[rid]["ended"] = True

    @precondition(lambda self: hasattr(self, "eng") and self.live())
    @rule(pick=st.integers(0, 99), often=st.integers(0, 3))
    def link_fails(self, pick, often):
        """The leg's KV link fails (one draw in four: else few legs get to run): reported
        at the next step (its own step may be in flight then)."""
        if often:
            return
        live = self.live()
        rid = live[pick % len(live)]
        self._link_fails(rid)

    @precondition(lambda self: hasattr(self, "eng") and self.eng._inflight is not None)
    @rule(pick=st.integers(0, 99))
    def link_fails_in_flight(self, pick):
        fly = [i.request.request_id for i in self.eng._inflight.items]
        rid = fly[pick % len(fly)]
        if not self.legs[rid]["ended"]:
            self._link_fails(rid)

    def _link_fails(self, rid: str) -> None:
        seen["link failure in flight"] += self._in_flight(rid)
        self.rx.ev.failed.append((rid, "link dropped"))
        self.legs[rid]["failing"] = True

    def _in_flight(self, rid: str) -> bool:
        fly = self.eng._inflight
        return fly is not None and any(i.request.request_id == rid for i in fly.items)

    @precondition(lambda self: hasattr(self, "eng"))
    @rule(times=st.integers(1, 3))
    def step(self, times):
        for _ in range(times):
            self._take(self.eng.step())

    def _take(self, events) -> None:
        for ev in events:
            leg = self.legs.get(ev.leg_id)
            assert leg is not None and not leg["ended"], f"{ev.kind} for an ended leg"
            if ev.kind == EventKind.TOKENS:
                if ev.first_token is not None:
                    assert not leg["reported"]
                    leg["reported"].append(ev.first_token)
                leg["reported"].extend(ev.token_ids)
                got = leg["reported"]
                assert got == leg["expected"][:len(got)], "a token out of its stream"
                assert STOP not in got[:-1], "a token reported past a stop token"
                assert len(got) <= leg["max_tokens"], "a token reported past max_tokens"
                if ev.finish_reason:
                    leg["ended"], leg["finish"] = True, ev.finish_reason
                    seen[f"finish {getattr(ev.finish_reason, 'value', ev.finish_reason)}"] += 1
                    k = len(got)
                    # it ended where the stream ends: a stop token, max_tokens, or the cap
                    assert got[-1] == STOP or k == leg["max_tokens"] or \
                        leg["n"] + k >= self.eng.max_len, "ended early"
            elif ev.kind in (EventKind.FAILED, EventKind.PREEMPTED):
                assert ev.kind == EventKind.PREEMPTED or leg.get("failing"), ev.message
                leg["ended"] = True
                seen[ev.kind.value] += 1
            if leg["state"] == "sent" and not leg["ended"]:
                leg["state"] = "running"

    @invariant()
    def promises_and_integrity(self):
        if hasattr(self, "eng"):
            s = self.eng.scheduler
            s.bm.check_integrity()
            assert s.promised_free_blocks() >= 0
            assert s.owed_blocks() == s._owed_total

    def teardown(self):
        if not hasattr(self, "eng"):
            return
        for rid in self.live("pending"):  # the rest of every leg's KV
            leg = self.legs[rid]
            payload = torch.zeros(self.m.num_layers, 2, leg["n"] - leg["received"], 1, 1)
            self.rx.ev.chunks.append(KVChunk(rid, 0, leg["received"], leg["n"], payload,
                                             is_final=True, first_token=leg["expected"][0]))
            self.rx.ev.completed.append(rid)
            leg["state"] = "sent"
        for _ in range(200):
            if not self.eng.has_work:
                break
            self._take(self.eng.step())
        assert not self.eng.has_work, "the engine did not drain"
        assert self.eng.bm.num_used_blocks == 0, "blocks leaked"
        self.eng.bm.check_integrity()
        for rid, leg in self.legs.items():
            assert leg["ended"], f"{rid} never ended"
            if leg["finish"] is not None:  # exactly its whole stream, no extra token
                got = leg["reported"]
                stop = leg["expected"].index(STOP) + 1 if STOP in leg["expected"] else 99
                assert len(got) == min(stop, leg["max_tokens"],
                                    max(2, self.eng.max_len - leg["n"])), got


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_random_lifecycles_with_the_host_one_step_ahead(tiny_model, overlap):
    machine = type("Machine", (OverlapMachine,), {"overlap": overlap,
                                                  "model_dir": tiny_model})
    seen.clear()  # (this run's states only)
    run_state_machine_as_test(machine, settings=settings(
        max_examples=120 if overlap else 25, stateful_step_count=40, deadline=None,
        derandomize=True, suppress_health_check=[HealthCheck.too_slow]))
    if overlap:  # the machine reached what it is for
        for what in ("abort in flight", "link failure in flight", "finish stop",
                     "finish length", "preempted"):
            assert seen[what] > 0, (what, dict(seen))


# ---- a real model and the emulated device: the same tokens either way ----------------
PROMPTS = STREAM_PROMPTS


@pytest.mark.parametrize("d_block", [4, 16])
def test_stop_tokens_max_tokens_and_logprobs_are_the_same_with_overlap(tiny_model, d_block):
    base, _ = streams(PDPair(tiny_model, d_block=d_block, chunk=7, overlap=False), PROMPTS,
                       greedy(9))
    stop = base[0][4]  # ends r0 at its 5th token, others where it occurs (or max_tokens)
    sp = replace(greedy(9), stop_token_ids=(stop,), logprobs=2)
    off = streams(PDPair(tiny_model, d_block=d_block, chunk=7, overlap=False), PROMPTS, sp)
    on = streams(PDPair(tiny_model, d_block=d_block, chunk=7, overlap=True), PROMPTS, sp)
    assert on == off
    assert off[0][0] == base[0][:5]
    assert on[0] == [b[:b.index(stop) + 1] if stop in b else b for b in base]


def test_the_emulated_device_gives_the_same_streams_with_overlap():
    from engine.emulate.model_dir import emulated_model_dir

    tiny = EmulateConfig("h200", "tiny")
    d = emulated_model_dir("tiny")
    sp = replace(greedy(12), logprobs=2)
    off = streams(PDPair(d, d_block=8, budget=32, emulate=tiny, overlap=False), PROMPTS, sp)
    pair = PDPair(d, d_block=8, budget=32, emulate=tiny, overlap=True)
    on = streams(pair, PROMPTS, sp)
    assert on == off
    assert pair.decode.runner.kv.checked_ranges >= len(PROMPTS)
    assert pair.decode.stats().num_steps > 0
