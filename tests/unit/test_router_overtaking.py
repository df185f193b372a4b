"""Decode tokens that overtake their leg's first token (issue 15's "all tokens at once").

The first token reaches the router over the prefill worker's control channel, and the
decode worker's tokens over its own; decode starts as soon as the final KV chunk (which
carries the first token) lands, so a late prefill message lets decode's step messages
arrive first. The router holds them and, once the first token comes, releases the first
token and the held ones in order, nothing lost, nothing twice. Released together, they
reach the reader as one coalesced delta: the client sees a late first token and then
every held token at once (the idle run's TTFT 11 ms / TPOT 0.06 ms). Here that order is
created on purpose, over the step path (encode_batch -> decode_batch -> on_batch).
"""

from __future__ import annotations

import asyncio

from cluster.types import GenerateSpec
from engine import SamplingParams
from engine.request import FinishReason
from runtime.batch_codec import decode_batch, encode_batch
from runtime.messages import EventKind, WorkerEvent
from tests.router_fakes import make_router, until
from tests.unit.test_router_races import assert_router_clean


def _step(router, w, events: list[WorkerEvent]) -> None:
    """One step message of `w`, as its control channel delivers it."""
    for ev in events:
        if ev.finished or ev.kind == EventKind.PREFILL_DONE:  # the leg ends there
            w.actor.held.discard(ev.leg_id)
            w.actor.ended.add(ev.leg_id)
    _, load, entries = decode_batch(encode_batch(w.worker_id, events, None))
    router.pump.on_batch(w, load, entries)


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
                _step(router, decode, [tokens(leg, i)])
            assert router.legs[leg].generated == []  # held: nothing streams before it
            _step(router, prefill, [WorkerEvent(EventKind.FIRST_TOKEN, leg, "prefill-0",
                                                (100,))])
            _step(router, prefill, [WorkerEvent(EventKind.PREFILL_DONE, leg, "prefill-0")])
            for i in range(n_overtaking + 1, n_tokens):  # then in order, as usual, each
                await until(lambda n=i: sum(len(d.token_ids) for d in deltas) >= n,
                            "the reader took what was released")  # step once read
                _step(router, decode, [tokens(leg, i)])

        async def serve(task):
            router.spawn(steps(task.leg_id))

        prefill.actor.on_add = serve
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
