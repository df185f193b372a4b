"""Pacer: exact rate on a virtual clock, plus one loose real-time smoke check."""

from __future__ import annotations

import random
import time

import pytest
import torch

from kv_transfer import KVChunk, TransferConfig, make_receiver, make_sender
from kv_transfer.link_scheduler import LinkScheduler
from kv_transfer.pacing import ManualClock, TokenBucket
from kv_transfer.send_queue import QueuedFrame

MB = 1_000_000


def _drive(sched: LinkScheduler, clock: ManualClock) -> list[tuple[float, int]]:
    """Run the link as its thread would, acking at once; return (time, bytes) per frame."""
    sent = []
    while sched.has_pending:
        batch, wait = sched.next_batch(clock())
        for f in batch:
            sent.append((clock(), f.nbytes))
            sched.on_ack(f.nbytes)
        if not batch:
            assert wait is not None and wait > 0, "a backlogged paced link waits for tokens"
            clock.advance(wait)
    return sent


@pytest.mark.parametrize("rate", [10 * MB, 250 * MB, 3_000 * MB])
@pytest.mark.parametrize("frame_bytes", [(4 << 10, 64 << 10), (1 << 20, 8 << 20)])
def test_paced_link_rate_is_within_5_percent_of_target(rate, frame_bytes):
    burst = 1 << 20
    cfg = TransferConfig(send_policy="paced", rate_bytes_per_s=rate, burst_bytes=burst,
                         coalesce_bytes=2 << 20)
    sched, clock = LinkScheduler(cfg), ManualClock()
    rng = random.Random(rate)
    for i in range(3000):  # all queued up front: the link stays backlogged to the end
        n = rng.randint(*frame_bytes)
        sched.enqueue(QueuedFrame("r", "default", n, 0.0, key=("r", i, 0)), completes_request=False)
    sent = _drive(sched, clock)
    span = sent[-1][0] - sent[0][0]
    # the last frame left once min(size, burst) tokens were there; the first burst was free
    paid = sum(n for _, n in sent[:-1]) + min(sent[-1][1], burst) - burst
    assert paid > 30 * burst  # long enough that the initial burst cannot skew the rate
    assert paid / span == pytest.approx(rate, rel=0.05)


def test_token_bucket_allows_one_burst_then_waits():
    b = TokenBucket(rate_bytes_per_s=1000, burst_bytes=500)
    assert b.delay(400, 0.0) == 0.0
    b.consume(400, 0.0)
    assert b.delay(400, 0.0) == pytest.approx(0.3)  # 100 left, needs 400
    b.consume(400, 0.3)
    assert b.tokens == pytest.approx(0.0)
    assert b.delay(2000, 0.3) == pytest.approx(0.5)  # bigger than the bucket: waits for a full one
    b.consume(2000, 0.8)  # goes into debt, so the long-run rate still holds
    assert b.delay(1, 0.8) == pytest.approx(1.501)


def test_idle_time_does_not_bank_more_than_one_burst():
    b = TokenBucket(rate_bytes_per_s=1000, burst_bytes=500)
    b.consume(500, 0.0)
    assert b.delay(500, 100.0) == 0.0 and b.tokens == 500


def test_real_time_pacing_smoke():
    """Loose bounds: a loaded CI machine can only make a paced sender slower."""
    rate, burst = 20 * MB, 256 << 10
    cfg = TransferConfig(send_policy="paced", rate_bytes_per_s=rate, burst_bytes=burst,
                         coalesce_bytes=0)
    rx, tx = make_receiver(cfg), make_sender(cfg)
    try:
        payload = torch.zeros(1, 2, 256, 1, 128)  # 256 KiB per chunk
        n = 80  # ~21 MB: about one second at 20 MB/s
        t0 = time.monotonic()
        for i in range(n):
            tx.send(KVChunk("r", i, i * 256, (i + 1) * 256, payload, is_final=i == n - 1,
                            first_token=1 if i == n - 1 else None), dest=rx.endpoint)
        finished = []
        while not finished and time.monotonic() - t0 < 30:
            for c in rx.poll().chunks:
                rx.release(c)
            finished = tx.poll().finished
            time.sleep(0.005)
        elapsed = time.monotonic() - t0
        assert finished == ["r"]
        achieved = (n * payload.nbytes - burst) / elapsed
        assert 0.3 * rate < achieved < 1.05 * rate
    finally:
        tx.close()
        rx.close()
