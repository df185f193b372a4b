"""The front door's streaming parts: DeltaStream coalescing (a slow reader gets fewer,
larger deltas, nothing lost, log-probs kept with their tokens, tokens before an error
first), batched incremental
detokenization equal to decoding each request alone, and the detokenizer thread handing
texts back in order on the event loop; a byte-level tokenizer's byte table."""

from __future__ import annotations

import asyncio
import random

import pytest

from cluster.router.delta_stream import DeltaStream
from cluster.router.types import ErrorCode, RouterError, TokenDelta
from engine.detokenize import (
    BatchDecoder,
    DetokenizerThread,
    IncrementalDetokenizer,
    byte_level_table,
)
from engine.loader import load_tokenizer
from engine.logprobs import TokenLogprobs


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return load_tokenizer(str(tiny_model))


def test_a_slow_reader_gets_every_token_coalesced_and_the_end_once():
    async def go():
        s = DeltaStream("r")
        s.put([1], "a")
        s.put([2, 3], "bc")
        first = await s.get()  # everything put so far, in one delta
        s.put([4], "d", TokenDelta("r", (), True, "length", None))
        last = await s.get()
        return first, last, s.empty()

    first, last, empty = asyncio.run(go())
    assert (first.token_ids, first.text, first.finished) == ((1, 2, 3), "abc", False)
    assert (last.token_ids, last.text, last.finished, last.finish_reason) == (
        (4,), "d", True, "length")
    assert empty


def test_coalesced_deltas_keep_each_tokens_logprobs_and_the_prompts_once():
    def lp(t):
        return TokenLogprobs(t, -0.5 * t, 1)

    async def go():
        s = DeltaStream("r")
        s.put_nowait(TokenDelta("r", (1,), logprobs=(lp(1),), prompt_logprobs=(None, lp(9))))
        s.put([2, 3], None, None, (lp(2), lp(3)))
        first = await s.get()
        s.put([4], None, TokenDelta("r", (), True, "stop", None), (lp(4),))
        return first, await s.get()

    first, last = asyncio.run(go())
    assert first.token_ids == (1, 2, 3) and first.logprobs == (lp(1), lp(2), lp(3))
    assert first.prompt_logprobs == (None, lp(9))
    assert last.logprobs == (lp(4),) and last.prompt_logprobs is None and last.finished


def test_tokens_put_before_an_error_are_read_before_it_and_a_waiting_reader_wakes():
    async def go():
        s = DeltaStream("r")
        reader = asyncio.ensure_future(s.get())
        await asyncio.sleep(0)
        assert not reader.done()  # nothing yet: it waits (one Future, not one per token)
        s.put([5], None)
        s.put_nowait(RouterError(ErrorCode.CANCELLED, "aborted"))
        got = await reader
        return got, await s.get()

    got, err = asyncio.run(go())
    assert got.token_ids == (5,) and got.text is None and not got.finished
    assert isinstance(err, RouterError) and err.code == ErrorCode.CANCELLED


def test_batch_decoder_equals_the_tokenizers_decode(tokenizer):
    rng = random.Random(0)
    seqs = [[rng.randrange(len(tokenizer)) for _ in range(rng.randrange(0, 30))]
            for _ in range(200)]
    d = BatchDecoder(tokenizer)
    assert d._backend is not None  # the fast path is the one under test
    assert d.decode_many(seqs) == [tokenizer.decode(s, skip_special_tokens=True) for s in seqs]


def test_a_step_batch_detokenizes_each_request_as_it_would_alone(tokenizer):
    rng = random.Random(1)
    outputs = [[rng.randrange(len(tokenizer)) for _ in range(24)] for _ in range(12)]
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    alone = [IncrementalDetokenizer(decode) for _ in outputs]
    batched = [IncrementalDetokenizer() for _ in outputs]
    d = BatchDecoder(tokenizer)
    want, got = [[] for _ in outputs], [[] for _ in outputs]
    pos = [0] * len(outputs)
    while any(p < 24 for p in pos):
        items = []
        for i, out in enumerate(outputs):  # each request advances 0-3 tokens per step
            if pos[i] >= 24:
                continue
            n = min(24 - pos[i], rng.randrange(0, 4))
            new, pos[i] = out[pos[i]:pos[i] + n], pos[i] + n
            final = pos[i] >= 24
            want[i].append(alone[i].push(new, final=final))
            items.append((i, new, final))
        texts = d.push_many([(batched[i], new, final) for i, new, final in items])
        for (i, _, _), t in zip(items, texts, strict=True):
            got[i].append(t)
    assert got == want
    assert ["".join(g) for g in got] == [decode(o) for o in outputs]


def test_a_request_pushed_twice_in_one_batch_keeps_its_order(tokenizer):
    ids = tokenizer("the quick brown fox jumps over the lazy dog again").input_ids
    decode = lambda x: tokenizer.decode(x, skip_special_tokens=True)  # noqa: E731
    alone, batched = IncrementalDetokenizer(decode), IncrementalDetokenizer()
    pieces = [ids[i:i + 2] for i in range(0, len(ids), 2)]
    want = [alone.push(p, final=k == len(pieces) - 1) for k, p in enumerate(pieces)]
    got = BatchDecoder(tokenizer).push_many(  # e.g. several queued steps of one request
        [(batched, p, k == len(pieces) - 1) for k, p in enumerate(pieces)])
    assert got == want and "".join(got) == decode(ids)


def test_the_detokenizer_thread_hands_texts_back_on_the_loop_in_order(tokenizer):
    class Holder:
        detok = None

    async def go():
        loop = asyncio.get_running_loop()
        th = DetokenizerThread(tokenizer, loop, inline=False)
        holders = [Holder(), Holder()]
        ids = tokenizer("hello world, again and again").input_ids
        done: list = []
        finished = asyncio.Event()
        for k, tok in enumerate(ids):
            last = k == len(ids) - 1
            th.submit([(h, [tok], last) for h in holders],
                      lambda items, texts, k=k: (done.append((k, texts)),
                                                 finished.set() if k == len(ids) - 1 else None))
        await asyncio.wait_for(finished.wait(), 10)
        th.stop()
        return ids, done

    ids, done = asyncio.run(go())
    assert [k for k, _ in done] == list(range(len(ids)))  # in submission order
    for h in range(2):
        assert "".join(t[h] for _, t in done) == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_byte_level_tokenizer_streams_through_its_byte_table(tokenizer):
    """The tiny model's tokenizer is byte-level BPE: push_many goes through the byte
    table (no window decoded) and gives the windows' deltas: a character split across
    tokens is held back until complete, and the deltas join to the whole decode."""
    d = BatchDecoder(tokenizer)
    assert d._table is not None and len(d._table) == len(tokenizer)
    text = "héllo wörld ✓ 日本語 \U0001f600!"
    ids = tokenizer(text).input_ids
    decode = lambda x: tokenizer.decode(x, skip_special_tokens=True)  # noqa: E731
    alone, fast = IncrementalDetokenizer(decode), IncrementalDetokenizer()
    want = [alone.push([t], final=k == len(ids) - 1) for k, t in enumerate(ids)]
    got = [d.push_many([(fast, [t], k == len(ids) - 1)])[0] for k, t in enumerate(ids)]
    assert got == want and "".join(got) == decode(ids) == text
    assert not any("\ufffd" in g for g in got)
    eos = tokenizer.eos_token_id  # a special token decodes to nothing; an id past the
    tail = IncrementalDetokenizer()  # vocabulary too (as the tokenizer's decode)
    assert d.push_many([(tail, [ids[0], eos, len(tokenizer) + 5], True)]) == [
        decode([ids[0], eos])]


def test_a_tokenizer_that_is_not_byte_level_gets_no_byte_table():
    class NotByteLevel:
        class backend_tokenizer:  # noqa: N801
            decoder = type("Metaspace", (), {})()

    assert byte_level_table(NotByteLevel()) is None


def test_a_byte_table_detokenizes_inline_before_submit_returns(tokenizer):
    class Holder:
        detok = None

    th = DetokenizerThread(tokenizer, loop=None)  # no thread, no loop needed
    assert th.inline
    holders = [Holder(), Holder()]
    ids = tokenizer("héllo wörld ✓").input_ids
    got: list[list[str]] = [[], []]
    for k, tok in enumerate(ids):
        th.submit([(h, [tok], k == len(ids) - 1) for h in holders],
                  lambda items, texts: [got[i].append(t) for i, t in enumerate(texts)])
        assert len(got[0]) == k + 1  # delivered before submit returned
    want = tokenizer.decode(ids, skip_special_tokens=True)
    assert ["".join(g) for g in got] == [want, want]
