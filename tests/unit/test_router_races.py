"""Router races with scripted fake worker actors (tests/scripted_workers.py; the real pools
run in tests/integration): a pool dying during dispatch, aborts while a reservation is
in flight, a re-dispatch that waits for admission, events from a worker that does not
hold the leg. Each test ends with the router's leak check."""

from __future__ import annotations

import asyncio

import pytest

from cluster.router.types import ErrorCode, GenerateSpec, RouterError
from engine import SamplingParams
from runtime.messages import EventKind
from tests.scripted_workers import collect, make_router, serve_leg, until

SPEC = GenerateSpec("r", (1, 2, 3), SamplingParams(temperature=0.0, max_tokens=2))


def assert_router_clean(router, prefill, decode) -> None:
    assert not router.flights and not router.legs and router.waiting_admission == 0
    assert not router.admission.core.held  # no tenant holds decode room any more
    for w in [prefill, *decode]:
        assert not w.legs, (w.worker_id, w.legs)
        assert not w.actor.held, (w.worker_id, w.actor.held)  # nothing left on any worker
    assert prefill.outstanding_tokens == 0


async def _serve_and_stop(router, spec=SPEC) -> list[int]:
    """Stream `spec` to its end (bounded), then shut the router down."""
    toks = await asyncio.wait_for(collect(router.generate(spec)), 10)
    await router.shutdown(0)
    return toks


def test_prefill_pool_dying_during_the_decode_reserve_waits_for_its_restart():
    async def go():
        router, prefill, [decode] = make_router(reserve_with_add=False, unavailable_grace_s=5.0)

        async def prefill_dies(task):  # the prefill actor dies while decode reserves
            if task.leg_id.endswith("#1"):
                router.pump.mark_dead(prefill)

        async def serve(task):
            serve_leg(prefill, decode, task.leg_id)

        decode.actor.on_reserve, prefill.handle.on_add = prefill_dies, serve
        return await _serve_and_stop(router), router, prefill, decode

    toks, router, prefill, decode = asyncio.run(go())
    assert toks == [7, 8]
    assert prefill.restarts == 1 and prefill.alive  # re-adopted by the event pump
    first, second = decode.actor.calls_of("reserve")
    assert first.endswith("#1") and second.endswith("#2")
    assert ("abort", first) in decode.actor.calls  # the first leg's reservation released
    assert prefill.actor.calls_of("add") == [second]
    assert_router_clean(router, prefill, [decode])


def test_prefill_dying_under_add_is_redispatched_exactly_once():
    async def go():
        router, prefill, [decode] = make_router(unavailable_grace_s=5.0)

        async def add(task):
            if task.leg_id.endswith("#1"):
                raise RuntimeError("simulated: the actor died under add()")
            serve_leg(prefill, decode, task.leg_id)

        prefill.handle.on_add = add
        return await _serve_and_stop(router), router, prefill, decode

    toks, router, prefill, decode = asyncio.run(go())
    assert toks == [7, 8]
    first, second = decode.actor.calls_of("reserve")
    assert first.startswith("r#") and first.endswith("#1") and second.endswith("#2")
    assert not router.legs and not prefill.legs and not decode.legs
    assert prefill.outstanding_tokens == 0


def test_decode_hears_keepalives_while_the_prefill_is_queued_and_not_after_it_ended():
    async def go():
        router, prefill, [decode] = make_router(kv_keepalive_s=0.05)
        release = asyncio.Event()

        async def add(task):  # queued at the prefill worker until released
            async def later():
                await release.wait()
                serve_leg(prefill, decode, task.leg_id)
            asyncio.ensure_future(later())

        prefill.handle.on_add = add
        run = asyncio.ensure_future(collect(router.generate(SPEC)))
        await until(lambda: len(decode.actor.calls_of("keepalive")) >= 3, "3 keepalives")
        kept = decode.actor.calls_of("keepalive")
        release.set()
        toks = await asyncio.wait_for(run, 10)
        n = len(decode.actor.calls_of("keepalive"))
        await asyncio.sleep(0.3)  # the leg ended: no more keepalives for it
        after = len(decode.actor.calls_of("keepalive"))
        await router.shutdown(0)
        return toks, kept, n, after

    toks, kept, n, after = asyncio.run(go())
    assert toks == [7, 8]
    assert all(c == kept[0] for c in kept)
    assert kept[0][0].startswith("r#") and kept[0][0].endswith("#1")
    assert after == n


@pytest.mark.parametrize("ending", ["abort", "deadline", "shutdown", "client-gone"])
def test_a_request_ended_while_its_reservation_is_in_flight_frees_it_and_never_prefills(
        ending):
    """Abort RPC, deadline and drain during admission: the reserve that lands afterwards
    is undone at once and no prefill starts."""
    async def go():
        router, prefill, [decode] = make_router(
            reserve_with_add=False, request_timeout_s=0.05 if ending == "deadline" else 600)
        in_flight, land = asyncio.Event(), asyncio.Event()

        async def slow_reserve(task):
            in_flight.set()
            await land.wait()

        decode.handle.on_reserve = slow_reserve
        run = asyncio.ensure_future(collect(router.generate(SPEC)))
        await in_flight.wait()
        flight = router.flights["r"]
        if ending == "abort":
            assert await router.abort("r")
        elif ending == "shutdown":
            stopping = asyncio.ensure_future(router.shutdown(0))
        elif ending == "client-gone":
            run.cancel()
        await until(lambda: flight.done, "the request ended")
        land.set()  # the reservation lands after the request ended
        with pytest.raises((RouterError, asyncio.CancelledError)) as err:
            await asyncio.wait_for(run, 10)
        [leg] = decode.actor.calls_of("reserve")
        await until(lambda: ("abort", leg) in decode.actor.calls, "the reservation undone")
        if ending == "shutdown":
            await stopping
        else:
            await router.shutdown(0)
        return err.value, router, prefill, decode

    err, router, prefill, decode = asyncio.run(go())
    if ending == "client-gone":
        assert isinstance(err, asyncio.CancelledError)
    else:
        assert err.code == {"abort": ErrorCode.CANCELLED, "shutdown": ErrorCode.UNAVAILABLE,
                            "deadline": ErrorCode.DEADLINE_EXCEEDED}[ending]
    assert prefill.actor.calls_of("add") == []  # the prefill never started
    assert_router_clean(router, prefill, [decode])


def test_a_redispatch_waiting_for_admission_does_not_hold_up_other_streams():
    """decode-0 preempts A, whose next leg waits for admission; B's tokens, reported by
    the same worker right after, still reach B."""
    async def go():
        router, prefill, [decode] = make_router(reserve_with_add=False, admission_timeout_s=30)
        admitted = asyncio.Event()  # set: re-dispatched legs may be admitted

        async def reserve(task):
            if not task.leg_id.endswith("#1"):
                await admitted.wait()

        async def add(task):
            prefill.actor.emit(EventKind.FIRST_TOKEN, task.leg_id, (7,))

        decode.actor.on_reserve, prefill.handle.on_add = reserve, add
        sp = SamplingParams(temperature=0.0, max_tokens=3)
        a = router.generate(GenerateSpec("A", (1, 2), sp))
        b = router.generate(GenerateSpec("B", (3, 4), sp))
        assert (await a.__anext__()).token_ids == (7,)
        assert (await b.__anext__()).token_ids == (7,)
        leg_a = router.flights["A"].leg_id
        leg_b = router.flights["B"].leg_id
        decode.actor.emit(EventKind.PREEMPTED, leg_a)
        decode.actor.emit(EventKind.TOKENS, leg_b, (9,))
        got = await asyncio.wait_for(b.__anext__(), 10)  # not stuck behind A's admission
        waiting = router.waiting_admission
        admitted.set()
        assert (await asyncio.wait_for(a.__anext__(), 10)).token_ids == (7,)  # A's new leg
        await b.aclose()
        await a.aclose()
        await router.shutdown(0)
        return got, waiting, router, prefill, decode

    got, waiting, router, prefill, decode = asyncio.run(go())
    assert got.token_ids == (9,) and waiting == 1
    assert_router_clean(router, prefill, [decode])


def test_a_late_reservation_on_another_worker_cannot_fail_the_leg():
    """decode-0's reserve call errors but its reservation landed; the leg goes to
    decode-1. decode-0 later fails the leg it still holds (KV wait timeout): the event
    must not touch the healthy leg on decode-1."""
    async def go():
        router, prefill, [d0, d1] = make_router(reserve_with_add=False, n_decode=2)

        async def lost_reply(task):
            d0.actor.held.add(task.leg_id)  # it landed...
            raise RuntimeError("simulated: the reply was lost")  # ...the call failed

        d0.handle.on_reserve = lost_reply
        add_seen = asyncio.Event()

        async def add(task):
            add_seen.set()

        prefill.handle.on_add = add
        run = asyncio.ensure_future(collect(router.generate(SPEC)))
        await add_seen.wait()
        leg = router.flights["r"].leg_id
        assert router.flights["r"].decode is d1
        await until(lambda: d0.alive, "decode-0 re-adopted")
        d0.actor.emit(EventKind.FAILED, leg, message="timed out waiting for KV")
        await d0.link.call("hello")  # its reply follows the event: the event was handled
        serve_leg(prefill, d1, leg)
        toks = await asyncio.wait_for(run, 10)
        await router.shutdown(0)
        return toks, leg, router, prefill, [d0, d1]

    toks, leg, router, prefill, decode = asyncio.run(go())
    assert toks == [7, 8]
    assert decode[1].actor.calls_of("reserve") == [leg]  # never re-dispatched
    assert ("abort", leg) in decode[0].actor.calls  # the stray reservation was undone
    assert_router_clean(router, prefill, decode)


def test_a_colocated_engine_prefills_the_leg_it_decodes():
    """Colocated pools (the interference baseline): admission picks the engine by KV
    usage, prompt placement by outstanding tokens; when they would differ the leg still
    goes to one engine, whose tokens are the leg's (placed apart, the stream hung)."""
    from cluster.router.router import Router, RouterConfig
    from runtime.stats import EngineStats
    from tests.scripted_workers import fake_worker

    async def go():
        c0, c1 = (fake_worker(f"colocated-{i}", "colocated") for i in range(2))
        c1.stats = EngineStats(role="colocated", kv_blocks_used=90, kv_blocks_free=10)
        c1.num_blocks = c0.num_blocks = 100
        c0.outstanding_tokens = 1000  # placement alone would put the prompt on c1
        router = Router([c0, c1], [c0, c1], RouterConfig(), tokenizer=None,
                        vocab_size=100, max_model_len=1000)

        def engine(w):
            async def add(task):  # the whole leg, as a ColocatedEngine reports it
                w.actor.emit(EventKind.FIRST_TOKEN, task.leg_id, (7,))
                w.actor.emit(EventKind.PREFILL_DONE, task.leg_id)
                w.actor.emit(EventKind.TOKENS, task.leg_id, (8,), finish_reason="length")
            return add

        for w in (c0, c1):
            w.handle.on_add = engine(w)
        toks = await asyncio.wait_for(collect(router.generate(SPEC)), 10)
        await router.shutdown(0)
        return toks, c0, c1

    toks, c0, c1 = asyncio.run(go())
    assert toks == [7, 8]
    assert [c for c in c0.actor.calls if c[0] == "add"] and not c1.actor.calls_of("add")
