"""The decode worker's side of stream_interval (decode_worker/engine.py): a leg's tokens are
reported when the router will release them (its first decode step at once, then every
k decode tokens, a finish at once), nothing lost or reordered, held tokens reported
before a preemption and dropped by an abort; leak checks after."""

from __future__ import annotations

import pytest

from runtime.messages import EventKind
from tests.pd_harness import PDPair, greedy

PROMPTS = {"a": list(range(1, 40)), "b": list(range(50, 61)), "c": list(range(7, 90))}


def _run(model, interval: int, max_tokens: int = 17, **kw) -> PDPair:
    pair = PDPair(model, stream_interval=interval, **kw)
    for rid, prompt in PROMPTS.items():
        assert pair.submit(rid, prompt, greedy(max_tokens))
    pair.run()
    return pair


@pytest.mark.parametrize("interval", [2, 3, 8])
def test_tokens_are_reported_when_the_router_releases_them_and_none_is_lost(tiny_model,
                                                                             interval):
    one = _run(tiny_model, 1)
    held = _run(tiny_model, interval)
    try:
        assert held.outputs == one.outputs  # every token, in order, greedy-exact
        assert held.finished == one.finished
        for rid in PROMPTS:
            sizes = [len(e.token_ids) for e in held.events
                     if e.kind == EventKind.TOKENS and e.leg_id == rid]
            # 16 decode tokens: the first step's at once (it carries the first token), then
            # up to decode token k (k-1 more), then k at a time, the rest with the finish
            want = [1, interval - 1] + [interval] * ((16 - interval) // interval)
            rest = 16 - sum(want)
            assert sizes == want + ([rest] if rest else [])
        assert not held.decode._held
        held.leak_check()
    finally:
        one.close()
        held.close()


def test_an_abort_drops_the_held_tokens(tiny_model):
    pair = PDPair(tiny_model, stream_interval=8)
    try:
        assert pair.submit("a", PROMPTS["a"], greedy(40))
        while len(pair.outputs["a"]) < 2 or not pair.decode._held:
            pair.step()
        reported = list(pair.outputs["a"])
        assert pair.decode.abort("a")
        assert "a" not in pair.decode._held
        pair.finished["a"] = "aborted"
        pair.run()
        assert pair.outputs["a"] == reported  # nothing after the abort
        pair.leak_check()
    finally:
        pair.close()


def test_a_preempted_leg_reports_what_it_held_before_it_leaves(tiny_model):
    # 8 blocks of 16 tokens: legs growing to 99 and 71 tokens (7 + 5 blocks) cannot both stay
    pair = PDPair(tiny_model, d_blocks=8, headroom=0, stream_interval=8)
    try:
        assert pair.submit("a", PROMPTS["a"], greedy(60))
        assert pair.submit("b", PROMPTS["b"], greedy(60))
        pair.run()
        kinds = [(e.kind, e.leg_id, len(e.token_ids)) for e in pair.events]
        pre = [i for i, (k, _, _) in enumerate(kinds) if k == EventKind.PREEMPTED]
        assert pre, "the pool was meant to run out"
        for i in pre:
            leg = kinds[i][1]
            before = [k for k in kinds[:i] if k[1] == leg and k[0] == EventKind.TOKENS]
            # every decode token it made went out before the PREEMPTED event
            assert sum(n for _, _, n in before) == len(pair.outputs[leg]) - 1
        assert not pair.decode._held
        pair.leak_check()
    finally:
        pair.close()
