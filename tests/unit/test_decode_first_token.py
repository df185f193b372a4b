"""Decode's first step of a leg carries the leg's first token (issue 15): the real
prefill and decode engines in one process (tests/pd_harness.py), and the step codec.

The router streams the first token from whichever message comes first (decode's step or
the prefill's FIRST_TOKEN; tests/unit/test_router_overtaking.py), so decode's copy must
be exactly the prefill's token, on the leg's first TOKENS entry only, outside token_ids
(which stay one per sampled token, aligned with their log-probs).
"""

from __future__ import annotations

from dataclasses import replace

from runtime.batch_codec import decode_batch, encode_batch, entry_event
from runtime.messages import EventKind, WorkerEvent
from tests.pd_harness import PDPair, greedy


def test_the_first_decode_step_of_each_leg_carries_the_prefill_first_token(tiny_model):
    pd = PDPair(tiny_model, p_block=16, d_block=8, chunk=7, budget=32)
    prompts = {"a": [5, 9, 13, 2, 77, 31, 8, 40, 41, 6], "b": [3, 1, 4, 1, 5, 9, 2, 6],
               "c": [11, 12, 13]}
    sps = {"a": greedy(6), "b": replace(greedy(4), logprobs=2), "c": greedy(1)}
    for rid, p in prompts.items():
        assert pd.submit(rid, p, sps[rid])
    pd.run()
    for rid in ("a", "b"):
        first = [e for e in pd.events if e.leg_id == rid and e.kind == EventKind.FIRST_TOKEN]
        steps = [e for e in pd.events if e.leg_id == rid and e.kind == EventKind.TOKENS]
        assert len(first) == 1 and len(steps) == sps[rid].max_tokens - 1
        assert steps[0].first_token == first[0].token_ids[0]  # decode's copy, exactly
        assert all(e.first_token is None for e in steps[1:])  # once per leg
        assert all(len(e.token_ids) == 1 for e in steps)  # its own token only
        # outputs count each token once: the first (prefill's) and decode's own
        assert pd.outputs[rid] == [first[0].token_ids[0], *(e.token_ids[0] for e in steps)]
    assert all(len(e.logprobs) == 1 for e in pd.events
               if e.leg_id == "b" and e.kind == EventKind.TOKENS)
    # a request that ended at its first token never reaches decode: no copy anywhere
    assert [e.kind for e in pd.events if e.leg_id == "c"] == [EventKind.FIRST_TOKEN]
    pd.leak_check()
    pd.close()


def test_the_step_codec_carries_the_first_token_and_leaves_hot_entries_plain():
    events = [WorkerEvent(EventKind.TOKENS, "a#1", "decode-0", (101,), first_token=100),
              WorkerEvent(EventKind.TOKENS, "b#1", "decode-0", (7,))]
    wid, _, entries = decode_batch(encode_batch("decode-0", events, None))
    assert entries[0][7] == {"first_token": 100}  # the router's slow path (once a leg)
    assert entries[1][7] is None  # the per-token hot path is unchanged
    back = [entry_event(wid, e) for e in entries]
    assert [(e.token_ids, e.first_token) for e in back] == [((101,), 100), ((7,), None)]
