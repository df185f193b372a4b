"""Decode tokens that overtake their leg's first token (issue 15's "all tokens at once").

The first token reaches the router over the prefill worker's control channel, and the
decode worker's tokens over its own; decode starts as soon as the final KV chunk (which
carries the first token) lands, so a late prefill message lets decode's step messages
arrive first. The router holds them and, once the first token comes, releases the first
token and the held ones in order, nothing lost, nothing twice. Released together, they
reach the reader as one coalesced delta: the client sees a late first token and then
every held token at once (the idle run's TTFT 11 ms / TPOT 0.06 ms). Here that order is
created on purpose, over the workers' (in-process) control channels.

The fix: decode's first step of a leg carries the leg's first token (from the final KV
chunk), so the router streams it from whichever message comes first and drops the other
copy. A request that asked for log-probs waits for the prefill's message (only it has the
first token's log-probs), as before. The prefill's late message is held back here by
construction: it is handed to the router only after the client read decode's tokens.
"""

from __future__ import annotations

import asyncio

import pytest

from cluster.router.types import GenerateSpec
from engine import SamplingParams
from engine.logprobs import TokenLogprobs
from engine.request import FinishReason
from runtime.messages import EventKind, LegTiming, WorkerEvent
from tests.scripted_workers import make_router, until
from tests.unit.test_router_races import assert_router_clean


async def _step(router, w, events: list[WorkerEvent]) -> None:
    """One step message of `w` over its control channel; returns once the router
    applied it (a command's reply after it comes back after it)."""
    for ev in events:
        if ev.finished or ev.kind in (EventKind.PREFILL_DONE, EventKind.PREEMPTED):  # it ends
            w.actor.held.discard(ev.leg_id)
            w.actor.ended.add(ev.leg_id)
    w.actor.send(*events)
    await w.link.call("hello")


def _run(n_overtaking: int, finish_before_first: bool):
    n_tokens = n_overtaking + (1 if finish_before_first else 3)
    spec = GenerateSpec("r", (1, 2, 3), SamplingParams(temperature=0.0, max_tokens=n_tokens))

    async def go():
        router, prefill, [decode] = make_router()
        deltas = []

        def tokens(leg: str, i: int) -> WorkerEvent:
            last = i == n_tokens - 1
            return WorkerEvent(EventKind.TOKENS, leg, "decode-0", (100 + i,),
                               finish_reason=FinishReason.LENGTH if last else None)

        async def steps(leg: str) -> None:
            await until(lambda: leg in router.legs, "the leg was made")
            for i in range(1, n_overtaking + 1):  # decode's steps overtake the first token
                await _step(router, decode, [tokens(leg, i)])
            assert router.legs[leg].generated == []  # held: nothing streams before it
            await _step(router, prefill, [WorkerEvent(EventKind.FIRST_TOKEN, leg, "prefill-0",
                                                      (100,))])
            await _step(router, prefill,
                        [WorkerEvent(EventKind.PREFILL_DONE, leg, "prefill-0")])
            for i in range(n_overtaking + 1, n_tokens):  # then in order, as usual, each
                await until(lambda n=i: sum(len(d.token_ids) for d in deltas) >= n,
                            "the reader took what was released")  # step once read
                await _step(router, decode, [tokens(leg, i)])

        async def serve(task):
            router.spawn(steps(task.leg_id))

        prefill.handle.on_add = serve
        async for d in router.generate(spec):
            deltas.append(d)
        await until(lambda: not router.flights, "the request ended")
        await router.shutdown(0)
        return deltas, router, prefill, decode

    deltas, router, prefill, decode = asyncio.run(go())
    assert_router_clean(router, prefill, [decode])
    return deltas, n_tokens


def test_decode_tokens_that_overtake_the_first_token_follow_it_in_order():
    deltas, n = _run(n_overtaking=3, finish_before_first=False)
    assert [t for d in deltas for t in d.token_ids] == list(range(100, 100 + n))
    # the first token and the three held ones leave in one release: one delta
    assert deltas[0].token_ids == (100, 101, 102, 103)
    assert [len(d.token_ids) for d in deltas[1:]] == [1, 1]  # then one per step
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"


def test_a_request_decode_finished_before_its_first_token_arrived_still_streams_it_all():
    deltas, n = _run(n_overtaking=4, finish_before_first=True)
    assert [t for d in deltas for t in d.token_ids] == list(range(100, 100 + n))
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"


# ---- decode's copy of the first token ------------------------------------------------
def lp(token: int) -> TokenLogprobs:
    return TokenLogprobs(token, -0.25 * token, 1, ((token, -0.25 * token),))


def _tok(leg: str, tok: int, last: bool = False, first: int | None = None,
         lps: bool = False) -> WorkerEvent:
    """A decode step's entry; `first`: the leg's first token, on the leg's first step."""
    return WorkerEvent(EventKind.TOKENS, leg, "decode-0", (tok,),
                       finish_reason=FinishReason.LENGTH if last else None,
                       logprobs=(lp(tok),) if lps else None, first_token=first)


def _first_tok(leg: str, tok: int = 100, lps: bool = False) -> WorkerEvent:
    return WorkerEvent(EventKind.FIRST_TOKEN, leg, "prefill-0", (tok,),
                       logprobs=(lp(tok),) if lps else None,
                       timing=LegTiming(cached_tokens=2))


def _received(deltas) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def _serve(spec: GenerateSpec, script):
    """Stream `spec`; `script(ctx, leg)` plays the workers' side of each leg (it may go on
    after the request ended, to deliver late messages); then the leak check."""
    async def go():
        router, prefill, [decode] = make_router()
        ctx = type("Ctx", (), {})()
        ctx.router, ctx.prefill, ctx.decode, ctx.deltas, ctx.legs = \
            router, prefill, decode, [], []
        scripts: list = []

        async def serve(task):
            ctx.legs.append(task.leg_id)
            scripts.append(router.spawn(script(ctx, task.leg_id)))

        async def read():
            async for d in router.generate(spec):
                ctx.deltas.append(d)

        prefill.handle.on_add = serve
        reader = asyncio.ensure_future(read())
        failed = lambda: [t for t in scripts if t.done() and t.exception()]  # noqa: E731
        await until(lambda: reader.done() or failed(), "the stream ended")
        for t in failed():
            reader.cancel()
            t.result()  # an assert that failed in a script fails the test (no hang)
        await until(lambda: all(t.done() for t in scripts), "the scripts ended")
        for t in scripts:
            t.result()
        reader.result()
        await router.shutdown(0)
        return ctx

    ctx = asyncio.run(go())
    assert_router_clean(ctx.router, ctx.prefill, [ctx.decode])
    return ctx


def test_decode_first_step_streams_the_first_token_and_the_late_prefill_copy_is_dropped():
    spec = GenerateSpec("r", (1, 2, 3), SamplingParams(temperature=0.0, max_tokens=5))

    async def script(ctx, leg):
        r, p, d = ctx.router, ctx.prefill, ctx.decode
        await until(lambda: leg in r.legs, "the leg was made")
        await _step(r, d, [_tok(leg, 101, first=100)])
        await until(lambda: _received(ctx.deltas) == [100, 101],
                    "the client got the first token from decode's step alone")
        await _step(r, d, [_tok(leg, 102)])
        await until(lambda: _received(ctx.deltas) == [100, 101, 102], "read")
        await _step(r, p, [_first_tok(leg)])  # late: recognised and dropped
        await _step(r, p, [WorkerEvent(EventKind.PREFILL_DONE, leg, "prefill-0")])
        await _step(r, d, [_tok(leg, 103)])
        await _step(r, d, [_tok(leg, 104, last=True)])

    ctx = _serve(spec, script)
    assert _received(ctx.deltas) == [100, 101, 102, 103, 104]  # the first token once
    last = ctx.deltas[-1]
    assert last.finished and last.finish_reason == "length"
    assert last.usage.completion_tokens == 5
    assert last.usage.cached_prompt_tokens == 2  # the late message's figures still count


def test_a_request_decode_finished_before_the_prefill_reported_ends_clean():
    spec = GenerateSpec("r", (1, 2, 3), SamplingParams(temperature=0.0, max_tokens=3))

    async def script(ctx, leg):
        r, p, d = ctx.router, ctx.prefill, ctx.decode
        await until(lambda: leg in r.legs, "the leg was made")
        await _step(r, d, [_tok(leg, 101, first=100)])
        await _step(r, d, [_tok(leg, 102, last=True)])
        await until(lambda: not r.flights, "the request ended")
        await _step(r, p, [_first_tok(leg)])  # the leg is gone: both ignored
        await _step(r, p, [WorkerEvent(EventKind.PREFILL_DONE, leg, "prefill-0")])

    ctx = _serve(spec, script)
    assert _received(ctx.deltas) == [100, 101, 102]
    assert ctx.deltas[-1].finished
    # decode ran on all of the leg's KV: the prefill ends its part itself, unaborted
    assert ctx.prefill.actor.calls_of("abort") == []


def test_decode_copy_of_a_first_token_that_already_streamed_is_dropped():
    spec = GenerateSpec("r", (1, 2, 3), SamplingParams(temperature=0.0, max_tokens=3))

    async def script(ctx, leg):
        r, p, d = ctx.router, ctx.prefill, ctx.decode
        await until(lambda: leg in r.legs, "the leg was made")
        await _step(r, p, [_first_tok(leg)])  # today's order: the prefill's comes first
        await until(lambda: _received(ctx.deltas) == [100], "the first token was read")
        await _step(r, d, [_tok(leg, 101, first=100)])
        await _step(r, p, [WorkerEvent(EventKind.PREFILL_DONE, leg, "prefill-0")])
        await _step(r, d, [_tok(leg, 102, last=True)])

    ctx = _serve(spec, script)
    assert _received(ctx.deltas) == [100, 101, 102]


@pytest.mark.parametrize("asked", [{"logprobs": 1}, {"prompt_logprobs": 1}])
def test_a_request_that_asked_for_logprobs_waits_for_the_prefill_first_token(asked):
    """Only the prefill computed the first token's (and the prompt's) log-probs: decode's
    copy is not streamed for such a request; its step is held until the prefill's."""
    spec = GenerateSpec("r", (1, 2, 3), SamplingParams(temperature=0.0, max_tokens=3, **asked))
    lps = "logprobs" in asked

    async def script(ctx, leg):
        r, p, d = ctx.router, ctx.prefill, ctx.decode
        await until(lambda: leg in r.legs, "the leg was made")
        await _step(r, d, [_tok(leg, 101, first=100, lps=lps)])
        assert r.legs[leg].generated == [] and not ctx.deltas  # held (the step was applied)
        await _step(r, p, [_first_tok(leg, lps=lps)])
        await _step(r, p, [WorkerEvent(EventKind.PREFILL_DONE, leg, "prefill-0")])
        await until(lambda: len(_received(ctx.deltas)) == 2, "the release was read")
        await _step(r, d, [_tok(leg, 102, last=True, lps=lps)])

    ctx = _serve(spec, script)
    tokens = _received(ctx.deltas)
    assert tokens == [100, 101, 102]
    if lps:  # every token's, once, the first one's from the prefill
        assert [x for d in ctx.deltas for x in d.logprobs or ()] == [lp(t) for t in tokens]


def test_a_leg_preempted_after_decode_streamed_the_first_token_resumes_without_a_duplicate():
    """Leg 1 streams 100, 101 from decode alone and is preempted (progress: not a
    failure); its prefill's late first token is for a leg that is gone. Leg 2 (a new leg
    id, the prompt now ends with 100, 101) streams from decode's copy again."""
    spec = GenerateSpec("r", (1, 2, 3), SamplingParams(temperature=0.0, max_tokens=5))

    async def script(ctx, leg):
        r, p, d = ctx.router, ctx.prefill, ctx.decode
        await until(lambda: leg in r.legs, "the leg was made")
        if len(ctx.legs) == 1:
            await _step(r, d, [_tok(leg, 101, first=100)])
            await until(lambda: _received(ctx.deltas) == [100, 101], "read")
            await _step(r, d, [WorkerEvent(EventKind.PREEMPTED, leg, "decode-0")])
            await until(lambda: len(ctx.legs) == 2, "the request was re-dispatched")
            await _step(r, p, [_first_tok(leg)])  # the old leg's: ignored
            await _step(r, p, [WorkerEvent(EventKind.PREFILL_DONE, leg, "prefill-0")])
            return
        await _step(r, d, [_tok(leg, 103, first=102)])
        await _step(r, p, [_first_tok(leg, 102)])
        await _step(r, p, [WorkerEvent(EventKind.PREFILL_DONE, leg, "prefill-0")])
        await _step(r, d, [_tok(leg, 104, last=True)])

    ctx = _serve(spec, script)
    assert len(ctx.legs) == 2 and ctx.legs[0] != ctx.legs[1]
    assert _received(ctx.deltas) == [100, 101, 102, 103, 104]
    assert ctx.deltas[-1].usage.completion_tokens == 5
