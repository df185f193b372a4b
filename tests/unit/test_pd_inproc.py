"""Prefill + decode engines chained through the inproc connector, no Ray: greedy tokens
equal engine.LLM's for every chunk size / block size pairing, and nothing leaks."""

from __future__ import annotations

import time

import pytest
import torch

from engine import LLM
from tests.pd_harness import PDPair, greedy


def prompts(lengths):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(1, 2000, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def reference(tiny_model):
    llm = LLM(str(tiny_model), block_size=16)
    cache = {}

    def ref(p, n=10):
        key = (tuple(p), n)
        if key not in cache:
            cache[key] = llm.generate([p], greedy(n))[0].token_ids
        return cache[key]

    return ref


@pytest.mark.parametrize(
    "p_block,d_block,chunk,overlap",  # overlap: the decode host one step ahead
    [(16, 16, 16, False), (16, 32, 7, False), (8, 16, 33, False), (32, 4, 5, False),
     (16, 32, 7, True), (32, 4, 5, True)],
)
def test_disaggregated_greedy_equals_colocated(tiny_model, reference, p_block, d_block, chunk,
                                               overlap):
    pair = PDPair(tiny_model, p_block=p_block, d_block=d_block, chunk=chunk, overlap=overlap)
    ps = prompts([1, 5, 16, 17, 40, 70])
    for i, p in enumerate(ps):
        assert pair.submit(f"r{i}", p, greedy())
    pair.run()
    for i, p in enumerate(ps):
        assert pair.outputs[f"r{i}"] == reference(p), f"prompt {i} (len {len(p)})"
        assert pair.finished[f"r{i}"] == "length"
    pair.leak_check()
    pair.close()


@pytest.mark.parametrize("policy", ["at_end", "eager"])
def test_send_policies_give_same_tokens(tiny_model, reference, policy):
    pair = PDPair(tiny_model, chunk=8, send_policy=policy)
    ps = prompts([30, 3])
    for i, p in enumerate(ps):
        pair.submit(f"r{i}", p, greedy())
    pair.run()
    assert [pair.outputs[f"r{i}"] for i in range(2)] == [reference(p) for p in ps]
    pair.leak_check()
    pair.close()


def test_prefill_prefix_hit_still_ships_cached_kv(tiny_model, reference):
    pair = PDPair(tiny_model, chunk=8)
    shared = prompts([48])[0]
    a, b = shared + [5, 6, 7], shared + [9, 10, 11, 12]
    pair.submit("a", a, greedy())
    pair.run()
    pair.submit("b", b, greedy())
    pair.run()
    assert pair.outputs["a"] == reference(a)
    assert pair.outputs["b"] == reference(b)
    assert pair.prefill.bm.prefix_hits >= 1
    pair.leak_check()
    pair.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_abort_mid_prefill_and_mid_decode_leaks_nothing(tiny_model, overlap):
    pair = PDPair(tiny_model, chunk=4, overlap=overlap)
    ps = prompts([40, 12])
    pair.submit("long", ps[0], greedy(30))
    pair.submit("short", ps[1], greedy(30))
    pair.step()
    pair.step()
    pair.prefill.abort("long")  # mid-prefill
    pair.decode.abort("long")
    for _ in range(2000):  # KV crosses on the sender's thread: wait for it, boundedly
        pair.step()
        if pair.decode.scheduler.find_running("short") is not None:
            break
        time.sleep(0.002)
    assert pair.decode.scheduler.find_running("short") is not None
    pair.decode.abort("short")  # mid-decode
    pair.prefill.abort("short")
    for _ in range(5):
        pair.step()
    pair.outputs.clear()
    pair.run()
    pair.leak_check()
    pair.close()


def test_decode_admission_is_a_promise(tiny_model):
    """A decode worker never promises more blocks than it has (no half-received deadlock)."""
    pair = PDPair(tiny_model, d_blocks=8, d_block=16, headroom=0)
    ps = prompts([100, 100])
    assert pair.submit("a", ps[0], greedy(1))  # 7 blocks promised
    assert not pair.submit("b", ps[1], greedy(1))  # would need 7 more
    pair.run()
    pair.leak_check()
    pair.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_decode_preemption_reports_recompute(tiny_model, overlap):
    pair = PDPair(tiny_model, d_blocks=6, d_block=4, headroom=0, overlap=overlap)
    ps = prompts([8, 8])
    pair.submit("a", ps[0], greedy(40))
    pair.submit("b", ps[1], greedy(40))
    pair.run()
    assert "preempted" in pair.finished.values()
    pair.leak_check()
    pair.close()
