"""The BlockManager's prefix cache, driven step by step through the scheduler with fake
runner outputs: blocks shared by live requests with refcounts, LRU eviction and its hash
maps, and the block hash chain (xxh3-128, the same in every process, each block hashed
once). Every test ends with a leak check (integrity holds, zero used blocks)."""

from __future__ import annotations

import os

import pytest

from engine.block_manager import BlockManager, block_hashes, chain_hash
from engine.request import Request, RequestStatus, SamplingParams
from tests.sched_steps import assert_no_leak, make, run_to_end, sched, step

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---- prefix cache -------------------------------------------------------------------
def test_prefix_blocks_are_shared_by_two_live_requests_with_refcounts():
    s = sched(16, max_num_batched_tokens=64)
    a = make("a", 10, max_tokens=3)  # blocks [0..3] [4..7] full, [8, 9] partial
    s.add_request(a)
    step(s)
    shared = a.block_ids[:2]
    b = Request("b", a.prompt_token_ids[:8] + [900, 901, 902],
                SamplingParams(temperature=0.0, max_tokens=3))
    s.add_request(b)
    step(s)  # a decodes, b is admitted with a 2-block prefix hit
    assert b.prefix_hit_tokens == 8 and b.block_ids[:2] == shared
    assert b.num_computed_tokens == b.num_cached_tokens == 11
    assert [s.bm._ref[x] for x in shared] == [2, 2]
    assert s.bm.prefix_hits == 1
    used_both, a_private = s.bm.num_used_blocks, len(a.block_ids) - len(shared)
    s.abort("a")  # shared blocks survive with one reference
    assert [s.bm._ref[x] for x in shared] == [1, 1]
    assert s.bm.num_used_blocks == used_both - a_private
    run_to_end(s)
    assert b.status == RequestStatus.FINISHED_LENGTH
    # freed hashed blocks stay cached (reusable), but none is in use
    assert all(x in s.bm._cached_free for x in shared)
    assert_no_leak(s)


def test_prefix_hit_leaves_at_least_one_token_to_compute():
    s = sched(16, max_num_batched_tokens=64)
    a = make("a", 8, max_tokens=1)  # exactly two full blocks
    s.add_request(a)
    run_to_end(s)
    b = make("b", 8, max_tokens=1)  # the same prompt
    s.add_request(b)
    out = step(s)
    assert b.prefix_hit_tokens == 4  # the last block is recomputed to get logits
    assert out.items[0].start == 4 and out.items[0].num_tokens == 4
    assert_no_leak(s)


def test_lru_eviction_reuses_the_oldest_cached_blocks_and_cleans_hash_maps():
    s = sched(6, max_num_batched_tokens=64)
    bm = s.bm
    a = make("a", 9, max_tokens=1, base=100)  # 2 full blocks hashed + 1 partial
    b = make("b", 9, max_tokens=1, base=500)
    for r in (a, b):
        s.add_request(r)
        run_to_end(s)
    assert len(bm._hash_to_block) == 4 and len(bm._cached_free) == 4
    assert len(bm._free) == 2
    a_blocks = bm.match_prefix(a.prompt_token_ids)
    b_blocks = bm.match_prefix(b.prompt_token_ids)
    assert len(a_blocks) == len(b_blocks) == 2
    # free list (2 blocks) runs dry; the next 2 blocks come from the LRU, oldest first:
    # a's blocks entered first, tail block first
    c = make("c", 15, max_tokens=2, base=900)
    s.add_request(c)
    step(s)
    assert set(c.block_ids) >= set(a_blocks)
    assert bm.match_prefix(a.prompt_token_ids) == []
    assert bm.match_prefix(b.prompt_token_ids) == b_blocks
    # a's hashes are gone from both maps (the blocks now hold c's tokens)
    for h in block_hashes(a.prompt_token_ids, 4):
        assert h not in bm._hash_to_block
    for x in a_blocks:
        assert bm._block_to_hash.get(x) in (None, *block_hashes(c.prompt_token_ids, 4))
    run_to_end(s)
    assert_no_leak(s)


def test_lru_eviction_takes_the_tail_block_of_the_oldest_prefix_first():
    s = sched(4, max_num_batched_tokens=64)
    bm = s.bm
    a = make("a", 9, max_tokens=1)  # blocks: 2 full (hashed) + 1 partial
    s.add_request(a)
    run_to_end(s)
    head, tail = bm.match_prefix(a.prompt_token_ids)
    c = make("c", 11, max_tokens=2, base=700)  # needs 3 blocks: 2 free + 1 evicted
    s.add_request(c)
    step(s)
    assert tail in c.block_ids and head not in c.block_ids
    assert bm.match_prefix(a.prompt_token_ids) == [head]  # the shorter prefix still hits
    run_to_end(s)
    assert_no_leak(s)


def test_prefix_hit_refreshes_lru_position():
    s = sched(7, max_num_batched_tokens=64)
    bm = s.bm
    a = make("a", 9, max_tokens=1, base=100)
    b = make("b", 9, max_tokens=1, base=500)
    for r in (a, b):
        s.add_request(r)
        run_to_end(s)
    a_blocks = bm.match_prefix(a.prompt_token_ids)
    a2 = make("a2", 9, max_tokens=1, base=100)  # hits a's blocks: they become newest
    s.add_request(a2)
    run_to_end(s)
    assert a2.prefix_hit_tokens == 8
    b_blocks = bm.match_prefix(b.prompt_token_ids)
    c = make("c", 19, max_tokens=2, base=900)  # 5 blocks: 3 free + 2 from the LRU
    s.add_request(c)
    step(s)
    assert set(b_blocks) <= set(c.block_ids)  # b's were the oldest now
    assert bm.match_prefix(b.prompt_token_ids) == []
    assert bm.match_prefix(a.prompt_token_ids) == a_blocks
    run_to_end(s)
    assert_no_leak(s)


def test_reset_prefix_cache_returns_cached_blocks_to_the_free_list():
    s = sched(8, max_num_batched_tokens=64)
    a = make("a", 13, max_tokens=1)
    s.add_request(a)
    run_to_end(s)
    assert s.bm._cached_free
    s.bm.reset_prefix_cache()
    assert not s.bm._cached_free and not s.bm._hash_to_block and not s.bm._block_to_hash
    assert s.bm.match_prefix(a.prompt_token_ids) == []
    assert_no_leak(s)


def test_prefix_caching_off_never_hashes():
    s = sched(8, max_num_batched_tokens=64, prefix=False)
    for rid in ("a", "b"):
        s.add_request(make(rid, 13, max_tokens=2))
        run_to_end(s)
    assert not s.bm._hash_to_block and s.bm.prefix_queries == 0
    assert_no_leak(s)


# ---- the block hash chain -----------------------------------------------------------
def test_block_hashes_chain_over_full_blocks_only():
    h = block_hashes(list(range(10)), 4)
    assert len(h) == 2
    assert block_hashes(list(range(8)) + [99], 4) == h  # same full blocks, same chain
    assert block_hashes([0, 1, 2, 3, 9, 5, 6, 7], 4)[1] != h[1]  # parent change propagates
    assert block_hashes([1, 2, 3], 4) == [] and block_hashes([], 4) == []
    with pytest.raises(ValueError):
        BlockManager(0, 4)


def test_block_hashes_are_xxh3_128_of_parent_and_little_endian_int32_tokens():
    import struct

    import xxhash

    tokens = [5, 70000, 0, 2**31 - 1, 9, 9, 9, 9]
    first = xxhash.xxh3_128_digest(bytes(16) + struct.pack("<4i", *tokens[:4]))
    second = xxhash.xxh3_128_digest(first + struct.pack("<4i", *tokens[4:]))
    assert block_hashes(tokens, 4) == [first, second]
    assert chain_hash(first, tokens[4:]) == second
    # an id beyond int32 packs as int64: twice the bytes, so never the input of an int32 block
    wide = block_hashes([2**40, 1, 2, 3], 4)
    assert wide == [xxhash.xxh3_128_digest(bytes(16) + struct.pack("<4q", 2**40, 1, 2, 3))]


def test_block_hashes_are_the_same_in_every_process():
    """The router and every worker hash prompts in their own processes (and Python's
    str/bytes hash is salted per process): the chain must not depend on the process."""
    import subprocess
    import sys

    code = ("from engine.block_manager import block_hashes; "
            "print(','.join(h.hex() for h in block_hashes(list(range(3, 200, 7)), 5)))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip()
            for seed in ("1", "2", "random")}
    assert outs == {",".join(h.hex() for h in block_hashes(list(range(3, 200, 7)), 5))}


def test_chunked_caching_hashes_each_block_once_and_equals_the_full_chain(monkeypatch):
    """A request's chain is kept: every chunk hashes only the blocks it filled (chained
    from the last one), and the published hashes are the whole prompt's chain."""
    import engine.block_manager as bmod

    calls = []
    real = bmod.xxh3_128_digest
    monkeypatch.setattr(bmod, "xxh3_128_digest", lambda b: calls.append(1) or real(b))
    bm = BlockManager(16, 4)
    r = make("a", 30, base=7)
    tokens = r.prompt_token_ids
    for end in (3, 9, 10, 17, 26, 30):  # chunks that end inside and on block edges
        assert bm.allocate(r, end)
        bm.cache_full_blocks(r, tokens[:end])
    assert len(calls) == 30 // 4  # 7 full blocks, each hashed once
    assert [bm._block_to_hash[b] for b in r.block_ids[:7]] == block_hashes(tokens, 4)
    # a second request takes the prefix and goes on from the hit's last hash
    calls.clear()
    b = make("b", 30, base=7)
    hit = bm.match_prefix(b.prompt_token_ids)
    assert len(hit) == 7 and len(calls) == 7
    bm.take_prefix(b, hit)
    calls.clear()
    b.prompt_token_ids.extend(range(500, 506))  # 36 tokens: block 8 is new
    assert bm.allocate(b, 36)
    bm.cache_full_blocks(b, b.prompt_token_ids)
    assert len(calls) == 2  # blocks 8 and 9 only, chained from the hit
    assert bm._block_to_hash[b.block_ids[8]] == block_hashes(b.prompt_token_ids, 4)[8]
    bm.free(r)
    bm.free(b)
    bm.check_integrity()
    assert bm.num_used_blocks == 0


def test_a_prefix_lookup_hashes_up_to_its_first_miss(monkeypatch):
    import engine.block_manager as bmod

    bm = BlockManager(16, 4)
    r = make("a", 12)
    assert bm.allocate(r, 12)
    bm.cache_full_blocks(r, r.prompt_token_ids)
    bm.free(r)
    calls = []
    real = bmod.xxh3_128_digest
    monkeypatch.setattr(bmod, "xxh3_128_digest", lambda b: calls.append(1) or real(b))
    other = list(range(100, 104)) + [1] * 36  # block 0 hits, block 1 misses
    assert len(bm.match_prefix(other)) == 1
    assert len(calls) == 2  # not the 9 usable blocks of the prompt
