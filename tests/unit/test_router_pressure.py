"""The router at capacity, with scripted fake workers (tests/scripted_workers.py): request-id
reuse after every way a request can end, decode admission in arrival order until the
deadline, preemption storms. States (full pool, reused id) are built on purpose."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from cluster.router.types import ErrorCode, GenerateSpec, RouterError
from engine import SamplingParams
from runtime.messages import EventKind
from tests.scripted_workers import collect, make_router, serve_leg, until
from tests.unit.test_router_races import assert_router_clean

SP = SamplingParams(temperature=0.0, max_tokens=2)


def spec(rid: str, n: int = 3, sp: SamplingParams = SP) -> GenerateSpec:
    return GenerateSpec(rid, tuple(range(1, n + 1)), sp)


def script(router, prefill, actions: list[str]) -> None:
    """The prefill worker's answer to each `add`, in order:
    serve (to the end), hold (first token; decode keeps it), hang (nothing),
    eos (the first token ends the request), fail (decode fails the leg)."""
    def decode_of(leg):
        return router.legs[leg].decode

    async def add(task):
        leg, action = task.leg_id, actions.pop(0)
        if action == "serve":
            serve_leg(prefill, decode_of(leg), leg)
        elif action == "hold":
            prefill.actor.emit(EventKind.FIRST_TOKEN, leg, (7,))
            prefill.actor.emit(EventKind.PREFILL_DONE, leg)
        elif action == "eos":
            prefill.actor.emit(EventKind.FIRST_TOKEN, leg, (2,), finish_reason="stop")
        elif action == "fail":
            decode_of(leg).actor.emit(EventKind.FAILED, leg, message="scripted failure")

    prefill.handle.on_add = add


def finish(decode, leg: str) -> None:
    decode.actor.emit(EventKind.TOKENS, leg, (8,), finish_reason="length")


# ---- request-id reuse ---------------------------------------------------------------
def test_a_finished_leg_is_not_aborted_on_either_worker():
    async def go():
        router, prefill, [decode] = make_router()
        script(router, prefill, ["serve", "eos"])
        assert await collect(router.generate(spec("a"))) == [7, 8]
        assert await collect(router.generate(spec("b"))) == [2]
        await router.shutdown(0)
        return router, prefill, decode

    router, prefill, decode = asyncio.run(go())
    a, b = decode.actor.calls_of("reserve")
    assert prefill.actor.calls_of("abort") == []  # both prefills ended by themselves
    # decode finished "a" itself; "b" ended at its first token: its reservation is undone
    assert decode.actor.calls_of("abort") == [b]
    assert not prefill.actor.tombstones and not decode.actor.tombstones
    assert_router_clean(router, prefill, [decode])


ENDINGS = ["finished", "first-token-eos", "aborted", "deadline", "failed", "client-gone",
           "never-admitted"]


@pytest.mark.parametrize("ending", ENDINGS)
def test_a_request_id_is_free_the_moment_its_request_ends(ending):
    """The same id again, right after the first request's last delta or error (the first
    stream not even closed): it gets served on new legs."""
    async def go():
        router, prefill, [decode] = make_router(reserve_with_add=False, max_legs=1)
        first_action = {"finished": "serve", "first-token-eos": "eos", "failed": "fail"}.get(
            ending, "hang")
        script(router, prefill, ["serve"] if ending == "never-admitted" else
               [first_action, "serve"])
        if ending == "deadline":
            router.config = replace(router.config, request_timeout_s=0.01)
        if ending == "never-admitted":
            decode.handle.slots = 0
        first = router.generate(spec("same"))
        outcome = None
        try:
            if ending in ("aborted", "client-gone", "never-admitted"):
                pending = asyncio.ensure_future(first.__anext__())
                if ending == "never-admitted":  # aborted while queued for a full pool
                    await until(lambda: decode.actor.calls_of("reserve"), "queued")
                else:  # ended mid-prefill
                    await until(lambda: prefill.actor.calls_of("add"), "prefill started")
                if ending == "client-gone":
                    pending.cancel()  # the consumer went away mid-request
                else:
                    assert await router.abort("same")
                try:
                    await pending
                except (RouterError, asyncio.CancelledError) as e:
                    outcome = e
            else:
                async for d in first:
                    outcome = d
                    if d.finished:
                        break  # the last delta: the stream itself is still open
        except RouterError as e:
            outcome = e
        router.config = replace(router.config, request_timeout_s=600)
        decode.handle.slots = None
        second = await asyncio.wait_for(collect(router.generate(spec("same"))), 10)
        await first.aclose()
        await router.shutdown(0)
        return outcome, second, router, prefill, decode

    outcome, second, router, prefill, decode = asyncio.run(go())
    want = {"finished": "length", "first-token-eos": "stop", "aborted": ErrorCode.CANCELLED,
            "deadline": ErrorCode.DEADLINE_EXCEEDED, "failed": ErrorCode.UNAVAILABLE,
            "never-admitted": ErrorCode.CANCELLED}.get(ending)
    if isinstance(outcome, RouterError):
        assert outcome.code == want, outcome
    elif ending != "client-gone":
        assert outcome.finish_reason == want
    assert second == [7, 8]
    legs = decode.actor.calls_of("reserve")
    assert len(set(legs)) == len(legs)  # every dispatch had its own leg id
    assert_router_clean(router, prefill, [decode])


def test_an_id_in_flight_is_refused_and_the_first_request_is_untouched():
    async def go():
        router, prefill, [decode] = make_router()
        script(router, prefill, ["hold"])
        first = router.generate(spec("dup"))
        assert (await first.__anext__()).token_ids == (7,)
        with pytest.raises(RouterError) as err:
            await router.generate(spec("dup")).__anext__()
        finish(decode, router.flights["dup"].leg_id)
        rest = await collect(first)
        await router.shutdown(0)
        return err.value, rest, router, prefill, decode

    err, rest, router, prefill, decode = asyncio.run(go())
    assert err.code == ErrorCode.ALREADY_EXISTS and rest == [8]
    assert_router_clean(router, prefill, [decode])


# ---- admission under a full decode pool ---------------------------------------------
def test_queued_requests_are_admitted_in_arrival_order_and_no_later_one_asks_first():
    async def go():
        router, prefill, [decode] = make_router(reserve_with_add=False, decode_slots=1)
        script(router, prefill, ["hold", "hold", "hold"])
        streams = {rid: router.generate(spec(rid)) for rid in "ABC"}
        firsts = {rid: asyncio.ensure_future(s.__anext__()) for rid, s in streams.items()}
        await firsts["A"]
        await until(lambda: router.waiting_admission == 2, "B and C queued")
        for rid in "BC":
            assert not firsts[rid].done()
        order = []
        for rid in "ABC":  # finish the one holding the slot; the next in line gets it
            await firsts[rid]
            order.append(rid)
            finish(decode, router.flights[rid].leg_id)
            assert await collect(streams[rid]) == [8]
        await router.shutdown(0)
        return order, router, prefill, decode

    order, router, prefill, decode = asyncio.run(go())
    assert order == ["A", "B", "C"]
    asked = [leg.split("#")[0] for leg in decode.actor.calls_of("reserve")]
    # C never asked for room while B (earlier) was still waiting
    assert asked.index("C") > len(asked) - 1 - asked[::-1].index("B")
    assert_router_clean(router, prefill, [decode])


def test_a_small_later_arrival_does_not_overtake_a_large_waiter():
    async def go():
        router, prefill, [decode] = make_router(reserve_with_add=False)
        decode.handle.budget = 10  # prompt tokens the decode worker can hold
        script(router, prefill, ["hold", "hold", "hold"])
        big_first = router.generate(spec("holder", 6))
        assert (await big_first.__anext__()).token_ids == (7,)
        large = router.generate(spec("large", 8))
        large_first = asyncio.ensure_future(large.__anext__())
        await until(lambda: router.waiting_admission == 1, "large queued")
        small = router.generate(spec("small", 3))  # 6 + 3 fits now, but large came first
        small_first = asyncio.ensure_future(small.__anext__())
        await until(lambda: router.waiting_admission == 2, "small queued behind large")
        finish(decode, router.flights["holder"].leg_id)
        await collect(big_first)
        await large_first
        overtaken = small_first.done()
        finish(decode, router.flights["large"].leg_id)
        await collect(large)
        await small_first
        finish(decode, router.flights["small"].leg_id)
        await collect(small)
        await router.shutdown(0)
        return overtaken, router, prefill, decode

    overtaken, router, prefill, decode = asyncio.run(go())
    assert not overtaken
    assert_router_clean(router, prefill, [decode])


def test_a_queued_request_waits_until_its_deadline_not_an_admission_timeout():
    async def go():
        router, prefill, [decode] = make_router(decode_slots=1)
        script(router, prefill, ["hold", "serve"])
        holder = router.generate(spec("holder"))
        await holder.__anext__()
        router.config = replace(router.config, request_timeout_s=0.05)
        with pytest.raises(RouterError) as err:
            await asyncio.wait_for(collect(router.generate(spec("late"))), 10)
        finish(decode, router.flights["holder"].leg_id)
        await collect(holder)
        await router.shutdown(0)
        return err.value, router, prefill, decode

    err, router, prefill, decode = asyncio.run(go())
    assert err.code == ErrorCode.DEADLINE_EXCEEDED, err
    assert_router_clean(router, prefill, [decode])


def test_a_full_queue_and_a_prompt_that_can_never_fit_are_answered_at_once():
    async def go():
        router, prefill, [decode] = make_router(reserve_with_add=False, decode_slots=1, block_size=1,
                                                max_queue_len=1)
        script(router, prefill, ["hold", "hold"])
        holder = router.generate(spec("holder"))
        await holder.__anext__()
        waiter = router.generate(spec("waiter"))
        waiting = asyncio.ensure_future(waiter.__anext__())
        await until(lambda: router.waiting_admission == 1, "waiter queued")
        errors = []
        for rid, n in (("overflow", 3), ("huge", 150)):
            router.config = replace(router.config, max_queue_len=1 if rid == "overflow" else 9)
            with pytest.raises(RouterError) as err:
                await router.generate(spec(rid, n)).__anext__()
            errors.append(err.value)
        finish(decode, router.flights["holder"].leg_id)
        await collect(holder)
        await waiting
        finish(decode, router.flights["waiter"].leg_id)
        await collect(waiter)
        await router.shutdown(0)
        return errors, router, prefill, decode

    errors, router, prefill, decode = asyncio.run(go())
    assert [e.code for e in errors] == [ErrorCode.RESOURCE_EXHAUSTED] * 2
    assert "queue is full" in errors[0].message and "cannot fit" in errors[1].message
    assert_router_clean(router, prefill, [decode])


# ---- preemption is not failure ------------------------------------------------------
def test_a_request_preempted_more_often_than_max_legs_is_still_served():
    async def go():
        router, prefill, [decode] = make_router(max_legs=2)
        n_preempt = 5

        async def add(task):
            prefill.actor.emit(EventKind.FIRST_TOKEN, task.leg_id, (7,))
            prefill.actor.emit(EventKind.PREFILL_DONE, task.leg_id)

        prefill.handle.on_add = add
        stream = router.generate(spec("storm", sp=SamplingParams(max_tokens=20)))
        toks = []
        async for d in stream:
            toks += d.token_ids
            if d.finished:
                break
            leg = router.flights["storm"].leg_id
            if len(toks) <= n_preempt:
                decode.actor.emit(EventKind.PREEMPTED, leg, message="out of KV blocks")
            else:
                finish(decode, leg)
        await router.shutdown(0)
        return toks, router, prefill, decode

    toks, router, prefill, decode = asyncio.run(go())
    assert toks == [7] * 6 + [8]
    assert len(decode.actor.calls_of("reserve")) == 6
    assert decode.actor.calls_of("abort") == []  # it let go of each preempted leg itself
    assert not decode.actor.tombstones
    assert_router_clean(router, prefill, [decode])


def test_preemptions_that_make_no_progress_count_as_failures():
    async def go():
        router, prefill, [decode] = make_router(max_legs=3)

        async def add(task):  # decode preempts each leg before its first token
            decode.actor.emit(EventKind.PREEMPTED, task.leg_id, message="out of KV blocks")

        prefill.handle.on_add = add
        with pytest.raises(RouterError) as err:
            await asyncio.wait_for(collect(router.generate(spec("stuck"))), 10)
        await router.shutdown(0)
        return err.value, router, prefill, decode

    err, router, prefill, decode = asyncio.run(go())
    assert err.code == ErrorCode.UNAVAILABLE and "gave up after 3 attempts" in err.message
    assert_router_clean(router, prefill, [decode])


def test_prefix_affinity_remembers_a_bounded_number_of_first_blocks():
    from cluster.router.policies import PrefillLoad, PrefixAffinity

    a, b = PrefillLoad("p0", 0), PrefillLoad("p1", 0)
    aff = PrefixAffinity(block_size=2, slack_tokens=10, capacity=3)
    assert aff.pick([a, b], (1, 2, 3)) == "p0"
    a = PrefillLoad("p0", 5)  # busier, within the slack: the same first block sticks
    assert aff.pick([a, b], (1, 2, 9)) == "p0"
    for i in range(10):  # clients' prompts cannot grow the map past its capacity
        aff.pick([a, b], (100 + i, 7, 7))
    assert len(aff) == 3
    assert aff.pick([a, b], (1, 2, 3)) == "p1"  # forgotten: the least loaded wins


def test_the_router_places_prefills_by_the_configured_policy_of_the_registry():
    """RouterConfig.placement names a cluster/router/policies.py policy (the simulator's
    too); unset, the router does what it always did: prefix affinity with prefix caching."""
    from cluster.router.flight import RouterConfig
    from cluster.router.policies import LeastOutstanding, LengthBuckets, PrefixAffinity
    from cluster.router.pool import WorkerHandle
    from cluster.router.router import Router

    assert isinstance(RouterConfig().make_placement(), PrefixAffinity)
    assert isinstance(RouterConfig(prefix_affinity=False).make_placement(), LeastOutstanding)
    with pytest.raises(ValueError, match="unknown prefill placement 'nearest'"):
        RouterConfig(placement="nearest")
    ws = [WorkerHandle(f"p{i}", "prefill", None) for i in range(4)]
    router = Router(ws, [], RouterConfig(placement="length-buckets", length_buckets=(100,)),
                    None, 1000, 2048)
    assert isinstance(router._placement, LengthBuckets)
    short, long = router._pick_prefill((1,) * 50), router._pick_prefill((1,) * 500)
    assert short is ws[0] and long is ws[2]  # two buckets: p0-p1 short, p2-p3 long
