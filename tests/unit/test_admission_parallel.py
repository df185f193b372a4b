"""Decode admission with several reservations in flight (cluster/router/admission.py): a waiter
behind a head that waits on a slow worker is admitted to another worker with room, and
arrival order still holds (a later waiter's grant is tentative, and given back, while an
earlier one may need that worker). States are built with held reserve calls (an
asyncio.Event per worker), never timing; each test ends with the router's leak check."""

from __future__ import annotations

import asyncio

from cluster.router.types import ErrorCode, GenerateSpec, RouterError
from engine import SamplingParams
from runtime.messages import EventKind
from tests.scripted_workers import collect, make_router, until
from tests.unit.test_router_races import assert_router_clean

SP = SamplingParams(temperature=0.0, max_tokens=2)


def spec(rid: str, n: int) -> GenerateSpec:
    return GenerateSpec(rid, tuple(range(1, n + 1)), SP)


def hold_prefills(prefill) -> None:
    """Each prefill streams its first token and hands the leg to decode, which keeps it."""
    async def add(task):
        prefill.actor.emit(EventKind.FIRST_TOKEN, task.leg_id, (7,))
        prefill.actor.emit(EventKind.PREFILL_DONE, task.leg_id)

    prefill.handle.on_add = add


def gate(worker, rid: str) -> asyncio.Event:
    """Hold `rid`'s reserve calls on `worker` until the returned event is set."""
    opened = asyncio.Event()

    async def on_reserve(task):
        if task.leg_id.startswith(f"{rid}#"):
            await opened.wait()

    worker.handle.on_reserve = on_reserve
    return opened


async def finish(router, _decode, rid: str, stream) -> list[int]:
    flight = router.flights[rid]
    flight.decode.actor.emit(EventKind.TOKENS, flight.leg_id, (8,), finish_reason="length")
    return await collect(stream)


def assert_admission_clean(router) -> None:
    assert not router.admission.core.busy and len(router.admission) == 0


def test_a_waiter_is_admitted_to_a_free_worker_while_the_head_waits_on_a_busy_one():
    async def go():
        router, prefill, decode = make_router(reserve_with_add=False, n_decode=2)
        b, a = decode  # equal usage: the head asks b first, then a
        hold_prefills(prefill)
        b.handle.budget = 5  # b has room for the small one, never for the big one
        opened = gate(a, "big")
        big = router.generate(spec("big", 8))
        big_first = asyncio.ensure_future(big.__anext__())
        await until(lambda: a.actor.calls_of("reserve"), "big waits on a's reserve")
        assert b.actor.calls_of("reserve") == [router.flights["big"].leg_id]  # refused
        small = router.generate(spec("small", 3))
        small_first = asyncio.ensure_future(small.__anext__())
        await until(small_first.done, "small admitted while big waits on a")  # (bounded)
        assert small_first.result().token_ids == (7,)
        admitted_while_held = (not opened.is_set(), router.flights["small"].decode is b,
                               not router.flights["big"].admitted)
        opened.set()
        assert (await big_first).token_ids == (7,)
        big_on = router.flights["big"].decode
        toks = [await finish(router, decode, "small", small),
                await finish(router, decode, "big", big)]
        await router.shutdown(0)
        return admitted_while_held, big_on, toks, router, prefill, decode

    held, big_on, toks, router, prefill, decode = asyncio.run(go())
    assert held == (True, True, True)
    assert big_on is decode[1] and toks == [[8], [8]]
    assert_admission_clean(router)
    assert_router_clean(router, prefill, decode)


def test_a_later_waiters_tentative_grant_is_given_back_when_the_head_needs_that_worker():
    async def go():
        router, prefill, decode = make_router(reserve_with_add=False, n_decode=2)
        a, b = decode  # the head asks a first (held), the next waiter asks b meanwhile
        hold_prefills(prefill)
        b.handle.budget = 8  # room for either one, not both
        opened = gate(a, "head")
        head = router.generate(spec("head", 6))
        head_first = asyncio.ensure_future(head.__anext__())
        await until(lambda: a.actor.calls_of("reserve"), "head waits on a's reserve")
        nxt = router.generate(spec("next", 2))
        nxt_first = asyncio.ensure_future(nxt.__anext__())
        await until(lambda: b.actor.held, "next holds a tentative grant on b")
        tentative = not router.flights["next"].admitted  # head may still need b
        a.handle.slots = 0  # a refuses the head: it needs b, so next's grant goes back
        opened.set()
        assert (await head_first).token_ids == (7,)
        head_on = router.flights["head"].decode
        toks = [await finish(router, decode, "head", head)]
        a.handle.slots = None
        await nxt_first
        toks.append(await finish(router, decode, "next", nxt))
        await router.shutdown(0)
        return tentative, head_on, toks, router, prefill, decode

    tentative, head_on, toks, router, prefill, decode = asyncio.run(go())
    a, b = decode
    assert tentative and head_on is b and toks == [[8], [8]]
    head_leg = a.actor.calls_of("reserve")[0]
    on_b = [(c, leg.split("#")[0]) for c, leg in b.actor.calls if c in ("reserve", "abort")]
    # next's room on b was given back before the head asked b, and the head got it
    assert on_b[:3] == [("reserve", "next"), ("abort", "next"), ("reserve", "head")], on_b
    assert head_leg.startswith("head#")
    assert_admission_clean(router)
    assert_router_clean(router, prefill, decode)


def test_waiters_that_leave_while_their_reservation_is_in_flight_or_tentative_leak_nothing():
    async def go():
        router, prefill, decode = make_router(reserve_with_add=False, n_decode=2)
        a, b = decode
        hold_prefills(prefill)
        opened = gate(a, "head")
        head = router.generate(spec("head", 3))
        head_first = asyncio.ensure_future(head.__anext__())
        await until(lambda: a.actor.calls_of("reserve"), "head's reserve held on a")
        nxt = router.generate(spec("next", 3))
        nxt_first = asyncio.ensure_future(nxt.__anext__())
        await until(lambda: b.actor.held, "next holds a tentative grant on b")
        assert await router.abort("next")  # tentative grant: released on b
        assert await router.abort("head")  # reserve in flight: released once it lands
        opened.set()
        errors = []
        for first in (head_first, nxt_first):
            try:
                await first
            except RouterError as e:
                errors.append(e.code)
        await until(lambda: not a.actor.held and not b.actor.held, "reservations released")
        await router.shutdown(0)
        return errors, router, prefill, decode

    errors, router, prefill, decode = asyncio.run(go())
    a, b = decode
    assert errors == [ErrorCode.CANCELLED] * 2
    assert ("abort", b.actor.calls_of("reserve")[0]) in b.actor.calls
    assert ("abort", a.actor.calls_of("reserve")[0]) in a.actor.calls
    assert prefill.actor.calls_of("add") == []  # neither was dispatched
    assert_admission_clean(router)
    assert_router_clean(router, prefill, decode)


def test_a_waiter_refused_everywhere_blocks_later_ones_from_asking():
    """Two workers, each with room for small requests only while big waits: nothing
    behind big asks until big is admitted (it would otherwise starve)."""
    async def go():
        router, prefill, decode = make_router(n_decode=2)
        hold_prefills(prefill)
        for w in decode:
            w.handle.budget = 10
        holders = []
        for i in range(len(decode)):  # 6 of 10 used on each worker
            s = router.generate(spec(f"h{i}", 6))
            await s.__anext__()
            holders.append((f"h{i}", s))
        big = router.generate(spec("big", 8))
        big_first = asyncio.ensure_future(big.__anext__())
        await until(lambda: len(router.admission) == 1 and router.admission.core.waiters[0].blocked,
                    "big refused by both")
        small = router.generate(spec("small", 3))
        small_first = asyncio.ensure_future(small.__anext__())
        await until(lambda: router.waiting_admission == 2, "small queued behind big")
        asked_early = [leg for w in decode for leg in w.actor.calls_of("reserve")
                       if leg.startswith("small#")]
        toks = [await finish(router, decode, *holders[0])]
        await big_first
        toks.append(await finish(router, decode, "big", big))
        await small_first
        toks += [await finish(router, decode, "small", small),
                 await finish(router, decode, *holders[1])]
        await router.shutdown(0)
        return asked_early, toks, router, prefill, decode

    asked_early, toks, router, prefill, decode = asyncio.run(go())
    assert asked_early == [] and toks == [[8]] * 4
    assert_admission_clean(router)
    assert_router_clean(router, prefill, decode)
