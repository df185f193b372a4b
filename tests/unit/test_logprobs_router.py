"""The router and log-probs, with scripted fake workers (tests/scripted_workers.py): the
workers' log-probs reach the client's deltas unchanged, and a leg that is re-dispatched
after the first token (a decode preemption) does not ask for the prompt's log-probs
again (they came with that first token), while one that failed before it does."""

from __future__ import annotations

import asyncio

import pytest

from cluster.router.types import GenerateSpec
from engine import SamplingParams
from engine.logprobs import TokenLogprobs
from engine.request import FinishReason
from runtime.messages import EventKind, WorkerEvent
from tests.scripted_workers import make_router

SP = SamplingParams(temperature=0.0, max_tokens=3, logprobs=1, prompt_logprobs=2)
PROMPT_LPS = (None, TokenLogprobs(2, -1.5, 3, ((9, -0.5), (4, -1.0))))


def lp(token: int) -> TokenLogprobs:
    return TokenLogprobs(token, -0.25 * token, 1, ((token, -0.25 * token),))


@pytest.mark.parametrize("first_leg_ends", ["preempted_after_first_token",
                                            "failed_before_first_token"])
def test_redispatched_legs_ask_for_prompt_logprobs_only_until_they_arrived(first_leg_ends):
    async def go():
        router, prefill, [decode] = make_router()
        tasks = []

        async def add(task):
            tasks.append(task)
            leg = task.leg_id
            if len(tasks) == 1 and first_leg_ends == "failed_before_first_token":
                prefill.actor.emit(EventKind.FAILED, leg, message="simulated")
                return
            first = len(task.prompt_token_ids) - 2  # the tokens generated so far
            ev = WorkerEvent(EventKind.FIRST_TOKEN, leg, "prefill-0", (7 + first,),
                             logprobs=(lp(7 + first),),
                             prompt_logprobs=PROMPT_LPS if task.sampling.prompt_logprobs
                             else None)
            prefill.actor.send(ev)
            prefill.actor.emit(EventKind.PREFILL_DONE, leg)
            if len(tasks) == 1:  # decode runs out of blocks after the first token
                decode.actor.emit(EventKind.PREEMPTED, leg)
            else:
                decode.actor.send(WorkerEvent(
                    EventKind.TOKENS, leg, "decode-0", (9,), logprobs=(lp(9),),
                    finish_reason=FinishReason.LENGTH))
                decode.actor.held.discard(leg)

        prefill.handle.on_add = add
        deltas = [d async for d in router.generate(GenerateSpec("r", (1, 2), SP))]
        await router.shutdown(0)
        return deltas, tasks

    deltas, tasks = asyncio.run(asyncio.wait_for(go(), 20))
    assert len(tasks) == 2
    first, second = tasks
    assert first.sampling.prompt_logprobs == 2 and second.sampling.logprobs == 1
    tokens = [t for d in deltas for t in d.token_ids]
    lps = [x for d in deltas for x in d.logprobs or ()]
    assert [x.token_id for x in lps] == tokens  # every token's, once, unchanged
    assert all(x == lp(x.token_id) for x in lps)
    prompt = [d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None]
    assert prompt == [PROMPT_LPS]  # delivered exactly once
    if first_leg_ends == "preempted_after_first_token":
        assert tokens == [7, 8, 9] and second.sampling.prompt_logprobs is None
        assert second.sampling.max_tokens == 2
    else:
        assert tokens == [7, 9] and second.sampling.prompt_logprobs == 2
