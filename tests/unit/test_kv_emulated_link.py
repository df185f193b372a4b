"""The emulated link is the transport's (kv_transfer/emulated_link.py): its wire
serializes bytes at the rate, frames and acks arrive a latency late, and the send
policy, queue, credit window and pacer above it stay as configured."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from kv_transfer import TransferConfig, make_receiver, make_sender
from kv_transfer.emulated_link import EmulatedLink
from kv_transfer.pacing import ManualClock, TokenBucket, Unpaced
from kv_transfer.testing import PagedKV, make_chunks, pump, random_bounds
from kv_transfer.transport import LinkTransport
from kv_transfer.wire import Ack

RATE = 1e6  # bytes/s: 1000 bytes hold the wire 1 ms


class Events:
    def __init__(self) -> None:
        self.acks: list[tuple[float, list[Ack]]] = []
        self.failures: list[str] = []
        self.clock: ManualClock | None = None
        self.got = threading.Event()

    def on_acks(self, acks: list[Ack]) -> None:
        self.acks.append((self.clock() if self.clock else 0.0, acks))
        self.got.set()

    def on_failure(self, reason: str) -> None:
        self.failures.append(reason)
        self.got.set()

    def busy(self) -> tuple[int, int]:
        return (0, 0)


class Recording(LinkTransport):
    """The real transport underneath: records when each write reaches it."""

    def __init__(self, clock: ManualClock, fail: bool = False) -> None:
        self.clock, self.fail = clock, fail
        self.writes: list[tuple[float, int]] = []
        self.got = threading.Event()

    def connect(self) -> None:
        pass

    def transmit(self, pieces) -> None:
        if self.fail:
            raise ConnectionError("peer gone")
        self.writes.append((self.clock(), sum(p.nbytes for p in pieces)))
        self.got.set()

    def close(self) -> None:
        pass


class Frame:
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


def wait_for(inner: Recording, n: int) -> None:
    """Until the delay line has handed ``n`` writes to the transport (it runs on its own
    thread); a lost write fails here instead of hanging."""
    for _ in range(100):
        if len(inner.writes) >= n:
            return
        inner.got.wait(0.1)
        inner.got.clear()
    assert len(inner.writes) >= n, inner.writes


def emulated(latency_s: float, fail: bool = False) -> tuple[EmulatedLink, Recording, Events,
                                                             ManualClock]:
    clock, events = ManualClock(), Events()
    events.clock = clock
    link = EmulatedLink(RATE, latency_s, events, clock=clock, sleep=clock.advance)
    inner = Recording(clock, fail)
    return link.wrap(inner), inner, events, clock


def test_back_to_back_writes_hold_the_wire_for_their_bytes_and_an_idle_gap_restarts_it() -> None:
    link, inner, _, clock = emulated(0.0)
    try:
        for n in (1000, 3000, 500):  # the link thread is blocked while its bytes go out
            link.transmit([Frame(n)])
        assert clock() == pytest.approx(0.0045, abs=1e-12)
        clock.advance(0.010)  # idle: the next write starts when it is made
        link.transmit([Frame(2000)])
        assert clock() == pytest.approx(0.0165, abs=1e-12)
        wait_for(inner, 4)
        # no latency: each write reaches the transport, in order, once its last byte
        # left the wire (never before)
        assert [n for _, n in inner.writes] == [1000, 3000, 500, 2000]
        assert all(t >= due - 1e-12 for (t, _), due in
                   zip(inner.writes, (0.001, 0.004, 0.0045, 0.0165), strict=True))
    finally:
        link.close()
        link.release()


def test_frames_and_acks_arrive_one_latency_late_in_order() -> None:
    link, inner, events, clock = emulated(0.005)
    try:
        link.transmit([Frame(1000)])  # leaves the wire at 1 ms, due at the far end at 6 ms
        link.transmit([Frame(1000)])  # 2 ms -> 7 ms
        clock.advance(0.003)  # now 5 ms: nothing may have arrived
        assert inner.writes == []
        clock.advance(0.0025)  # 7.5 ms: both are due
        wait_for(inner, 2)
        assert all(t >= due for (t, _), due in zip(inner.writes, (0.006, 0.007), strict=True))
        ack = Ack("r", 0, 0, 0)
        link.events.on_acks([ack])  # the receiver's credit at 7.5 ms reaches the sender at 12.5
        assert events.acks == []
        clock.advance(0.005)
        assert events.got.wait(5.0)
        assert events.acks[0][1] == [ack] and events.acks[0][0] >= 0.0125
    finally:
        link.close()
        link.release()


def test_a_failing_transport_under_the_emulated_link_fails_the_link() -> None:
    link, _, events, _ = emulated(0.0, fail=True)
    try:
        link.transmit([Frame(10)])
        assert events.got.wait(5.0)
        assert "emulated link" in events.failures[0] and "peer gone" in events.failures[0]
    finally:
        link.close()
        link.release()


@pytest.mark.parametrize("policy", ["at_end", "eager", "paced"])
def test_every_policy_and_credit_window_runs_unchanged_over_the_emulated_link(policy) -> None:
    """The sender's link keeps the policy's hold, its own pacer and the configured
    window; the wire under it is the emulated one; a transfer is byte-exact."""
    window = 128 << 10  # below any old floor: small windows can be studied
    cfg = TransferConfig(send_policy=policy, rate_bytes_per_s=50e6 if policy == "paced" else 0,
                         link_rate_bytes_per_s=100e6, link_latency_s=0.001,
                         max_frame_bytes=64 << 10, credit_window_bytes=window)
    shape = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 32}
    src = PagedKV(**shape, block_size=16, num_blocks=256)
    dst = PagedKV(**shape, block_size=16, num_blocks=256)
    rx, tx = make_receiver(cfg), make_sender(cfg)
    try:
        rng, lens = random.Random(3), {"a": 700, "b": 300}
        for i, (rid, n) in enumerate(lens.items()):
            src.allocate(rid, n)
            src.fill_random(rid, n, seed=i)
            dst.allocate(rid, n)
            for c in make_chunks(src, rid, random_bounds(rng, n)):
                tx.send(c, dest=rx.endpoint)
        link = tx._links[rx.endpoint]
        assert isinstance(link.transport, EmulatedLink)
        assert link.sched.window == window
        assert link.sched.hold_until_final == (policy == "at_end")
        assert isinstance(link.sched.pacer, TokenBucket if policy == "paced" else Unpaced)
        assert pump(tx, rx, dst, lens) == ({}, {})
        for rid, n in lens.items():
            assert torch.equal(dst.export(rid, 0, n), src.export(rid, 0, n)), rid
        stats = tx.stats()
        assert stats["requests_finished"] == 2 and stats["inflight_bytes"] == 0
        assert stats["links"][rx.endpoint]["peak_inflight_bytes"] <= window
    finally:
        tx.close()
        rx.close()


def test_bad_emulated_link_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="link_latency_s"):
        TransferConfig(link_latency_s=-1.0)
    with pytest.raises(ValueError, match="rate >= 0 and latency >= 0"):
        EmulatedLink(-1.0, 0.0, Events())
