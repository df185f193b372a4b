"""The overlapped decode engine's KV intake off the loop thread (decode_worker/intake.py):
the check and copy of an arrived range run on the intake thread, into blocks still held
by their (pending) leg, taken in once written (the loop waits for none a leg does not need).

- The overlap test's stateful machine (tests/unit/test_decode_overlap.py), its fake cache
  now one whose import may leave the loop: every range is written on the intake thread
  while its blocks are still the leg's (a leg aborted, failed or expired meanwhile frees
  them only after), a range still in flight between step calls is a pending leg's, no
  token out of its stream, no block leaked.
- The emulated device, overlapped: every range goes through the intake, the streams are
  the serial loop's, a corrupted range still fails its leg alone with the check's words.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, run_state_machine_as_test

from decode_worker.intake import KVIntake
from engine.config import EmulateConfig
from runtime.messages import EventKind
from tests.pd_harness import STREAM_PROMPTS as PROMPTS
from tests.pd_harness import PDPair, corrupt_once, greedy, streams
from tests.unit.test_decode_overlap import OverlapMachine

written: list[str] = []  # what the intake machine's writes saw (checked below)


class _IntakeKV:
    """A cache whose import leaves the loop (``copy_in``): each write checks, on the
    intake thread and after a pause, that its blocks are still allocated."""

    def __init__(self, machine):
        self.m = machine
        self.charged = 0

    def charge_import(self, block_ids, start: int, num_tokens: int) -> None:
        assert threading.current_thread() is threading.main_thread()
        self.charged += 1

    def copy_in(self, block_ids, start, data, layer_start=0, head_start=None) -> None:
        assert threading.current_thread() is not threading.main_thread()
        time.sleep(0.0002)  # (the loop goes on meanwhile: ends legs, fails them)
        ref = self.m.eng.bm._ref  # (an assertion here would fail only its leg)
        written.append("ok" if all(ref[b] > 0 for b in block_ids) else "into freed blocks")

    def import_tokens(self, *a, **k):  # (the inline path: never taken with an intake)
        raise AssertionError("the overlapped engine imported on the loop thread")


class IntakeMachine(OverlapMachine):
    overlap = True

    @initialize(num_blocks=st.integers(4, 12), block_size=st.integers(1, 4),
                headroom=st.integers(0, 3), max_seqs=st.integers(1, 4))
    def setup(self, num_blocks, block_size, headroom, max_seqs):  # (the overlap test's)
        OverlapMachine.setup(self, num_blocks, block_size, headroom, max_seqs)
        self.runner.kv = _IntakeKV(self)
        self.eng._intake = KVIntake.for_cache(self.runner.kv)
        assert self.eng._intake is not None

    @invariant()
    def only_pending_legs_ranges_are_in_flight_between_steps(self):
        if hasattr(self, "eng"):
            pending = self.eng.scheduler.pending
            in_flight = self.eng._intake._jobs  # noqa: SLF001 - what the thread still writes
            for _, chunk, p in in_flight:  # a leg that ended had its ranges joined first
                assert pending.get(chunk.request_id) is p and p.in_intake > 0
            for p in pending.values():  # counted until taken in
                assert p.in_intake >= sum(q is p for _, _, q in in_flight)


def test_random_lifecycles_with_the_intake_off_the_loop(tiny_model):
    machine = type("Machine", (IntakeMachine,), {"model_dir": tiny_model})
    written.clear()
    run_state_machine_as_test(machine, settings=settings(
        max_examples=40, stateful_step_count=30, deadline=None, derandomize=True,
        suppress_health_check=[HealthCheck.too_slow]))
    assert "ok" in written  # ranges went through the intake thread
    assert "into freed blocks" not in written


TINY = EmulateConfig("h200", "tiny")


def _emu_dir():
    from engine.emulate.model_dir import emulated_model_dir

    return emulated_model_dir("tiny")


def test_the_emulated_device_overlapped_takes_its_kv_in_off_the_loop_with_the_same_streams():
    d = _emu_dir()
    sp = replace(greedy(12), logprobs=2)
    off = streams(PDPair(d, d_block=8, budget=32, emulate=TINY, overlap=False), PROMPTS, sp)
    pair = PDPair(d, d_block=8, budget=32, emulate=TINY, overlap=True)
    intake = pair.decode._intake
    assert intake is not None
    on = streams(pair, PROMPTS, sp)
    assert on == off
    # every range through the intake, each one checked
    assert intake.ranges >= len(PROMPTS)
    assert pair.decode.runner.kv.checked_ranges == intake.ranges


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_a_corrupted_range_fails_its_leg_alone_on_the_intake_thread_too(overlap):
    pair = PDPair(_emu_dir(), chunk=16, budget=32, emulate=TINY, overlap=overlap)
    hit = corrupt_once(pair, "bad")
    try:
        assert pair.submit("good", PROMPTS[0], greedy(5))
        assert pair.submit("bad", [100 + i for i in range(70)], greedy(5))
        pair.run()
        assert hit and pair.finished["bad"] == EventKind.FAILED
        failed = [e for e in pair.events if e.kind == EventKind.FAILED]
        assert {e.leg_id for e in failed} == {"bad"}
        assert "emulated KV check failed at position" in failed[0].message
        assert len(pair.outputs["good"]) == 5
        pair.prefill.abort("bad")
        pair.leak_check()
    finally:
        pair.close()
