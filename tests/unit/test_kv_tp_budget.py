"""Credit, pacing and the fair send queue count every TP rank's bytes: the rank links
between two workers split one budget by the plan's shares (issue 17)."""

from __future__ import annotations

import random
import time

import pytest
import torch

from kv_transfer import KVChunk, TransferConfig, make_receiver, make_sender
from kv_transfer.heads import sends_of, transfer_plan
from kv_transfer.link_scheduler import LinkScheduler
from kv_transfer.pacing import ManualClock
from kv_transfer.send_queue import QueuedFrame
from kv_transfer.wire import chunks_for_heads, split_chunk

MB, KiB = 1_000_000, 1 << 10


def test_share_of_scales_the_per_link_budget_and_validates():
    cfg = TransferConfig(send_policy="paced", rate_bytes_per_s=100 * MB, burst_bytes=1 << 20,
                         link_rate_bytes_per_s=300 * MB, credit_window_bytes=8 << 20,
                         max_frame_bytes=4 << 20)
    half = cfg.share_of(0.25)
    assert (half.rate_bytes_per_s, half.link_rate_bytes_per_s) == (25 * MB, 75 * MB)
    assert (half.burst_bytes, half.credit_window_bytes, half.max_frame_bytes) == (
        256 * KiB, 2 << 20, 2 << 20)  # frames shrink to fit the window
    assert cfg.share_of(1) is cfg
    for bad in (0, 1.5, -0.1, "half"):
        with pytest.raises(ValueError, match="share of the transfer budget"):
            cfg.share_of(bad)
    # a plan's links together get exactly the worker pair's budget
    for h, p, d in [(2, 1, 2), (2, 2, 1), (6, 2, 3), (2, 1, 4)]:
        plan = transfer_plan(h, p, d)
        assert sum(cfg.share_of(t.share).rate_bytes_per_s for t in plan) == pytest.approx(
            cfg.rate_bytes_per_s)
        assert sum(cfg.share_of(t.share).credit_window_bytes for t in plan) == pytest.approx(
            cfg.credit_window_bytes, abs=len(plan))


def _rank_frames(plan, tenant_of, n_chunks: int, max_payload: int):
    """Frames per link (decode rank) of one prefill rank: each request's 1-layer chunks
    of 2 heads, cut per decode rank by the plan."""
    links: dict[int, list[QueuedFrame]] = {t.decode_rank: [] for t in sends_of(plan, 0)}
    rng = random.Random(1)
    for i in range(n_chunks):
        rid = f"r{i % 4}"
        tokens = rng.randint(8, 64)
        c = KVChunk(rid, i // 4, 0, tokens, torch.zeros(1, 2, tokens, 2, 256), head_start=0,
                    num_kv_heads=2, tenant=tenant_of(rid))
        for j, (sub, dest) in enumerate(chunks_for_heads(c, sends_of(plan, 0), ["0", "1"])):
            for p in split_chunk(sub, max_payload):
                links[int(dest)].append(QueuedFrame(rid, sub.tenant, p.nbytes, 0.0,
                                                    key=(rid, i, j, p.part)))
    return links


def test_rank_links_of_one_worker_pair_pace_and_share_fairly_as_one_link():
    """P TP1 -> D TP2: the prefill rank's two links carry half the heads each; paced with
    their shares they move the configured rate together, and tenants A:B get 3:1 of it."""
    rate = 5 * MB
    cfg = TransferConfig(send_policy="paced", rate_bytes_per_s=rate, burst_bytes=256 * KiB,
                         coalesce_bytes=0, send_queue="wfq", tenant_weights={"A": 3.0, "B": 1.0})
    plan = transfer_plan(2, 1, 2)
    frames = _rank_frames(plan, lambda rid: "A" if rid in ("r0", "r1") else "B", 600,
                          cfg.max_payload_bytes)
    clock = ManualClock()
    scheds = {t.decode_rank: LinkScheduler(cfg.share_of(t.share)) for t in plan}
    for d, fs in frames.items():
        for f in fs:
            scheds[d].enqueue(f, completes_request=False)
    sent = {"A": 0, "B": 0}
    t_end = 4.0  # virtual seconds, well before either tenant's backlog runs dry
    while clock() < t_end:
        waits = []
        for s in scheds.values():
            batch, wait = s.next_batch(clock())
            for f in batch:
                sent[f.tenant] += f.nbytes
                s.on_ack(f.nbytes)
            if not batch:
                waits.append(wait)
        if len(waits) == len(scheds):
            clock.advance(min(w for w in waits if w is not None))
    assert all(s.has_pending for s in scheds.values())
    total = sum(sent.values())
    burst = cfg.burst_bytes  # each link's first half-burst came free
    assert (total - burst) / t_end == pytest.approx(rate, rel=0.05)
    assert sent["A"] / total == pytest.approx(0.75, rel=0.05)


def _wait(cond, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"not reached: {what}"
        time.sleep(0.005)


def test_credit_window_caps_the_sum_of_every_rank_links_bytes_in_flight():
    """P TP1 -> D TP2 with owners that do not release: each link stops at its share of the
    window, so the decode group never holds more than one worker-pair window."""
    window = 1 << 20
    cfg = TransferConfig(credit_window_bytes=window, max_frame_bytes=64 * KiB, coalesce_bytes=0)
    plan = transfer_plan(2, 1, 2)
    rxs = [make_receiver(cfg), make_receiver(cfg)]
    tx = make_sender(cfg)
    try:
        dests = [rx.endpoint for rx in rxs]
        for t in plan:
            tx.set_link_share(dests[t.decode_rank], t.share)
        n = 40  # 40 chunks x 2 links x 32 KiB = 2.5 MiB: more than the window
        for i in range(n):
            c = KVChunk("r", i, 16 * i, 16 * (i + 1), torch.zeros(1, 2, 16, 2, 256),
                        num_kv_heads=2, is_final=i == n - 1, first_token=1 if i == n - 1 else None)
            tx.send_many(chunks_for_heads(c, sends_of(plan, 0), dests))
        held = [[], []]
        _wait(lambda: [held[d].extend(rx.poll().chunks) for d, rx in enumerate(rxs)]
              and all(len(h) == 16 for h in held), "each link's window full")
        s = tx.stats()
        per_link = [s["links"][d]["inflight_bytes"] for d in dests]
        assert per_link == [window // 2, window // 2] and s["inflight_bytes"] == window
        assert s["queued_bytes"] == 2 * n * 32 * KiB - window  # the rest waits for credit
        finished: list[str] = []

        def drain() -> bool:
            for d, rx in enumerate(rxs):
                for c in held[d] + rx.poll().chunks:
                    rx.release(c)
                held[d] = []
            finished.extend(tx.poll().finished)
            return finished == ["r"]

        _wait(drain, "request finished once the owners release")
        assert max(s2["peak_inflight_bytes"] for s2 in tx.stats()["links"].values()) == window // 2
        assert tx.stats()["inflight_bytes"] == 0 and tx.stats()["active_requests"] == 0
    finally:
        tx.close()
        for rx in rxs:
            rx.close()
