"""Per-rank KV links of tensor-parallel workers (runtime/tp_links.py): a rank's sender cuts
its heads for every decode rank, and a cache imports a KV-head sub-range in place."""

from __future__ import annotations

import pytest
import torch

from engine.config import ModelConfig
from engine.kv_cache import KVCache
from kv_transfer.base import KVChunk
from runtime.tp_links import HeadSender, join_endpoints, split_endpoints


class RecordingSender:
    """Records what a HeadSender hands the real sender (a unit test of HeadSender alone)."""

    def __init__(self):
        self.sent, self.shares = [], {}

    def send(self, chunk, *, dest):
        self.sent.append((chunk, dest))

    def send_many(self, items):
        self.sent += items

    def set_link_share(self, dest, share):
        self.shares[dest] = share


def _chunk(heads: int) -> KVChunk:
    payload = torch.arange(2 * 2 * 3 * heads * 4, dtype=torch.float32).view(2, 2, 3, heads, 4)
    return KVChunk("leg", 0, 5, 8, payload, is_final=True, first_token=7)


def test_one_rank_to_one_rank_is_the_plain_send():
    rec = RecordingSender()
    chunk = _chunk(4)
    HeadSender(rec, 4).send(chunk, dest="tcp://a:1")
    assert rec.sent == [(chunk, "tcp://a:1")] and rec.shares == {}


def test_one_rank_to_two_decode_ranks_sends_each_its_heads_with_half_the_budget():
    rec = RecordingSender()
    dest = join_endpoints(["tcp://a:1", "tcp://b:2"])
    assert split_endpoints(dest) == ["tcp://a:1", "tcp://b:2"]
    chunk = _chunk(4)
    HeadSender(rec, 4).send(chunk, dest=dest)
    (c0, d0), (c1, d1) = rec.sent
    assert (d0, c0.heads) == ("tcp://a:1", (0, 2, 4)) and (d1, c1.heads) == ("tcp://b:2", (2, 4, 4))
    assert torch.equal(c1.payload, chunk.payload[:, :, :, 2:4])
    assert c0.first_token == c1.first_token == 7
    assert rec.shares == {"tcp://a:1": 0.5, "tcp://b:2": 0.5}


def test_rank_one_of_two_to_one_decode_rank_labels_its_heads():
    rec = RecordingSender()
    local = _chunk(2)  # rank 1 of 2 holds heads [2, 4) of 4
    HeadSender(rec, 4, tp=2, rank=1).send(local, dest="tcp://a:1")
    ((c, d),) = rec.sent
    assert d == "tcp://a:1" and c.heads == (2, 4, 4) and c.payload is local.payload


def test_a_cache_imports_a_head_range_in_place_and_refuses_foreign_heads():
    m = ModelConfig("LlamaForCausalLM", 32, 16, 32, 2, 4, 4, 4, 1e-6, 64, False, False,
                    False, False, False)
    kv = KVCache(m, num_blocks=2, block_size=4, dtype=torch.float32, kv_head_start=0)
    data = torch.ones(2, 2, 3, 2, 4)
    kv.import_tokens([1], 1, data, head_start=2)
    slots = kv.data.view(2, 2, 8, 4, 4)
    assert slots[:, :, 5:8, 2:4].eq(1).all() and slots[:, :, :, :2].eq(0).all()
    assert slots.sum() == data.sum()
    rank = KVCache(m, num_blocks=2, block_size=4, dtype=torch.float32, kv_head_start=2)
    with pytest.raises(ValueError, match=r"KV heads \[0, 2\) are not among this cache's"):
        rank.import_tokens([1], 1, data, head_start=0)


def test_a_rank_pairs_each_send_with_its_own_export_when_a_step_exports_several():
    """Rank 0 exports a step's chunks in the step and sends them at the next step's start
    (prefill_worker/engine.py), so a rank sees export A, export B, send A, send B: each
    send must carry its own export's payload, in order."""
    from types import SimpleNamespace

    from runtime.tp_links import _FIELDS, RankLinks

    exports = {(0, 16): torch.zeros(1, 2, 16, 1, 4), (16, 20): torch.ones(1, 2, 4, 1, 4)}
    kv = SimpleNamespace(export_tokens=lambda blocks, start, end: exports[(start, end)])
    rec = RecordingSender()
    links = RankLinks(sender=rec)
    h = links.handlers(SimpleNamespace(kv=kv), SimpleNamespace(rank=1))
    chunks = [KVChunk("leg", 0, 0, 16, exports[(0, 16)]),
              KVChunk("leg", 1, 16, 20, exports[(16, 20)], is_final=True, first_token=3)]
    for c in chunks:
        h["tx_export"](("tx_export", (0, 1), c.token_start, c.token_end))
    for c in chunks:
        h["tx_send"](("tx_send", {f: getattr(c, f) for f in _FIELDS}, "tcp://d:1"))
    assert [(c.token_start, c.payload.sum().item()) for c, _ in rec.sent] == [(0, 0.0), (16, 32.0)]
    assert not links.exported
