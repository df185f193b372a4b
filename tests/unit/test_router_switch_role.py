"""The router moves a worker between pools live (`Router.switch_role`, the planner's
move; the worker side is cluster/launch/role_worker.py, tested in
tests/integration/test_role_switch.py): the worker leaves its pool at once, its legs end
where they are, then it joins the other pool; nothing is lost or leaked, and a worker
that cannot drain or is the last of its role stays where it was. Scripted fake workers
(tests/scripted_workers.py); each test ends with the router's leak check."""

from __future__ import annotations

import asyncio

import pytest

from cluster.router.types import GenerateSpec, RouterError
from engine import SamplingParams
from runtime.messages import EventKind
from tests.scripted_workers import collect, make_router, until
from tests.unit.test_router_races import assert_router_clean


def spec(rid: str) -> GenerateSpec:
    return GenerateSpec(rid, (1, 2, 3), SamplingParams(temperature=0.0, max_tokens=2))


def hold_on_decode(prefill) -> None:
    """Each add: first token and prefill done at once; the decode worker keeps the leg
    until the test finishes it."""
    async def add(task):
        prefill.actor.emit(EventKind.FIRST_TOKEN, task.leg_id, (7,))
        prefill.actor.emit(EventKind.PREFILL_DONE, task.leg_id)
    prefill.handle.on_add = add


def test_a_decode_worker_drains_its_legs_then_joins_the_prefill_pool():
    async def go():
        router, prefill, [d0, d1] = make_router(n_decode=2)
        hold_on_decode(prefill)
        d0.handle.slots = 0  # the first request lands on d1
        first = asyncio.ensure_future(collect(router.generate(spec("a"))))
        await until(lambda: d1.legs and d1.actor.held, "a held on d1")
        leg_a = next(iter(d1.legs))
        d0.handle.slots = None
        switch = asyncio.ensure_future(router.switch_role("decode-1", "prefill"))
        await until(lambda: d1 in router.switching, "d1 leaves the decode pool")
        assert d1 not in router.decode and d1 not in router.prefill
        second = asyncio.ensure_future(collect(router.generate(spec("b"))))
        await until(lambda: d0.actor.held, "b reserved on d0: d1 is asked no more")
        assert not switch.done()  # a is still on d1
        assert [c for c in d1.actor.calls if c[0] == "reserve"] == [("reserve", leg_a)]
        d1.actor.emit(EventKind.TOKENS, leg_a, (8,), finish_reason="length")
        took = await asyncio.wait_for(switch, 10)
        assert took >= 0 and d1 in router.prefill and d1.role == "prefill"
        assert d1.actor.calls_of("switch_role") == ["prefill"]
        assert await asyncio.wait_for(first, 10) == [7, 8]
        d0.actor.emit(EventKind.TOKENS, next(iter(d0.legs)), (8,), finish_reason="length")
        assert await asyncio.wait_for(second, 10) == [7, 8]
        await router.shutdown(0)
        return router, prefill, d0, d1

    router, prefill, d0, d1 = asyncio.run(go())
    assert not router.switching
    assert_router_clean(router, prefill, [d0])
    assert not d1.legs and not d1.actor.held


def test_the_last_worker_of_a_role_and_an_unknown_worker_are_refused():
    async def go():
        router, prefill, [decode] = make_router()
        for wid, role in (("decode-0", "prefill"), ("prefill-0", "decode"),
                          ("decode-7", "prefill"), ("decode-0", "colocated")):
            with pytest.raises(RouterError) as e:
                await router.switch_role(wid, role)
            assert wid in e.value.message or role in e.value.message
        assert await router.switch_role("decode-0", "decode") == 0.0  # already: a no-op
        assert router.decode == [decode] and router.prefill == [prefill]
        await router.shutdown(0)
        return router, prefill, decode

    router, prefill, decode = asyncio.run(go())
    assert decode.actor.calls_of("switch_role") == []
    assert_router_clean(router, prefill, [decode])


def test_a_worker_that_does_not_drain_in_time_stays_in_its_pool():
    async def go():
        router, prefill, [d0, d1] = make_router(n_decode=2)
        hold_on_decode(prefill)
        d0.handle.slots = 0
        first = asyncio.ensure_future(collect(router.generate(spec("a"))))
        await until(lambda: d1.actor.held, "a held on d1")
        with pytest.raises(RouterError) as e:
            await router.switch_role("decode-1", "prefill", drain_timeout_s=0.05)
        assert "still holds 1 leg" in e.value.message
        assert d1 in router.decode and not router.switching and d1.role == "decode"
        d1.actor.emit(EventKind.TOKENS, next(iter(d1.legs)), (8,), finish_reason="length")
        assert await asyncio.wait_for(first, 10) == [7, 8]
        await router.shutdown(0)
        return router, prefill, d0, d1

    router, prefill, d0, d1 = asyncio.run(go())
    assert d1.actor.calls_of("switch_role") == []
    assert_router_clean(router, prefill, [d0, d1])
