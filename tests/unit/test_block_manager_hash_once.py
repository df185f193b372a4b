"""A prompt's block hashes are computed once per request: the prefill scheduler's lookup
(repeated while the request waits at the queue head) and the publishing of its chunks
reuse them, and hashes given from outside (the simulator's placement) are not redone.
Every test that holds blocks ends with a leak check."""

from __future__ import annotations

import sys
from array import array

import pytest

import engine.block_manager as bmod
from cluster.router.policies import PrefillLoad, PrefixAffinity
from engine.block_manager import BlockManager, block_hashes
from engine.request import Request, SamplingParams
from prefill_worker.scheduler import PrefillScheduler, PrefillSchedulerConfig


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(temperature=0.0, max_tokens=4,
                                                     ignore_eos=True))


@pytest.fixture
def digests(monkeypatch):
    calls: list[int] = []
    real = bmod.xxh3_128_digest
    monkeypatch.setattr(bmod, "xxh3_128_digest", lambda b: calls.append(1) or real(b))
    return calls


def _drain(sched: PrefillScheduler) -> None:
    while sched.has_work:
        items = sched.schedule()
        assert items, "prefills left but none scheduled"
        sched.advance(items)
        for i in items:
            if i.completes_prefill:
                sched.finish(i.request, i.request.status)


def test_a_waiting_prefill_is_hashed_once_over_its_lookups_and_chunks(digests):
    bm = BlockManager(12, 4)
    sched = PrefillScheduler(PrefillSchedulerConfig(max_num_batched_tokens=8,
                                                    max_prefill_chunk=8), bm)
    sched.add(_req("a", range(100, 140)))  # 10 blocks: the pool's 12 leave "b" waiting
    sched.add(_req("b", range(200, 241)))  # 41 tokens: 10 full blocks, 11 to hold them
    sched.schedule()
    assert list(sched.active) == ["a"] and len(sched.waiting) == 1
    for _ in range(3):  # "b" is looked up at every step while it waits
        sched.schedule()
    assert len(digests) == 10 + 10  # each full block of each prompt once, so far
    _drain(sched)
    assert len(digests) == 20  # its five chunks published without hashing again
    assert set(block_hashes(list(range(200, 241)), 4)) <= set(bm._hash_to_block)
    bm.check_integrity()
    assert bm.num_used_blocks == 0 and not bm._known and not bm._chains


def test_given_hashes_are_used_for_the_lookup_and_the_publishing(digests):
    bm = BlockManager(16, 4)
    tokens = list(range(7, 37))  # 30 tokens: 7 full blocks
    hashes = block_hashes(tokens, 4)
    digests.clear()
    a = _req("a", tokens)
    bm.note_hashes("a", hashes)
    assert bm.match_prefix(tokens, bm.request_hashes(a, tokens)) == []
    bm.take_prefix(a, [])
    for end in (9, 20, 30):
        assert bm.allocate(a, end)
        bm.cache_full_blocks(a, tokens[:end])
    assert digests == []
    assert [bm._block_to_hash[b] for b in a.block_ids[:7]] == hashes
    # a second request with the same prompt hits all usable blocks, through its hashes
    b = _req("b", tokens)
    assert bm.match_prefix(tokens, bm.request_hashes(b, tokens)) == a.block_ids[:7]
    assert len(digests) == 7  # b's own hashes, once
    bm.take_prefix(b, bm.match_prefix(tokens, bm.request_hashes(b, tokens)))
    assert len(digests) == 7
    bm.free(a)
    bm.free(b)
    bm.check_integrity()
    assert bm.num_used_blocks == 0 and not bm._known


def test_request_hashes_extend_as_the_tokens_grow_and_leave_one_token_to_compute():
    bm = BlockManager(16, 4)
    tokens = list(range(50, 62))  # 3 full blocks
    r = _req("r", tokens)
    assert bm.request_hashes(r, tokens[:6]) == block_hashes(tokens[:6], 4)
    assert bm.request_hashes(r, tokens) == block_hashes(tokens, 4)
    assert bm.request_hashes(r, tokens[:4]) == block_hashes(tokens, 4)  # holds more
    assert bm.allocate(r, 12)
    bm.cache_full_blocks(r, tokens)
    bm.free(r)
    # all 12 tokens cached: a lookup still leaves the last block's token to compute
    s = _req("s", tokens)
    assert bm.match_prefix(tokens, bm.request_hashes(s, tokens)) == bm.match_prefix(tokens)
    assert len(bm.match_prefix(tokens)) == 2
    bm.free(s)
    bm.check_integrity()
    assert bm.num_used_blocks == 0 and not bm._known


def test_no_hashes_are_kept_with_prefix_caching_off(digests):
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    r = _req("r", range(20))
    bm.note_hashes("r", [b"x" * 16])
    assert bm.request_hashes(r, r.prompt_token_ids) == [] and digests == []
    assert not bm._known


def test_prefix_affinity_keys_on_the_given_first_block_hash():
    loads = [PrefillLoad("p0", 0), PrefillLoad("p1", 0)]
    prompt = list(range(40))
    hashed, plain = PrefixAffinity(block_size=16), PrefixAffinity(block_size=16)
    assert hashed.pick(loads, prompt, block_hashes(prompt, 16)) == plain.pick(loads, prompt)
    assert list(hashed._last) == list(plain._last) == [block_hashes(prompt, 16)[0]]
    busy = [PrefillLoad("p0", 0), PrefillLoad("p1", 0)][::-1]  # p1 first: least-loaded tie
    assert hashed.pick(busy, prompt, block_hashes(prompt, 16)) == "p0"  # sticky


@pytest.mark.parametrize("tokens", [[], [5], list(range(3, 200, 7)), [2**31 - 1, -(2**31), 0],
                                    [2**40, 1, 2], [True, 7]])
def test_packing_is_little_endian_int32_else_int64_as_array_packs(tokens):
    wide = any(not -(2**31) <= t < 2**31 for t in tokens)
    want = array("q" if wide else "i", tokens)
    if sys.byteorder == "big":
        want.byteswap()
    assert bmod._pack(tokens) == want.tobytes()
    assert bmod._pack(tuple(tokens)) == want.tobytes()


@pytest.mark.parametrize(("tokens", "error"), [([1.5], TypeError), ([2**70], OverflowError),
                                               (["7"], TypeError)])
def test_packing_refuses_what_array_refuses(tokens, error):
    with pytest.raises(error):
        bmod._pack(tokens)
