"""Paged KV block accounting: free list, refcounts, prefix hashes, LRU of cached blocks.

Every physical block is in exactly one of three places:
- the free list (refcount 0, no hash),
- the LRU of cached free blocks (refcount 0, holds a prefix hash, reusable on a hit),
- in use (refcount = number of requests whose block table holds it).
"""

from __future__ import annotations

import sys
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Sequence
from struct import Struct
from struct import error as StructError
from typing import TYPE_CHECKING

from xxhash import xxh3_128_digest

if TYPE_CHECKING:  # hints only: prefix hashing (routing policies, --help) needs no torch
    from engine.request import Request

_ROOT = bytes(16)  # the parent of a sequence's first block
_INT32: dict[int, Struct] = {}  # n -> the packer of n little-endian int32 (a few lengths)


def _pack(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian int32 (int64 if one does not fit: a block then has twice
    the bytes, so the two packings can never give the same hash input)."""
    n = len(tokens)
    packer = _INT32.get(n)
    if packer is None:
        packer = Struct(f"<{n}i")
        if len(_INT32) < 1024:
            _INT32[n] = packer
    try:  # (a Struct packs a list ~2.5x faster than array() converts it)
        return packer.pack(*tokens)
    except StructError:  # out of int32 (or not ints): as array() packs them, or its error
        pass
    try:
        packed = array("i", tokens)
    except OverflowError:
        packed = array("q", tokens)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def chain_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Hash of a full block given its parent's hash: equal prefixes give equal chains.
    xxh3_128 over the parent's 16 bytes then the block's packed token ids."""
    return xxh3_128_digest(parent + _pack(tokens))


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Chained hashes of every *full* block of `token_ids` (stable across processes and
    machines: no Python `hash()`, a fixed byte order)."""
    return list(iter_block_hashes(token_ids, block_size))


def iter_block_hashes(token_ids: Sequence[int], block_size: int, parent: bytes = _ROOT
                      ) -> Iterator[bytes]:
    """`block_hashes` one block at a time (a lookup stops at its first miss), chained
    from `parent` (the hash of the block before `token_ids[0]`)."""
    n = len(token_ids) // block_size
    if n == 0:
        return
    data = _pack(token_ids[: n * block_size])
    step = len(data) // n  # bytes per block
    for off in range(0, n * step, step):
        parent = xxh3_128_digest(parent + data[off : off + step])
        yield parent


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: deque[int] = deque(range(num_blocks))
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # LRU: oldest first
        self._ref = [0] * num_blocks
        self._hash_to_block: dict[bytes, int] = {}
        self._block_to_hash: dict[int, bytes] = {}
        self._owners: dict[str, list[int]] = {}  # request_id -> its block table (shared list)
        # request_id -> the hashes of its leading full blocks, so far: a chunk hashes only
        # the blocks it filled, chained from the last one
        self._chains: dict[str, list[bytes]] = {}
        # request_id -> the hashes of its leading full blocks as far as they were hashed
        # (request_hashes, or given by note_hashes): each block is hashed once per request
        self._known: dict[str, list[bytes]] = {}
        self.prefix_hits = 0
        self.prefix_queries = 0

    # ---- capacity -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free + evictable cached)."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, request: Request, num_tokens: int) -> int:
        """New blocks `request` needs so that `num_tokens` total tokens have slots."""
        return max(0, self.blocks_for(num_tokens) - len(request.block_ids))

    # ---- prefix cache ---------------------------------------------------------------
    def note_hashes(self, request_id: str, hashes: list[bytes]) -> None:
        """Hashes of a request's leading full blocks (`block_hashes` of its prompt with this
        manager's block size) already computed elsewhere, e.g. for placement: lookups and
        publishing take them instead of hashing again. Kept until `free`."""
        if self.enable_prefix_caching:
            self._known[request_id] = hashes

    def request_hashes(self, request: Request, token_ids: Sequence[int]) -> list[bytes]:
        """The hashes of the full blocks of `token_ids` (the request's leading tokens),
        hashed once per request: the list kept for it, extended as far as `token_ids`
        reaches (it may hold more). Empty with prefix caching off."""
        if not self.enable_prefix_caching:
            return []
        known = self._known.get(request.request_id)
        if known is None:
            known = self._known[request.request_id] = []
        have, bs = len(known), self.block_size
        n = len(token_ids) // bs
        if n > have:
            known.extend(iter_block_hashes(token_ids[have * bs : n * bs], bs,
                                           known[-1] if known else _ROOT))
        return known

    def match_prefix(self, token_ids: Sequence[int],
                     hashes: Sequence[bytes] | None = None) -> list[int]:
        """Cached blocks holding a prefix of `token_ids`; always leaves >= 1 token to compute.
        `hashes`: the full-block hashes of `token_ids` if known (`request_hashes`).

        A lookup only: nothing is taken and no statistic counts it (`take_prefix` does)."""
        if not self.enable_prefix_caching:
            return []
        usable = (len(token_ids) - 1) // self.block_size
        todo: Iterable[bytes] = (
            iter_block_hashes(token_ids[: usable * self.block_size], self.block_size)
            if hashes is None else hashes[:usable] if len(hashes) > usable else hashes)
        hit: list[int] = []
        get = self._hash_to_block.get
        for h in todo:
            b = get(h)
            if b is None:
                break
            hit.append(b)
        return hit

    def admission_cost(self, hit: Sequence[int], num_tokens: int) -> int:
        """Free blocks a fresh request consumes to hold `num_tokens` tokens when it takes
        the prefix `hit`: its new blocks *plus* the hit blocks no request holds, which
        leave the LRU of cached free blocks (they count as free until taken)."""
        new = max(0, self.blocks_for(num_tokens) - len(hit))
        return new + sum(1 for b in hit if self._ref[b] == 0)

    def take_prefix(self, request: Request, blocks: Sequence[int]) -> None:
        """Give a fresh request the prefix blocks from `match_prefix` (adds references).

        Call it once per admitted request (with an empty hit too): it counts the lookup."""
        assert not request.block_ids, "prefix blocks go into an empty block table"
        if self.enable_prefix_caching:
            self.prefix_queries += 1
            self.prefix_hits += bool(blocks)
        for b in blocks:
            if self._ref[b] == 0:
                del self._cached_free[b]
            self._ref[b] += 1
        request.block_ids.extend(blocks)
        self._owners[request.request_id] = request.block_ids
        # a hit block is cached, so it holds its hash: the chain goes on from there
        self._chains[request.request_id] = [self._block_to_hash[b] for b in blocks]

    # ---- allocation -----------------------------------------------------------------
    def allocate(self, request: Request, num_tokens: int) -> bool:
        """Grow `request`'s block table to hold `num_tokens` tokens; False if out of blocks."""
        blocks, free = request.block_ids, self._free
        n = -(-num_tokens // self.block_size) - len(blocks)
        if n > len(free) + len(self._cached_free):
            return False
        self._owners[request.request_id] = blocks
        if n <= 0:
            return True
        ref = self._ref
        if n <= len(free):  # no eviction: the free list in order
            for _ in range(n):
                b = free.popleft()
                ref[b] = 1
                blocks.append(b)
            return True
        # the free list first, then evict the least recently used cached blocks
        cached, hashed, by_hash = self._cached_free, self._block_to_hash, self._hash_to_block
        for _ in range(n):
            if free:
                b = free.popleft()
            else:
                b, _ = cached.popitem(last=False)
                del by_hash[hashed.pop(b)]
            ref[b] = 1
            blocks.append(b)
        return True

    def cache_full_blocks(self, request: Request, token_ids: Sequence[int]) -> None:
        """Publish hashes of the request's blocks that `token_ids` (KV written) fills."""
        if not self.enable_prefix_caching:
            return
        chain = self._chains.setdefault(request.request_id, [])
        done, bs = len(chain), self.block_size
        full = min(len(token_ids) // bs, len(request.block_ids))
        if full <= done:
            return
        known = self._known.get(request.request_id)
        if known is not None and len(known) >= full:
            chain.extend(known[done:full])
        else:
            chain.extend(iter_block_hashes(token_ids[done * bs : full * bs], bs,
                                           chain[-1] if chain else _ROOT))
        by_hash, hashed = self._hash_to_block, self._block_to_hash
        for b, h in zip(request.block_ids[done:full], chain[done:full], strict=True):
            if h not in by_hash and b not in hashed:
                by_hash[h] = b
                hashed[b] = h

    def free(self, request: Request) -> None:
        """Drop the request's references; cached blocks go to the LRU, tail first."""
        blocks = self._owners.pop(request.request_id, None)
        self._chains.pop(request.request_id, None)
        self._known.pop(request.request_id, None)
        if blocks is None:
            request.block_ids.clear()
            return
        ref, hashed, cached, free = self._ref, self._block_to_hash, self._cached_free, self._free
        if not hashed:  # no block holds a hash (prefix caching off): all go to the free list
            for b in reversed(blocks):
                left = ref[b] = ref[b] - 1
                assert left >= 0, f"block {b} refcount below zero"
                if left == 0:
                    free.append(b)
            blocks.clear()
            return
        for b in reversed(blocks):
            left = ref[b] = ref[b] - 1
            assert left >= 0, f"block {b} refcount below zero"
            if left == 0:
                if b in hashed:
                    cached[b] = None
                else:
                    free.append(b)
        blocks.clear()

    def reset_prefix_cache(self) -> None:
        """Forget every cached-but-free block (e.g. after weights change)."""
        for b in list(self._cached_free):
            del self._hash_to_block[self._block_to_hash.pop(b)]
            self._free.append(b)
        self._cached_free.clear()

    # ---- invariants -----------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError if any accounting invariant is broken."""
        counts = [0] * self.num_blocks
        for rid, blocks in self._owners.items():
            assert len(set(blocks)) == len(blocks), f"{rid} holds a block twice"
            for b in blocks:
                counts[b] += 1
        assert counts == self._ref, "refcounts differ from block-table references"
        free = set(self._free)
        cached = set(self._cached_free)
        assert len(free) == len(self._free), "duplicate block in free list"
        assert not free & cached, "block both free and cached"
        for b in range(self.num_blocks):
            in_use = self._ref[b] > 0
            assert in_use + (b in free) + (b in cached) == 1, f"block {b} misplaced"
        for b in free:
            assert b not in self._block_to_hash, f"free block {b} still hashed"
        for b in cached:
            assert b in self._block_to_hash, f"cached block {b} without hash"
        assert len(self._hash_to_block) == len(self._block_to_hash)
        for h, b in self._hash_to_block.items():
            assert self._block_to_hash[b] == h, "hash maps disagree"
