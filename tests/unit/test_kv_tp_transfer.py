"""KV across different TP on the two pools, through real connectors: every decode rank's
cache ends up byte-equal to its heads of the single-rank reference (issue 17)."""

from __future__ import annotations

import time

import pytest
import torch

from kv_transfer import TransferConfig, make_receiver, make_sender
from kv_transfer.heads import rank_heads, sends_of, transfer_plan
from kv_transfer.registry import CONNECTORS
from kv_transfer.testing import PagedKV, make_chunks
from kv_transfer.wire import chunks_for_heads

SECRET = b"tp-transfer-tests-secret-0123456789"
LAYERS, DIM = 3, 8
LENS = {"a": 37, "b": 5, "c": 64}
BOUNDS = {"a": [0, 16, 32, 37], "b": [0, 5, 5], "c": [0, 64]}


def _cfg(connector: str) -> TransferConfig:
    kw = {"secret": SECRET} if CONNECTORS.get(connector).requires_secret else {}
    return TransferConfig(connector=connector, failure_timeout_s=5.0, **kw)


def _rank_cache(heads, block: int) -> PagedKV:
    return PagedKV(num_layers=LAYERS, num_kv_heads=heads.count, head_dim=DIM, block_size=block,
                   num_blocks=256 // block, heads=heads)


def run_tp_transfer(connector: str, num_kv_heads: int, p_tp: int, d_tp: int,
                    timeout_s: float = 60.0) -> None:
    """Prefill ranks (block 16) send to decode ranks (block 8) by the plan; check bytes,
    completions and that nothing is left in flight."""
    cfg, plan = _cfg(connector), transfer_plan(num_kv_heads, p_tp, d_tp)
    ref = PagedKV(num_layers=LAYERS, num_kv_heads=num_kv_heads, head_dim=DIM, block_size=16,
                  num_blocks=16)
    pre = [_rank_cache(rank_heads(num_kv_heads, p_tp, r), 16) for r in range(p_tp)]
    dec = [_rank_cache(rank_heads(num_kv_heads, d_tp, r), 8) for r in range(d_tp)]
    rxs = [make_receiver(cfg) for _ in range(d_tp)]
    txs = [make_sender(cfg) for _ in range(p_tp)]
    try:
        for d, rx in enumerate(rxs):
            rx.set_head_range(rank_heads(num_kv_heads, d_tp, d))
        for t in plan:
            txs[t.prefill_rank].set_link_share(rxs[t.decode_rank].endpoint, t.share)
        dests = [rx.endpoint for rx in rxs]
        for i, (rid, n) in enumerate(LENS.items()):
            ref.allocate(rid, n)
            ref.fill_random(rid, n, seed=i)
            for c in pre + dec:
                c.allocate(rid, n)
        for c in pre:  # each prefill rank computed only its heads
            c.blocks.copy_(ref.blocks[..., c.heads.start : c.heads.end, :])
        for rid in LENS:
            per_rank = [make_chunks(c, rid, BOUNDS[rid]) for c in pre]
            for seq in range(len(BOUNDS[rid]) - 1):
                for r, tx in enumerate(txs):
                    tx.send_many(chunks_for_heads(per_rank[r][seq], sends_of(plan, r), dests))
        pending = {(r, rid) for r in range(p_tp) if sends_of(plan, r) for rid in LENS}
        completed = {d: [] for d in range(d_tp)}
        deadline = time.monotonic() + timeout_s
        while pending or any(len(v) < len(LENS) for v in completed.values()):
            assert time.monotonic() < deadline, (pending, completed)
            for d, rx in enumerate(rxs):
                ev = rx.poll()
                assert ev.failed == []
                for chunk in ev.chunks:
                    dec[d].import_chunk(chunk)
                    rx.release(chunk)
                completed[d] += ev.completed
            for r, tx in enumerate(txs):
                ev = tx.poll()
                assert ev.failed == []
                pending -= {(r, rid) for rid in ev.finished}
            time.sleep(0.002)
        for d, cache in enumerate(dec):
            assert sorted(completed[d]) == sorted(LENS)
            h = cache.heads
            for rid, n in LENS.items():
                want = ref.export(rid, 0, n)[..., h.start : h.end, :]
                assert torch.equal(cache.export(rid, 0, n), want), (d, rid)
        for tx in txs:
            s = tx.stats()
            assert s["inflight_bytes"] == 0 and s["active_requests"] == 0
        for rx in rxs:
            s = rx.stats()
            assert s["inflight_bytes"] == 0 and s["active_requests"] == 0
            assert s["inbox_chunks"] == 0
    finally:
        for tx in txs:
            tx.close()
        for rx in rxs:
            rx.close()


@pytest.mark.parametrize(("h", "p_tp", "d_tp"), [
    (2, 2, 1), (2, 1, 2), (2, 2, 2), (4, 2, 4), (2, 4, 1), (2, 1, 4), (6, 2, 3)])
def test_inproc_kv_across_tp_degrees_is_byte_exact(h, p_tp, d_tp):
    run_tp_transfer("inproc", h, p_tp, d_tp)


@pytest.mark.parametrize(("h", "p_tp", "d_tp"), [(2, 2, 1), (2, 1, 2), (2, 2, 2)])
def test_tcp_kv_across_tp_degrees_is_byte_exact(h, p_tp, d_tp):
    run_tp_transfer("tcp", h, p_tp, d_tp)


@pytest.mark.parametrize(("h", "p_tp", "d_tp"), [(2, 2, 1), (2, 1, 2), (2, 2, 2)])
def test_torchdist_kv_across_tp_degrees_is_byte_exact(h, p_tp, d_tp):
    run_tp_transfer("torchdist", h, p_tp, d_tp)
