"""Send-queue disciplines and the link scheduler, driven step by step (no threads)."""

from __future__ import annotations

import random

import pytest

from kv_transfer import TransferConfig
from kv_transfer.link_scheduler import LinkScheduler
from kv_transfer.send_queue import FcfsQueue, QueuedFrame, WfqQueue

MiB = 1 << 20


def _f(rid: str, nbytes: int, tenant: str = "default", seq: int = 0) -> QueuedFrame:
    return QueuedFrame(rid, tenant, nbytes, 0.0, key=(rid, seq, 0))


def _sched(**kw) -> LinkScheduler:
    kw.setdefault("coalesce_bytes", 0)
    return LinkScheduler(TransferConfig(**kw))


def test_fcfs_serves_in_arrival_order_and_abort_removes_one_request():
    q = FcfsQueue()
    for i, rid in enumerate("abcab"):
        q.push(_f(rid, 10, seq=i))
    assert [f.key for f in q.remove_request("b")] == [("b", 1, 0), ("b", 4, 0)]
    assert [q.pop().key for _ in range(len(q))] == [("a", 0, 0), ("c", 2, 0), ("a", 3, 0)]


@pytest.mark.parametrize(("w_a", "w_b"), [(3.0, 1.0), (1.0, 1.0), (1.0, 4.0)])
def test_wfq_shares_bytes_between_tenants_in_proportion_to_weights(w_a, w_b):
    weights = {"A": w_a, "B": w_b}
    q = WfqQueue(lambda t: weights[t])
    rng = random.Random(0)
    # both tenants stay backlogged; frame sizes differ per tenant and per frame
    for i in range(4000):
        q.push(_f(f"a{i % 3}", rng.randint(64, 256) << 10, "A", i))
        q.push(_f(f"b{i % 2}", rng.randint(16, 1024) << 10, "B", i))
    sent = {"A": 0, "B": 0}
    while sum(sent.values()) < 400 * MiB:  # well before either tenant runs dry
        f = q.pop()
        sent[f.tenant] += f.nbytes
    share_a = sent["A"] / sum(sent.values())
    assert share_a == pytest.approx(w_a / (w_a + w_b), rel=0.10)


def test_wfq_a_long_prompt_does_not_monopolise_the_link_in_front_of_short_requests():
    q = WfqQueue(lambda t: 1.0)
    for i in range(100):
        q.push(_f("long", MiB, seq=i))
    q.pop()
    q.pop()  # the long request has been streaming for a while
    q.push(_f("short1", MiB))
    q.push(_f("short2", MiB))
    order = [q.pop().request_id for _ in range(6)]
    assert order.index("short1") <= 2 and order.index("short2") <= 3
    # and a request that comes back after idling gets no credit for its idle time
    assert order.count("long") >= 2


def test_wfq_keeps_each_request_in_order_and_abort_drops_only_that_request():
    q = WfqQueue(lambda t: {"A": 2.0}.get(t, 1.0))
    for i in range(5):
        q.push(_f("r1", 100, "A", i))
        q.push(_f("r2", 300, "B", i))
        q.push(_f("r3", 50, "A", i))
    assert len(q.remove_request("r3")) == 5 and len(q) == 10
    seen: dict[str, list[int]] = {}
    while len(q):
        f = q.pop()
        seen.setdefault(f.request_id, []).append(f.key[1])
    assert seen == {"r1": [0, 1, 2, 3, 4], "r2": [0, 1, 2, 3, 4]}
    assert q.peek() is None


def test_at_end_holds_every_frame_until_the_final_chunk_is_queued():
    s = _sched(send_policy="at_end")
    for i in range(3):
        s.enqueue(_f("r", 10, seq=i), completes_request=False)
    s.enqueue(_f("other", 10), completes_request=False)
    assert s.next_batch(0.0) == ([], None) and s.held_bytes == 40
    s.enqueue(_f("r", 10, seq=3), completes_request=True)
    got = []
    while (batch := s.next_batch(0.0)[0]):
        got += [f.key[1] for f in batch]
    assert got == [0, 1, 2, 3] and s.held_bytes == 10  # "other" still waits for its final


def test_eager_sends_right_away_and_coalesces_small_frames():
    s = _sched(send_policy="eager", coalesce_bytes=100)
    for i in range(7):
        s.enqueue(_f("r", 30, seq=i), completes_request=i == 6)
    sizes = []
    while (batch := s.next_batch(0.0)[0]):
        sizes.append(len(batch))
    assert sizes == [3, 3, 1]  # 3 x 30 bytes fit in 100, a 4th would not


def test_credit_window_is_never_exceeded_and_acks_reopen_it():
    window = 8 * MiB
    s = _sched(credit_window_bytes=window, max_frame_bytes=4 * MiB, coalesce_bytes=16 * MiB)
    rng = random.Random(1)
    inflight: list[QueuedFrame] = []
    queued = 0
    for step in range(3000):
        if rng.random() < 0.5:
            s.enqueue(_f(f"r{step % 5}", rng.randint(1, 4 * MiB - (32 << 10)), seq=step),
                      completes_request=False)
            queued += 1
        if inflight and rng.random() < 0.4:
            f = inflight.pop(rng.randrange(len(inflight)))
            s.on_ack(f.nbytes)
        batch, wait = s.next_batch(float(step))
        inflight += batch
        assert wait is None
        assert s.inflight_bytes == sum(f.nbytes for f in inflight) <= window
        if len(s.queue) and not batch:  # blocked: only because the next frame does not fit
            assert s.inflight_bytes + s.queue.peek().nbytes > window
    assert s.peak_inflight_bytes <= window and queued > 1000


def test_abort_drops_held_and_queued_frames_but_not_in_flight_ones():
    s = _sched(send_policy="at_end")
    s.enqueue(_f("a", 10, seq=0), completes_request=True)
    assert len(s.next_batch(0.0)[0]) == 1
    s.enqueue(_f("a", 10, seq=1), completes_request=False)
    s.enqueue(_f("b", 10, seq=0), completes_request=True)
    s.enqueue(_f("b", 10, seq=1), completes_request=False)
    assert len(s.abort("b")) == 2 and len(s.abort("a")) == 1
    assert s.inflight_bytes == 10 and s.queued_bytes == s.held_bytes == 0
    assert not s.has_pending


def _queue_state(q: WfqQueue) -> tuple[int, int]:
    """(tenant flows, request flows) the queue holds, idle ones included."""
    return len(q._tenants.flows) + len(q._requests), sum(
        len(level.flows) for level in q._requests.values())


def test_wfq_state_stays_bounded_however_many_tenant_names_clients_send():
    q = WfqQueue(lambda t: 1.0)  # keeps at most 256 idle tenants, 32 idle requests each
    peak = (0, 0)
    for burst in range(40):  # bursts of fresh tenant names, each sent in one go
        for i in range(500):
            q.push(_f(f"r{burst}-{i}", 1000, f"tenant-{burst}-{i}"))
            q.push(_f(f"steady{burst}", 1000, "steady", i))
        while len(q):
            q.pop()
            peak = max(peak, _queue_state(q))
    # 20,000 tenant names went through; a bounded few are remembered at any time
    assert peak[0] <= 2 * (256 + 501) and peak[1] <= 256 + 501 + 32
    assert _queue_state(q)[0] <= 2 * 256


@pytest.mark.parametrize("forgotten", [False, True])
def test_wfq_a_new_or_returning_tenant_starts_at_the_virtual_time_floor(forgotten):
    q = WfqQueue(lambda t: 1.0, max_idle_tenants=2) if forgotten else WfqQueue(lambda t: 1.0)
    q.push(_f("c0", 1000, "C"))
    q.pop()  # C is served once, then goes quiet
    for i in range(2000):
        q.push(_f("a", 1000, "A", i))
    for _ in range(1000):
        q.pop()  # A alone: V moves far past C's finish tag
    if forgotten:  # other tenants come and go: C's state is pruned
        for i in range(50):
            q.push(_f(f"x{i}", 1000, f"X{i}"))
            for _ in range(2):
                q.pop()
        assert "C" not in q._tenants.flows
    for name in ("B", "C"):  # a brand-new tenant and one coming back
        for i in range(50):
            q.push(_f(name.lower(), 1000, name, i))
    first = [q.pop().tenant for _ in range(60)]
    # neither is owed anything for the time it was absent: the link is shared equally
    for name in ("A", "B", "C"):
        assert 15 <= first.count(name) <= 25, first
