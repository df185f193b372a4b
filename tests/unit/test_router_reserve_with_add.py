"""The router sends a leg's decode `reserve` and its prefill `add` together when nobody
waits for admission: the first token streams from the prefill while the reserve is still
in flight; a refused reserve aborts the prefill leg and the request queues for admission
(the refusal counts there: that worker is not asked again in the round), a reserve that
can never fit fails the request RESOURCE_EXHAUSTED, a dead decode worker is marked dead
and the request served elsewhere; an end in any phase frees both workers. Reserves are
held in flight by hooks, so every order is built on purpose."""

from __future__ import annotations

import asyncio

import pytest

from cluster.router.types import ErrorCode, GenerateSpec, RouterError
from engine import SamplingParams
from runtime.messages import EventKind, WorkerLoad
from tests.scripted_workers import make_router, serve_leg, until
from tests.unit.test_router_races import assert_router_clean

SPEC = GenerateSpec("r", (1, 2, 3), SamplingParams(temperature=0.0, max_tokens=3))


def hold(worker) -> asyncio.Event:
    """Hold `worker`'s reserve calls in flight until the returned event is set."""
    land = asyncio.Event()

    async def held(task):
        await land.wait()

    worker.handle.on_reserve = held
    return land


async def first_item(stream):
    return await asyncio.wait_for(stream.__anext__(), 10)


async def rest(stream) -> list[int]:
    return [t async for d in stream for t in d.token_ids]


def test_the_first_token_streams_while_the_reserve_is_in_flight():
    async def go():
        router, prefill, [decode] = make_router()
        land = hold(decode)
        stream = router.generate(SPEC)
        first = asyncio.ensure_future(first_item(stream))
        await until(lambda: prefill.actor.calls_of("add"), "the add went out")
        [leg] = decode.actor.calls_of("reserve")
        assert prefill.actor.calls_of("add") == [leg]  # both out, the reserve unanswered
        prefill.actor.emit(EventKind.FIRST_TOKEN, leg, (7,))
        delta = await first
        assert list(delta.token_ids) == [7] and not land.is_set()  # streamed before the answer
        land.set()
        await until(lambda: leg in decode.actor.held, "the reservation landed")
        prefill.actor.emit(EventKind.PREFILL_DONE, leg)
        decode.actor.emit(EventKind.TOKENS, leg, (8, 9), finish_reason="length")
        toks = await asyncio.wait_for(rest(stream), 10)
        await router.shutdown(0)
        return toks, router, prefill, decode

    toks, router, prefill, decode = asyncio.run(go())
    assert toks == [8, 9]
    assert decode.actor.calls_of("abort") == [] and prefill.actor.calls_of("abort") == []
    assert_router_clean(router, prefill, [decode])


@pytest.mark.parametrize("first_token", ["before_refusal", "after_refusal"])
def test_a_refused_reserve_aborts_the_prefill_leg_and_the_request_is_served_elsewhere(
        first_token):
    async def go():
        router, prefill, [d0, d1] = make_router(n_decode=2)
        d0.handle.slots = 0  # full: refuses every reserve
        land = hold(d0)
        stream = router.generate(SPEC)
        first = asyncio.ensure_future(first_item(stream))
        await until(lambda: prefill.actor.calls_of("add"), "the add went out")
        [leg1] = d0.actor.calls_of("reserve")
        if first_token == "before_refusal":
            prefill.actor.emit(EventKind.FIRST_TOKEN, leg1, (7,))
            assert list((await first).token_ids) == [7]
        land.set()
        await until(lambda: len(prefill.actor.calls_of("add")) == 2, "a new leg's add")
        assert ("abort", leg1) in prefill.actor.calls  # the refused leg's prefill ended
        leg2 = router.flights["r"].leg_id
        assert d1.actor.calls_of("reserve") == [leg2] and d0.actor.calls_of("reserve") == [leg1]
        task = prefill.actor.calls_of("add")[1]
        serve_leg(prefill, d1, leg2, (7, 8, 9) if first_token == "after_refusal" else (8, 9))
        toks = list((await first).token_ids) + await asyncio.wait_for(rest(stream), 10)
        await router.shutdown(0)
        return toks, task, leg2, router, prefill, [d0, d1]

    toks, task, leg2, router, prefill, decode = asyncio.run(go())
    assert toks == [7, 8, 9]
    assert task == leg2
    assert decode[0].actor.calls_of("abort") == []  # it holds nothing: no tombstone left
    assert router.flights == {} and prefill.actor.calls_of("add")[1] == leg2
    assert_router_clean(router, prefill, decode)


def test_the_next_leg_recomputes_a_first_token_streamed_before_the_refusal():
    async def go():
        router, prefill, [d0, d1] = make_router(n_decode=2)
        d0.handle.slots = 0
        land = hold(d0)
        tasks = []

        async def record(task):
            tasks.append(task)

        prefill.handle.on_add = record
        stream = router.generate(SPEC)
        first = asyncio.ensure_future(first_item(stream))
        await until(lambda: tasks, "the add went out")
        prefill.actor.emit(EventKind.FIRST_TOKEN, tasks[0].leg_id, (7,))
        await first
        land.set()
        await until(lambda: len(tasks) == 2, "a new leg's add")
        serve_leg(prefill, d1, tasks[1].leg_id, (8, 9))
        toks = await asyncio.wait_for(rest(stream), 10)
        await router.shutdown(0)
        return toks, tasks, router, prefill, [d0, d1]

    toks, tasks, router, prefill, decode = asyncio.run(go())
    assert toks == [8, 9]  # 8: the new leg's first token
    assert tasks[1].prompt_token_ids == (1, 2, 3, 7)  # prompt + the token streamed so far
    assert tasks[1].sampling.max_tokens == 2
    assert_router_clean(router, prefill, decode)


def test_a_reserve_that_can_never_fit_fails_the_request_and_frees_the_prefill():
    async def go():
        router, prefill, [decode] = make_router()

        async def too_big(task):
            raise ValueError("prompt of 3 tokens cannot fit this decode worker's KV cache")

        decode.handle.on_reserve = too_big
        with pytest.raises(RouterError) as err:
            await asyncio.wait_for(rest(router.generate(SPEC)), 10)
        [leg] = decode.actor.calls_of("reserve")
        await until(lambda: ("abort", leg) in prefill.actor.calls, "the prefill leg aborted")
        await router.shutdown(0)
        return err.value, router, prefill, decode

    err, router, prefill, decode = asyncio.run(go())
    assert err.code == ErrorCode.RESOURCE_EXHAUSTED and "cannot fit" in err.message
    assert_router_clean(router, prefill, [decode])


def test_a_decode_worker_dying_on_the_reserve_is_marked_dead_and_a_new_leg_serves():
    async def go():
        router, prefill, [d0, d1] = make_router(n_decode=2)
        died = []

        async def dies_once(task):
            d0.handle.on_reserve = None  # (Ray restarts it: the fake answers ready at once)
            died.append(task.leg_id)
            raise RuntimeError("simulated: actor died")

        d0.handle.on_reserve = dies_once
        run = asyncio.ensure_future(rest(router.generate(SPEC)))
        await until(lambda: len(prefill.actor.calls_of("add")) == 2, "a new leg's add")
        flight = router.flights["r"]
        assert ("abort", died[0]) in prefill.actor.calls and flight.leg_id != died[0]
        await until(lambda: flight.decode is not None and flight.leg_id in flight.decode.legs
                    and flight.leg_id in flight.decode.actor.held, "the new leg reserved")
        serve_leg(prefill, flight.decode, flight.leg_id, (7, 8, 9))
        toks = await asyncio.wait_for(run, 10)
        await router.shutdown(0)
        return toks, flight, router, prefill, [d0, d1]

    toks, flight, router, prefill, decode = asyncio.run(go())
    assert toks == [7, 8, 9]
    assert flight.failures == 0  # as an admission's failed reserve: the worker, not the leg
    assert_router_clean(router, prefill, decode)


@pytest.mark.parametrize("ending", ["abort", "client-gone", "finished-at-first-token"])
def test_an_end_while_the_reserve_is_in_flight_frees_both_workers(ending):
    async def go():
        router, prefill, [decode] = make_router()
        land = hold(decode)
        spec = SPEC if ending != "finished-at-first-token" else GenerateSpec(
            "r", (1, 2, 3), SamplingParams(temperature=0.0, max_tokens=1))
        stream = router.generate(spec)
        run = asyncio.ensure_future(rest(stream))
        await until(lambda: prefill.actor.calls_of("add"), "the add went out")
        [leg] = decode.actor.calls_of("reserve")
        await until(lambda: leg in prefill.actor.held, "the prefill holds the leg")
        if ending == "abort":
            assert await router.abort("r")
        elif ending == "client-gone":
            run.cancel()
        else:
            prefill.actor.emit(EventKind.FIRST_TOKEN, leg, (7,), finish_reason="length")
        await until(lambda: ("abort", leg) in decode.actor.calls, "decode told to abort")
        land.set()  # the reservation lands after its abort: the tombstone swallows it
        result = await asyncio.gather(run, return_exceptions=True)
        await until(lambda: not decode.actor.tombstones, "the late reserve was swallowed")
        await router.shutdown(0)
        return result[0], leg, router, prefill, decode

    result, leg, router, prefill, decode = asyncio.run(go())
    if ending == "abort":
        assert isinstance(result, RouterError) and result.code == ErrorCode.CANCELLED
        assert ("abort", leg) in prefill.actor.calls
    elif ending == "client-gone":
        assert isinstance(result, asyncio.CancelledError)
        assert ("abort", leg) in prefill.actor.calls
    else:
        assert result == [7]
    assert leg not in decode.actor.held
    assert_router_clean(router, prefill, [decode])


def test_a_burst_sends_one_reserve_with_an_add_per_decode_worker_the_rest_queue():
    """pipelined_reserves off: one reserve with an add in flight per decode worker."""
    async def go():
        router, prefill, [decode] = make_router(max_queue_len=1, pipelined_reserves=False)
        land = hold(decode)
        a = asyncio.ensure_future(rest(router.generate(SPEC)))
        await until(lambda: prefill.actor.calls_of("add"), "a's add went out")
        b = asyncio.ensure_future(rest(router.generate(GenerateSpec("b", (4, 5), SPEC.sampling))))
        await until(lambda: router.waiting_admission == 1, "b queues for admission")
        assert len(prefill.actor.calls_of("add")) == 1  # b's add waits for its reservation
        with pytest.raises(RouterError) as full:
            await rest(router.generate(GenerateSpec("c", (6,), SPEC.sampling)))
        land.set()
        await until(lambda: len(prefill.actor.calls_of("add")) == 2, "b's add after its grant")
        for rid in ("r", "b"):
            serve_leg(prefill, decode, router.flights[rid].leg_id, (7, 8, 9))
        toks = await asyncio.wait_for(asyncio.gather(a, b), 10)
        await router.shutdown(0)
        return toks, full.value, router, prefill, decode

    toks, full, router, prefill, decode = asyncio.run(go())
    assert toks == [[7, 8, 9], [7, 8, 9]]
    assert full.code == ErrorCode.RESOURCE_EXHAUSTED and "queue is full" in full.message
    assert_router_clean(router, prefill, [decode])


def test_pipelined_reserves_send_a_burst_at_once_while_the_load_has_room():
    """pipelined_reserves: reserves in flight do not hold the next arrival back; the room
    is the last load's less the blocks of the reserves in flight, so the arrival that
    finds none left queues for admission as before."""
    async def go():
        router, prefill, [decode] = make_router(block_size=4, pipelined_reserves=True)
        decode.load = WorkerLoad(kv_blocks_promisable=2)  # a 3-token prompt asks 1 block
        land = hold(decode)
        specs = [GenerateSpec(rid, (1, 2, 3), SPEC.sampling) for rid in ("a", "b", "c")]
        streams = [asyncio.ensure_future(rest(router.generate(s))) for s in specs]
        await until(lambda: router.waiting_admission == 1, "c queues for admission")
        await until(lambda: len(decode.actor.calls_of("reserve")) == 3, "c's admission asks")
        # a's and b's reserves went with their adds, both in flight; c's add waits for its
        # grant (its reserve is the admission's)
        assert [leg.split("#")[0] for leg in prefill.actor.calls_of("add")] == ["a", "b"]
        assert not land.is_set()
        land.set()
        await until(lambda: len(prefill.actor.calls_of("add")) == 3, "c's add after its grant")
        for rid in ("a", "b", "c"):
            serve_leg(prefill, decode, router.flights[rid].leg_id, (7, 8, 9))
        toks = await asyncio.wait_for(asyncio.gather(*streams), 10)
        await router.shutdown(0)
        return toks, router, prefill, decode

    toks, router, prefill, decode = asyncio.run(go())
    assert toks == [[7, 8, 9]] * 3
    assert not router._reserving  # every reserve sent with an add was answered
    assert_router_clean(router, prefill, [decode])


def test_before_any_load_message_a_pipelined_burst_is_bounded_by_the_whole_cache():
    """No load message yet: the room is the worker's whole cache (100 blocks of 4) less
    the reserves in flight (150 tokens ask 38 blocks each): two go with their adds, the
    third queues for admission, the fourth finds the queue full (max_queue_len 1)."""
    async def go():
        router, prefill, [decode] = make_router(block_size=4, max_queue_len=1,
                                                pipelined_reserves=True)
        assert decode.load is None
        land = hold(decode)
        specs = [GenerateSpec(f"r{i}", tuple(range(1, 151)), SPEC.sampling) for i in range(3)]
        streams = [asyncio.ensure_future(rest(router.generate(s))) for s in specs]
        await until(lambda: router.waiting_admission == 1, "r2 queues for admission")
        assert [leg.split("#")[0] for leg in prefill.actor.calls_of("add")] == ["r0", "r1"]
        with pytest.raises(RouterError) as full:
            await rest(router.generate(GenerateSpec("r3", (1,), SPEC.sampling)))
        land.set()
        await until(lambda: len(prefill.actor.calls_of("add")) == 3, "r2's add after its grant")
        for i in range(3):
            serve_leg(prefill, decode, router.flights[f"r{i}"].leg_id, (7, 8, 9))
        toks = await asyncio.wait_for(asyncio.gather(*streams), 10)
        await router.shutdown(0)
        return toks, full.value, router, prefill, decode

    toks, full, router, prefill, decode = asyncio.run(go())
    assert toks == [[7, 8, 9]] * 3
    assert full.code == ErrorCode.RESOURCE_EXHAUSTED and "queue is full" in full.message
    assert_router_clean(router, prefill, [decode])


def test_pipelined_reserves_spread_a_burst_over_the_decode_workers():
    """The reserves in flight count in each worker's KV usage: a burst on two equally
    loaded workers alternates between them instead of piling onto the first."""
    async def go():
        router, prefill, decode = make_router(block_size=4, n_decode=2, pipelined_reserves=True)
        for w in decode:
            w.load = WorkerLoad(kv_blocks_promisable=100)
        lands = [hold(w) for w in decode]
        specs = [GenerateSpec(f"r{i}", (1, 2, 3), SPEC.sampling) for i in range(4)]
        streams = [asyncio.ensure_future(rest(router.generate(s))) for s in specs]
        await until(lambda: len(prefill.actor.calls_of("add")) == 4, "four adds out")
        asked = [len(w.actor.calls_of("reserve")) for w in decode]
        for land in lands:
            land.set()
        flights = [router.flights[s.request_id] for s in specs]
        await until(lambda: all(f.leg_id in f.decode.actor.held for f in flights),
                    "every reservation landed")
        for f in flights:
            serve_leg(prefill, f.decode, f.leg_id, (7, 8))
        toks = await asyncio.wait_for(asyncio.gather(*streams), 10)
        await router.shutdown(0)
        return asked, toks, router, prefill, decode

    asked, toks, router, prefill, decode = asyncio.run(go())
    assert asked == [2, 2] and toks == [[7, 8]] * 4
    assert not router._reserving
    assert_router_clean(router, prefill, decode)


def test_a_burst_at_an_idle_pool_goes_at_once_only_within_each_tenants_share():
    """admission_order wfq, gold 2 : free 1, a pool of 400 tokens, prompts of 40: free's
    first two go at once alone, gold's first beside them (its share: 266 tokens), free's
    third too (120 of its 133), its fourth queues, and so does everyone after it (someone
    waits); every leg is served and no tenant holds room at the end."""
    async def go():
        router, prefill, [decode] = make_router(
            block_size=4, pipelined_reserves=True, admission_order="wfq",
            tenant_weights={"gold": 2.0, "free": 1.0})
        land = hold(decode)
        tenants = ["free", "free", "gold", "free", "free", "gold", "gold"]
        specs = [GenerateSpec(f"{t}{i}", tuple(range(1, 41)), SPEC.sampling, tenant=t)
                 for i, t in enumerate(tenants)]
        streams = []
        for s in specs:  # in this order
            streams.append(asyncio.ensure_future(rest(router.generate(s))))
            await until(lambda s=s: s.request_id in router.flights, "it arrived")
        await until(lambda: router.waiting_admission == 3, "the rest queue")
        at_once = [leg.split("#")[0] for leg in prefill.actor.calls_of("add")]
        held = dict(router.admission.core.held)
        land.set()
        await until(lambda: len(prefill.actor.calls_of("add")) == 7, "all admitted")
        for s in specs:
            serve_leg(prefill, decode, router.flights[s.request_id].leg_id, (7, 8))
        toks = await asyncio.wait_for(asyncio.gather(*streams), 10)
        await router.shutdown(0)
        return at_once, held, toks, router, prefill, decode

    at_once, held, toks, router, prefill, decode = asyncio.run(go())
    assert at_once == ["free0", "free1", "gold2", "free3"]
    assert held == {"free": 120, "gold": 40}
    assert toks == [[7, 8]] * 7
    assert_router_clean(router, prefill, [decode])
