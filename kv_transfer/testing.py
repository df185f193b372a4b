"""Test/bench helpers: a toy paged KV cache that exports and imports global token ranges.

The engine's ``kv_cache.py`` has the real one; this exists so kv_transfer's tests and
benchmark can check byte-exact round trips between caches of different block sizes
without depending on the engine.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from kv_transfer.base import KVChunk
from kv_transfer.heads import HeadRange


class PagedKV:
    """``blocks``: [num_blocks, layers, 2, block_size, kv_heads, head_dim].

    Token ``i`` of a request lives at ``blocks[table[i // B], :, :, i % B]``. A TP rank's
    cache holds only the model's heads ``heads`` (global head h at local h - heads.start).
    """

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                 num_blocks: int, dtype: torch.dtype = torch.float32,
                 heads: HeadRange | None = None) -> None:
        self.heads = heads.check() if heads is not None else None
        if heads is not None and heads.count != num_kv_heads:
            raise ValueError(f"a cache of {num_kv_heads} KV heads cannot hold heads {heads}")
        self.block_size = block_size
        self.blocks = torch.zeros(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim,
                                  dtype=dtype)
        self.tables: dict[str, list[int]] = {}
        self._free = list(range(num_blocks - 1, -1, -1))

    def allocate(self, request_id: str, num_tokens: int) -> None:
        need = -(-num_tokens // self.block_size)
        if need > len(self._free):
            raise MemoryError(f"need {need} blocks, {len(self._free)} free")
        self.tables[request_id] = [self._free.pop() for _ in range(need)]

    def free(self, request_id: str) -> None:
        self._free.extend(self.tables.pop(request_id))

    def _segments(self, request_id: str, start: int, end: int) -> Iterable[tuple[int, int, int, int]]:
        """(block id, offset in block, offset in range, length) covering tokens [start, end).

        Token i sits in block table[i // B] at offset i % B; a range is cut at block edges:
            |....[xxxx|xxxxxxxx|xx..|   -> three segments
        """
        b, table = self.block_size, self.tables[request_id]
        i = start
        while i < end:
            off = i % b
            n = min(b - off, end - i)
            yield table[i // b], off, i - start, n
            i += n

    def fill_random(self, request_id: str, num_tokens: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for blk, off, _, n in self._segments(request_id, 0, num_tokens):
            shape = self.blocks[blk, :, :, off : off + n].shape  # [L, 2, n, H, D]
            self.blocks[blk, :, :, off : off + n] = torch.randn(shape, generator=g).to(self.blocks.dtype)

    def export(self, request_id: str, start: int, end: int) -> torch.Tensor:
        """KV of tokens [start, end): a contiguous [layers, 2, tokens, heads, dim] tensor."""
        _, n_layers, _, _, heads, dim = self.blocks.shape
        out = torch.empty(n_layers, 2, end - start, heads, dim, dtype=self.blocks.dtype)
        for blk, off, pos, n in self._segments(request_id, start, end):
            out[:, :, pos : pos + n] = self.blocks[blk, :, :, off : off + n]
        return out

    def import_chunk(self, chunk: KVChunk) -> None:
        """Write a received chunk into this cache by global token index, layer range and
        head range (its heads must be among this cache's)."""
        ls, le = chunk.layer_start, chunk.layer_end
        h0 = chunk.head_start - (self.heads.start if self.heads is not None else 0)
        h1 = h0 + chunk.payload.shape[3]
        if h0 < 0 or h1 > self.blocks.shape[4]:
            raise ValueError(f"chunk heads {chunk.heads} are not in this cache's {self.heads}")
        for blk, off, pos, n in self._segments(chunk.request_id, chunk.token_start, chunk.token_end):
            self.blocks[blk, ls:le, :, off : off + n, h0:h1] = chunk.payload[:, :, pos : pos + n]


def make_chunks(cache: PagedKV, request_id: str, bounds: Iterable[int], *, first_token: int = 7,
                tenant: str = "default") -> list[KVChunk]:
    """Chunks of a request cut at token ``bounds`` (0 = b0 < b1 < ... = prompt length).

    The last chunk is final and carries ``first_token``; equal consecutive bounds make
    an empty chunk (allowed for the final one).
    """
    b = list(bounds)
    chunks = []
    for i, (s, e) in enumerate(zip(b[:-1], b[1:], strict=True)):
        last = i == len(b) - 2
        h = cache.heads
        chunks.append(KVChunk(request_id, i, s, e, cache.export(request_id, s, e), is_final=last,
                              first_token=first_token if last else None, tenant=tenant,
                              head_start=h.start if h else 0, num_kv_heads=h.total if h else 0))
    return chunks


def random_bounds(rng, num_tokens: int, max_cuts: int = 6) -> list[int]:
    """Random chunk boundaries 0 = b0 <= ... <= bn = num_tokens (``rng``: random.Random)."""
    cuts = sorted(rng.sample(range(1, num_tokens), min(max_cuts, num_tokens - 1)))
    bounds = [0, *cuts, num_tokens]
    if rng.random() < 0.3:
        bounds.append(num_tokens)  # an empty final chunk carrying only the first token
    return bounds


def pump(sender, receiver, cache: PagedKV, request_ids: Iterable[str], *,
         timeout_s: float = 20.0) -> tuple[dict[str, str], dict[str, str]]:
    """Drive a receiver owner loop (import + release) until every request is finished or
    failed on the sender; returns (sender failures, receiver failures) by request id."""
    import time

    pending = set(request_ids)
    tx_failed: dict[str, str] = {}
    rx_failed: dict[str, str] = {}
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        ev = receiver.poll()
        for chunk in ev.chunks:
            cache.import_chunk(chunk)
            receiver.release(chunk)
        rx_failed.update(ev.failed)
        sev = sender.poll()
        pending -= set(sev.finished)
        for rid, why in sev.failed:
            tx_failed[rid] = why
            pending.discard(rid)
        if not ev.chunks:
            receiver.wait(0.005)
    if pending:
        raise TimeoutError(f"requests neither finished nor failed: {sorted(pending)}")
    return tx_failed, rx_failed
