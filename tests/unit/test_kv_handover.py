"""The caller's share of sending: ``send`` hands a chunk to its link's thread, which
completes the chunk's export (``KVChunk.ready``), frames and schedules it. Covered here:
the caller runs only sender.py, the export is waited for on the link thread in send
order, a chunk dropped before its export completed is never read nor kept, a failed
export fails its request alone, and what travels is the KV at submit time even when the
engine writes or reuses the blocks right after."""

from __future__ import annotations

import gc
import sys
import threading
import weakref
from pathlib import Path

import pytest
import torch

from engine.block_manager import BlockManager
from engine.config import ModelConfig
from engine.kv_cache import KVCache
from engine.request import Request, SamplingParams
from kv_transfer import KVChunk, TransferConfig, make_receiver, make_sender
from kv_transfer.heads import HeadRange, HeadTransfer
from kv_transfer.testing import PagedKV, pump
from kv_transfer.wire import chunks_for_heads

SHAPE = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8}
MODEL = ModelConfig("LlamaForCausalLM", 100, 32, 64, 2, 4, 2, 8, 1e-6, 512, False, False,
                    False, False, False)


class Gate:
    """A device copy still in flight: ``wait`` blocks until the test opens the gate."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.open_ = threading.Event()
        self.entered = threading.Event()
        self.threads: list[str] = []
        self.fail = fail

    def wait(self) -> None:
        self.threads.append(threading.current_thread().name)
        self.entered.set()
        if not self.open_.wait(20):
            raise TimeoutError("the test never opened the gate")
        if self.fail is not None:
            raise self.fail

    def open(self) -> None:
        self.open_.set()


def _chunk(rid: str, seq: int, final: bool, ready=None, fill: float = 1.0) -> KVChunk:
    payload = torch.full((2, 2, 4, 2, 8), fill)  # [L, 2, T, H, D]
    return KVChunk(rid, seq, 4 * seq, 4 * seq + 4, payload, is_final=final,
                   first_token=7 if final else None, ready=ready)


@pytest.fixture
def pair():
    cfg = TransferConfig(connector="inproc")
    rx, tx = make_receiver(cfg), make_sender(cfg)
    dst = PagedKV(**SHAPE, block_size=4, num_blocks=64)
    yield rx, tx, dst
    tx.close()
    rx.close()


def _settled(tx, rx) -> None:
    s = tx.stats()
    assert s["active_requests"] == s["queued_bytes"] == s["held_bytes"] == 0
    assert s["export_wait_bytes"] == 0
    assert s["inflight_bytes"] == 0 and rx.stats()["inflight_bytes"] == 0


def test_send_runs_only_the_senders_own_code_on_the_callers_thread(pair):
    rx, tx, dst = pair
    dst.allocate("warm", 4)
    tx.send(_chunk("warm", 0, True), dest=rx.endpoint)  # opens the link (once per dest)
    assert pump(tx, rx, dst, ["warm"]) == ({}, {})
    chunks, dest = [_chunk("r", i, i == 2) for i in range(3)], rx.endpoint
    files: set[str] = set()
    caller = threading.current_thread()

    def profile(frame, event, arg):
        if event == "call" and threading.current_thread() is caller:
            files.add(frame.f_code.co_filename)

    sys.setprofile(profile)
    try:
        for c in chunks:
            tx.send(c, dest=dest)
    finally:
        sys.setprofile(None)
    ours = {Path(f).name for f in files if Path(f).parent.name == "kv_transfer"}
    # the chunk's own properties and the sender's bookkeeping; no framing, scheduling,
    # pacing or export on the caller's thread
    assert ours == {"base.py", "sender.py"}, ours
    dst.allocate("r", 12)
    assert pump(tx, rx, dst, ["r"]) == ({}, {})
    _settled(tx, rx)


def test_export_completes_on_the_link_thread_in_send_order(pair):
    rx, tx, dst = pair
    gate = Gate()
    tx.send(_chunk("r", 0, False, ready=gate, fill=3.0), dest=rx.endpoint)
    tx.send(_chunk("r", 1, True, fill=4.0), dest=rx.endpoint)  # queued behind the export
    assert gate.entered.wait(20)  # the caller has not waited: the link thread does
    assert gate.threads == [f"kv-sender->{rx.endpoint}"]
    s = tx.stats()  # both still wait for seq 0's export, neither is queued yet
    assert s["export_wait_bytes"] == 2 * _chunk("r", 0, False).nbytes
    assert s["queued_bytes"] == s["inflight_bytes"] == 0
    assert rx.poll().chunks == []  # seq 1 did not overtake the export of seq 0
    gate.open()
    dst.allocate("r", 8)
    assert pump(tx, rx, dst, ["r"]) == ({}, {})
    assert torch.equal(dst.export("r", 0, 4), torch.full((2, 2, 4, 2, 8), 3.0))
    assert torch.equal(dst.export("r", 4, 8), torch.full((2, 2, 4, 2, 8), 4.0))
    assert gate.threads == [f"kv-sender->{rx.endpoint}"]  # waited exactly once
    _settled(tx, rx)


def test_chunks_aborted_before_their_export_completed_are_dropped_unread(pair):
    rx, tx, dst = pair
    head, behind = Gate(), Gate()
    tx.send(_chunk("gone", 0, False, ready=head), dest=rx.endpoint)
    late = _chunk("late", 0, True, ready=behind)
    tx.send(late, dest=rx.endpoint)
    tx.send(_chunk("kept", 0, True, fill=5.0), dest=rx.endpoint)
    assert head.entered.wait(20)  # the link thread waits for "gone"'s export
    assert tx.stats()["active_requests"] == 3
    tx.abort("gone")  # while its export is in flight
    tx.abort("late")  # before the link thread even reached its export
    ref = weakref.ref(late)
    del late
    head.open()
    behind.open()
    dst.allocate("kept", 4)
    assert pump(tx, rx, dst, ["kept"]) == ({}, {})
    assert behind.threads == [] and len(head.threads) == 1
    assert rx.stats()["frames_received"] == 1  # only "kept" travelled
    ev = tx.poll()
    assert ev.failed == [] and ev.finished == []
    gc.collect()
    assert ref() is None  # the sender keeps nothing of a dropped chunk
    _settled(tx, rx)


def test_a_failed_export_fails_its_request_alone(pair):
    rx, tx, dst = pair
    bad = Gate(fail=RuntimeError("device copy failed"))
    bad.open()
    tx.send(_chunk("bad", 0, False, ready=bad), dest=rx.endpoint)
    tx.send(_chunk("bad", 1, True), dest=rx.endpoint)
    tx.send(_chunk("good", 0, True), dest=rx.endpoint)
    dst.allocate("good", 4)
    failed, _ = pump(tx, rx, dst, ["bad", "good"])
    assert failed == {"bad": "KV export failed: RuntimeError: device copy failed"}
    assert rx.stats()["frames_received"] == 1
    _settled(tx, rx)


def _prefill_state() -> tuple[KVCache, BlockManager, Request]:
    """A prefill worker's cache of 4 blocks of 4 tokens; request "a" holds 2 of them."""
    kv = KVCache(MODEL, num_blocks=4, block_size=4, dtype=torch.float32)
    kv.data.copy_(torch.randn(kv.data.shape, generator=torch.Generator().manual_seed(1)))
    bm = BlockManager(4, 4, enable_prefix_caching=False)
    a = Request("a", list(range(8)), SamplingParams())
    assert bm.allocate(a, 8)
    return kv, bm, a


def _reuse_all_blocks(kv: KVCache, bm: BlockManager, freed: list[int]) -> None:
    """Another request takes every block (so the freed ones too) and writes them."""
    b = Request("b", list(range(16)), SamplingParams())
    assert bm.allocate(b, 16) and set(freed) <= set(b.block_ids)
    kv.data[:, :, b.block_ids] = -1.0
    bm.free(b)
    bm.check_integrity()
    assert bm.num_used_blocks == 0


def test_what_travels_is_the_kv_at_submit_time_though_its_blocks_are_reused(pair):
    """The prefill engine's path: export_async of a chunk and send with its readiness;
    then, before the link thread runs, the next chunk's KV in the same block, the
    request's end (its blocks freed at once) and another request reusing them."""
    rx, tx, dst = pair
    kv, bm, a = _prefill_state()
    blocks = list(a.block_ids)
    want = kv.export_tokens(blocks, 0, 6).clone()  # tokens 0..5: the 2nd block half written
    gate = Gate()
    pending = kv.export_async(blocks, 0, 6)
    tx.send(KVChunk("a", 0, 0, 6, pending.payload, ready=_Both(pending, gate)), dest=rx.endpoint)
    kv.data[:, :, blocks[1], 2:] = 0.0  # the next chunk's tokens 6..7, same block
    tx.send(KVChunk("a", 1, 6, 6, torch.empty(2, 2, 0, 2, 8), is_final=True, first_token=1),
            dest=rx.endpoint)
    bm.free(a)  # what the prefill scheduler's finish does right after the last send
    _reuse_all_blocks(kv, bm, blocks)
    gate.open()
    dst.allocate("a", 6)
    assert pump(tx, rx, dst, ["a"]) == ({}, {})
    assert torch.equal(dst.export("a", 0, 6), want)
    _settled(tx, rx)


def test_a_request_aborted_and_freed_before_its_export_completed_sends_nothing(pair):
    rx, tx, dst = pair
    kv, bm, a = _prefill_state()
    blocks = list(a.block_ids)
    gate = Gate()
    pending = kv.export_async(blocks, 0, 8)
    tx.send(KVChunk("a", 0, 0, 8, pending.payload, ready=_Both(pending, gate)), dest=rx.endpoint)
    tx.abort("a")  # the prefill engine's abort: the sender drops it ...
    bm.free(a)  # ... and the scheduler frees its blocks, once, at once
    _reuse_all_blocks(kv, bm, blocks)
    gate.open()
    tx.send(_chunk("kept", 0, True), dest=rx.endpoint)
    dst.allocate("kept", 4)
    assert pump(tx, rx, dst, ["kept"]) == ({}, {})
    assert rx.stats()["frames_received"] == 1
    assert tx.poll().failed == []
    _settled(tx, rx)


class _Both:
    def __init__(self, pending, gate: Gate) -> None:
        self.pending, self.gate = pending, gate

    def wait(self) -> None:
        self.gate.wait()
        self.pending.wait()


def test_a_head_cut_waits_for_the_export_before_it_copies():
    gate = Gate()
    gate.open()
    chunk = KVChunk("r", 0, 0, 4, torch.arange(2 * 2 * 4 * 2 * 8.0).view(2, 2, 4, 2, 8),
                    head_start=0, num_kv_heads=2, ready=gate)
    out = chunks_for_heads(chunk, [HeadTransfer(0, 0, HeadRange(0, 1, 2), 1.0),
                                   HeadTransfer(0, 1, HeadRange(1, 2, 2), 1.0)], ["a", "b"])
    assert gate.threads == [threading.current_thread().name]
    assert [c.ready for c, _ in out] == [None, None]
    assert torch.equal(out[1][0].payload, chunk.payload[:, :, :, 1:2])
