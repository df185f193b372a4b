"""The layer-wise producer (issue 40): a prefill engine hands a prompt's final chunk to the
connector as its step launches, exported by groups of layers (engine.kv_cache.
LayerwiseExport; on the emulated device each group at its share of the step), and its
first token, sampled at the step's end, travels on the chunk's last piece. What arrives
equals the whole-chunk send's bytes, and the disaggregated streams stay the same."""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import replace

import pytest
import torch

from engine.config import EmulateConfig
from engine.emulate.device import EmulatedDevice
from engine.kv_cache import LayerwiseExport, layer_bounds
from kv_transfer import KVChunk, TransferConfig, make_receiver, make_sender
from prefill_worker.engine import PrefillEngine
from prefill_worker.scheduler import PrefillSchedulerConfig
from runtime.messages import EventKind, PrefillTask
from tests.pd_harness import STREAM_PROMPTS, PDPair, engine_cfg, greedy, streams

_ids = itertools.count()
PROMPT = list(range(3, 40))  # 37 tokens: chunks of 16, 16 and a final 5


def _received(model_dir, layerwise: int, emulate: EmulateConfig | None = None,
              prompt: list[int] = PROMPT, max_tokens: int = 4):
    """Prefill one prompt, chunk 16; returns (chunks received, in arrival order; the
    first token's event; the engine)."""
    n = next(_ids)
    cfg = TransferConfig(connector="inproc")
    rx, tx = make_receiver(cfg, name=f"lwd{n}"), make_sender(cfg, name=f"lwp{n}")
    eng = PrefillEngine("p", engine_cfg(model_dir, 8, emulate=emulate),
                        PrefillSchedulerConfig(max_num_batched_tokens=16, max_prefill_chunk=16),
                        tx, 128, layerwise_groups=layerwise)
    got: list[KVChunk] = []
    events, completed = [], []
    try:
        eng.add(PrefillTask("r", tuple(prompt), greedy(max_tokens), rx.endpoint, ()))
        deadline = time.monotonic() + 20
        while eng.has_work or not completed:
            assert time.monotonic() < deadline, "the prefill did not finish"
            events += eng.step()
            ev = rx.poll()
            for c in ev.chunks:  # the owner copies, then releases
                got.append(dataclasses.replace(c, payload=c.payload.clone()))
                rx.release(c)
            completed += ev.completed
            if not eng.last_step_ran:
                rx.wait(0.005)
        assert eng.kv_in_flight == 0 and eng.bm.num_used_blocks == 0
        return got, next(e for e in events if e.kind == EventKind.FIRST_TOKEN), eng
    finally:
        tx.close()
        rx.close()


def _by_seq(chunks: list[KVChunk]) -> dict[int, torch.Tensor]:
    """seq -> its payload reassembled from its pieces (split by layer or token)."""
    out = {}
    for seq in sorted({c.seq_no for c in chunks}):
        parts = sorted((c for c in chunks if c.seq_no == seq),
                       key=lambda c: (c.layer_start, c.token_start))
        layers = [torch.cat([c.payload for c in parts if c.layer_start == lo], dim=2)
                  for lo in sorted({c.layer_start for c in parts})]
        out[seq] = torch.cat(layers)
    return out


@pytest.mark.parametrize("emulated", [False, True], ids=["cpu-forward", "emulated-h200"])
def test_the_final_chunk_goes_in_layer_groups_and_its_bytes_equal_the_whole_send(
        tiny_model, emulated):
    from engine.emulate.model_dir import emulated_model_dir

    em = EmulateConfig("h200", "tiny") if emulated else None
    model_dir = emulated_model_dir("tiny") if emulated else tiny_model
    whole, first_w, _ = _received(model_dir, 0, em)
    lw, first_l, _ = _received(model_dir, 2, em)
    final = max(c.seq_no for c in whole)
    assert final == 2  # chunks [0, 16), [16, 32), [32, 37)
    # off: the final chunk arrives whole; on: one piece per layer group, the last final
    assert [(c.layer_start, c.layer_end) for c in whole if c.seq_no == final] == [(0, 2)]
    pieces = [c for c in lw if c.seq_no == final]
    assert sorted((c.layer_start, c.layer_end) for c in pieces) == [(0, 1), (1, 2)]
    last = max(pieces, key=lambda c: c.layer_start)
    assert [c.is_final for c in sorted(pieces, key=lambda c: c.layer_start)] == [False, True]
    # the token sampled at the step's end rides on the last piece, as on the whole send
    assert last.first_token == first_w.token_ids[0] == first_l.token_ids[0]
    assert next(c for c in whole if c.is_final).first_token == first_w.token_ids[0]
    # earlier chunks are sent whole either way, and every byte is the same
    assert all(c.layer_start == 0 for c in lw if c.seq_no < final)
    a, b = _by_seq(whole), _by_seq(lw)
    assert a.keys() == b.keys() and all(torch.equal(a[s], b[s]) for s in a)


def test_a_request_that_ends_at_its_first_token_drops_its_layer_wise_chunk(tiny_model):
    """max_tokens 1: the prefill ends the request at its first token; the chunk it sent by
    layers is dropped (its link thread unblocked), and nothing leaks."""
    n = next(_ids)
    cfg = TransferConfig(connector="inproc")
    rx, tx = make_receiver(cfg, name=f"lwd{n}"), make_sender(cfg, name=f"lwp{n}")
    eng = PrefillEngine("p", engine_cfg(tiny_model, 8),
                        PrefillSchedulerConfig(max_num_batched_tokens=16, max_prefill_chunk=16),
                        tx, 64, layerwise_groups=2)
    try:
        eng.add(PrefillTask("r", tuple(PROMPT[:10]), greedy(1), rx.endpoint, ()))
        events = eng.step()
        assert [(e.kind, e.finish_reason) for e in events] == [(EventKind.FIRST_TOKEN, "length")]
        assert eng.kv_in_flight == 0 and eng.bm.num_used_blocks == 0 and not eng.jobs
        deadline = time.monotonic() + 10
        while tx.stats()["active_requests"] or tx.stats()["export_wait_bytes"]:
            assert time.monotonic() < deadline, "the dropped chunk's link never went on"
            time.sleep(0.005)
        assert not any(c.is_final for c in rx.poll().chunks)
    finally:
        tx.close()
        rx.close()


def test_a_layer_wise_export_times_its_groups_by_the_step_and_copies_beside_it():
    """On the emulated device: group ``b`` of ``L`` is computed ``b / L`` into the step,
    then copied on the copy engine (not the step queue), in group order."""
    clock = [100.0]
    dev = EmulatedDevice(clock=lambda: clock[0], sleep=lambda s: None)
    step_end = dev.submit(0.010)
    assert layer_bounds(32, 8) == (4, 8, 12, 16, 20, 24, 28, 32)
    assert layer_bounds(2, 8) == (1, 2) and layer_bounds(5, 2) == (2, 5)
    ends = [dev.copy(0.0001, after=100.0 + 0.010 * b / 32) for b in layer_bounds(32, 8)]
    assert ends[0] == pytest.approx(100.00135) and ends[-1] == pytest.approx(step_end + 0.0001)
    assert ends == sorted(ends) and dev.free_at == step_end  # the step queue is untouched
    lw = LayerwiseExport(torch.zeros(2, 2, 1, 1, 1), (1, 2), [lambda: None] * 2)
    lw.fail(RuntimeError("boom"))
    with pytest.raises(RuntimeError, match="boom"):
        lw.wait_layers(1)
    ok = LayerwiseExport(torch.zeros(2, 2, 1, 1, 1), (1, 2), [lambda: None] * 2)
    ok.bind_first_token(7)
    ok.fail(RuntimeError("after the bind: no effect"))
    assert ok.wait_layers(2).shape[0] == 2 and ok.first_token == 7


PROMPTS = STREAM_PROMPTS


@pytest.mark.parametrize("emulated", [False, True], ids=["tiny", "emulated-h200"])
def test_layer_wise_sends_give_the_same_streams(tiny_model, emulated):
    from engine.emulate.model_dir import emulated_model_dir

    em = EmulateConfig("h200", "tiny") if emulated else None
    d = emulated_model_dir("tiny") if emulated else tiny_model
    sp = replace(greedy(12), logprobs=2)
    off = streams(PDPair(d, d_block=8, chunk=7, budget=32, emulate=em, layerwise=0),
                   PROMPTS, sp)
    pair = PDPair(d, d_block=8, chunk=7, budget=32, emulate=em, layerwise=2)
    on = streams(pair, PROMPTS, sp)
    assert on == off and all(len(o) == 12 for o in on[0])
    if emulated:  # every range the decode side took in was checked against the pattern
        assert pair.decode.runner.kv.checked_ranges >= len(PROMPTS)
