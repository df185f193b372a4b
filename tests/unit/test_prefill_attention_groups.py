"""torch_ref's prefill attention batches sequences of one (chunk, context) shape into one
kernel call: each sequence's rows must be exactly what it gets alone, and right."""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention import torch_ref


def _batch(rng: random.Random, shapes: list[tuple[int, int]], block_size: int,
           heads: tuple[int, int, int] = (4, 2, 16)):
    """A paged batch: (q_len, context before the chunk) per sequence, blocks shuffled."""
    h, kvh, d = heads
    lens = [ctx + q for q, ctx in shapes]
    width = max(-(-n // block_size) for n in lens)
    blocks = list(range(len(shapes) * width))
    rng.shuffle(blocks)
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    k = torch.randn(len(blocks), block_size, kvh, d, generator=g)
    v = torch.randn(len(blocks), block_size, kvh, d, generator=g)
    tables = torch.tensor([blocks[s * width:(s + 1) * width] for s in range(len(shapes))],
                          dtype=torch.int32)
    starts = [0]
    for q_len, _ in shapes:
        starts.append(starts[-1] + q_len)
    q = torch.randn(starts[-1], h, d, generator=g)
    return (q, k, v, tables, torch.tensor(starts, dtype=torch.int32),
            torch.tensor(lens, dtype=torch.int32), 0.25)


def _dense(q, k, v, tables, starts, lens, scale):
    """Textbook attention per sequence: its keys read slot by slot, bottom-right causal."""
    out = torch.zeros_like(q)
    bs, group = k.shape[1], q.shape[1] // k.shape[2]
    for s, n in enumerate(lens.tolist()):
        a, b = starts[s].item(), starts[s + 1].item()
        if a == b:
            continue
        slots = [(tables[s, i // bs].item(), i % bs) for i in range(n)]
        ks = torch.stack([k[blk, off] for blk, off in slots]).repeat_interleave(group, 1)
        vs = torch.stack([v[blk, off] for blk, off in slots]).repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[a:b], ks) * scale
        pos = torch.arange(n - (b - a), n).unsqueeze(1)
        scores = scores.masked_fill(torch.arange(n).unsqueeze(0) > pos, float("-inf"))
        out[a:b] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs)
    return out


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_grouped_rows_equal_each_sequence_alone_and_the_textbook(block_size):
    rng = random.Random(block_size)
    for _ in range(20):
        # repeated shapes (a burst of equal prompts, equal chunks at one offset) beside
        # unique ones, square chunks, chunks over a context, single queries, empty rows
        pool = [(32, 0), (32, 0), (7, 0), (16, 32), (16, 32), (1, 20), (1, 20), (0, 8), (5, 3)]
        shapes = [rng.choice(pool) for _ in range(rng.randint(1, 9))]
        args = _batch(rng, shapes, block_size)
        q, k, v, tables, starts, lens, scale = args
        got = torch_ref.paged_prefill_attention(*args)
        for s in range(len(shapes)):
            a, b = starts[s].item(), starts[s + 1].item()
            alone = torch_ref.paged_prefill_attention(
                q[a:b], k, v, tables[s:s + 1], torch.tensor([0, b - a], dtype=torch.int32),
                lens[s:s + 1], scale)
            assert torch.equal(got[a:b], alone), (shapes, s)
        torch.testing.assert_close(got, _dense(*args), rtol=1e-5, atol=1e-5)


def test_one_step_plans_once_for_all_its_layers():
    args = _batch(random.Random(0), [(32, 0), (32, 0), (16, 32)], 4)
    calls = []
    real = torch_ref._prefill_plan
    try:
        torch_ref._prefill_plan = lambda *a: calls.append(1) or real(*a)
        first = torch_ref.paged_prefill_attention(*args)
        again = torch_ref.paged_prefill_attention(*args)  # the next layer: same metadata
    finally:
        torch_ref._prefill_plan = real
    assert len(calls) == 1 and torch.equal(first, again)
