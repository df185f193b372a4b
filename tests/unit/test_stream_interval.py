"""stream_interval: the router releases a request's tokens every N tokens (the first
token and the last message at once), with nothing lost, log-probs along with their tokens;
and a leak check after."""

from __future__ import annotations

import asyncio
import math

import pytest

from cluster.router.flight import RouterConfig
from cluster.router.types import GenerateSpec
from engine import SamplingParams
from engine.logprobs import TokenLogprobs
from engine.request import FinishReason
from runtime.batch_codec import decode_batch, encode_batch
from runtime.messages import EventKind, WorkerEvent
from tests.scripted_workers import make_router, until
from tests.unit.test_router_races import assert_router_clean


def _run(interval: int, n_tokens: int):
    spec = GenerateSpec("r", (1, 2, 3), SamplingParams(temperature=0.0, max_tokens=n_tokens))

    async def go():
        router, prefill, [decode] = make_router(stream_interval=interval)

        deltas = []
        released = lambda: sum(len(d.token_ids) for d in deltas)  # noqa: E731

        async def steps(leg_id):  # decode's tokens one step at a time; each step waits
            for i in range(1, n_tokens):  # until the reader took what was released
                need = i - (i - 1) % interval
                await until(lambda n=need: released() >= n, "the reader kept up")
                decode.actor.emit(EventKind.TOKENS, leg_id, (100 + i,),
                                  finish_reason="length" if i == n_tokens - 1 else None)

        async def serve(task):
            prefill.actor.emit(EventKind.FIRST_TOKEN, task.leg_id, (100,))
            prefill.actor.emit(EventKind.PREFILL_DONE, task.leg_id)
            router.spawn(steps(task.leg_id))

        prefill.handle.on_add = serve
        async for d in router.generate(spec):
            deltas.append(d)
        await until(lambda: not router.flights, "the request ended")
        await router.shutdown(0)
        return deltas, router, prefill, decode

    return asyncio.run(go())


@pytest.mark.parametrize("interval", [1, 3, 8])
def test_tokens_are_released_every_stream_interval_and_none_is_lost(interval):
    deltas, router, prefill, decode = _run(interval, 11)
    assert [t for d in deltas for t in d.token_ids] == list(range(100, 111))
    assert deltas[0].token_ids == (100,)  # the first token goes at once
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"
    for d in deltas[1:-1]:  # between them: whole intervals (more when coalesced)
        assert len(d.token_ids) >= interval and len(d.token_ids) % interval == 0
    if interval == 1:
        assert len(deltas) == 11  # a reader keeping up gets one message per token
    assert_router_clean(router, prefill, [decode])


def test_stream_interval_must_be_positive():
    with pytest.raises(ValueError, match="stream_interval"):
        RouterConfig(stream_interval=0)


def lp(token: int) -> TokenLogprobs:
    return TokenLogprobs(token, -0.25 * token, 1, ((token, -0.25 * token), (3, -math.inf)))


@pytest.mark.parametrize("interval", [1, 3])
def test_logprobs_cross_the_step_codec_and_stream_with_their_tokens(interval):
    """A leg's events as a control channel delivers them (encode_batch -> decode_batch ->
    the pump's on_batch, the step path): each token's log-probs and the prompt's reach the
    client with their tokens, once each, held and coalesced with them by stream_interval."""
    prompt_lps = (None, lp(2), lp(3))
    sp = SamplingParams(temperature=0.0, max_tokens=7, logprobs=2, prompt_logprobs=1)

    def step(w, ev: WorkerEvent) -> None:
        if ev.finished or ev.kind == EventKind.PREFILL_DONE:  # the leg ends there (as emit)
            w.actor.held.discard(ev.leg_id)
            w.actor.ended.add(ev.leg_id)
        _, load, entries = decode_batch(encode_batch(w.worker_id, [ev], None))
        router.pump.on_batch(w, load, entries)

    async def go():
        nonlocal router
        router, prefill, [decode] = make_router(stream_interval=interval)

        async def steps(leg):
            await until(lambda: leg in router.legs, "the leg was made")
            step(prefill, WorkerEvent(EventKind.FIRST_TOKEN, leg, "prefill-0", (100,),
                                      logprobs=(lp(100),), prompt_logprobs=prompt_lps))
            step(prefill, WorkerEvent(EventKind.PREFILL_DONE, leg, "prefill-0"))
            for i in range(1, 7):
                step(decode, WorkerEvent(EventKind.TOKENS, leg, "decode-0", (100 + i,),
                                         logprobs=(lp(100 + i),),
                                         finish_reason=FinishReason.LENGTH if i == 6 else None))

        async def serve(task):
            router.spawn(steps(task.leg_id))

        prefill.handle.on_add = serve
        deltas = [d async for d in router.generate(GenerateSpec("r", (1, 2, 3), sp))]
        await until(lambda: not router.flights, "the request ended")
        await router.shutdown(0)
        return deltas, prefill, decode

    router = None
    deltas, prefill, decode = asyncio.run(go())
    tokens = [t for d in deltas for t in d.token_ids]
    assert tokens == list(range(100, 107)) and deltas[-1].finish_reason == "length"
    assert [x for d in deltas for x in d.logprobs or ()] == [lp(t) for t in tokens]
    assert all(len(d.logprobs or ()) == len(d.token_ids) for d in deltas)
    assert [d.prompt_logprobs for d in deltas if d.prompt_logprobs] == [prompt_lps]
    assert deltas[0].prompt_logprobs == prompt_lps  # with the first token
    assert_router_clean(router, prefill, [decode])
