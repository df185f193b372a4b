"""Router races with scripted fake worker actors (the real pools run in
tests/integration): a pool dying while a request is being dispatched."""

from __future__ import annotations

import asyncio

from cluster.pool import WorkerHandle
from cluster.router import Router, RouterConfig
from cluster.types import GenerateSpec
from engine import SamplingParams
from engine.messages import FIRST_TOKEN, PREFILL_DONE, TOKENS, WorkerEvent


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return asyncio.ensure_future(self.fn(*args))  # runs even if nobody awaits, like Ray


class FakeActor:
    """Answers like a worker actor; `on_reserve` / `on_add` script the races."""

    def __init__(self, worker_id: str):
        self.worker_id = worker_id
        self.events: asyncio.Queue = asyncio.Queue()
        self.calls: list[tuple[str, str]] = []
        self.on_reserve = self.on_add = None

    def __getattr__(self, name):
        return _Method(getattr(self, f"_{name}"))

    async def _ready(self):
        return {"endpoint": f"fake://{self.worker_id}", "num_blocks": 100}

    async def _poll(self, timeout):
        try:
            return [await asyncio.wait_for(self.events.get(), timeout)]
        except TimeoutError:
            return []

    async def _reserve(self, task):
        self.calls.append(("reserve", task.request_id))
        if self.on_reserve:
            await self.on_reserve(task)
        return True

    async def _add(self, task):
        self.calls.append(("add", task.request_id))
        if self.on_add:
            await self.on_add(task)

    async def _keepalive(self, request_ids):
        self.calls.append(("keepalive", tuple(request_ids)))
        return len(request_ids)

    async def _abort(self, request_id):
        self.calls.append(("abort", request_id))
        return True

    async def _stats(self):
        return {}


def _router(**cfg):
    prefill = WorkerHandle("prefill-0", "prefill", FakeActor("prefill-0"))
    decode = WorkerHandle("decode-0", "decode", FakeActor("decode-0"))
    router = Router([prefill], [decode], RouterConfig(**cfg), tokenizer=None,
                    vocab_size=100, max_model_len=64)
    return router, prefill, decode


def _serve_leg(prefill: WorkerHandle, decode: WorkerHandle, leg_id: str) -> None:
    """What the two workers report for a served leg: first token, prefill done, 1 token."""
    prefill.actor.events.put_nowait(WorkerEvent(FIRST_TOKEN, leg_id, "prefill-0", (7,)))
    prefill.actor.events.put_nowait(WorkerEvent(PREFILL_DONE, leg_id, "prefill-0"))
    decode.actor.events.put_nowait(WorkerEvent(TOKENS, leg_id, "decode-0", (8,),
                                               finish_reason="length"))


def legs(actor, call: str) -> list[str]:
    """The leg ids `actor` got `call` for, in order."""
    return [rid for name, rid in actor.calls if name == call]


async def _collect(router, spec):
    return [t for d in [d async for d in router.generate(spec)] for t in d.token_ids]


SPEC = GenerateSpec("r", (1, 2, 3), SamplingParams(temperature=0.0, max_tokens=2))


async def _serve_and_stop(router) -> list[int]:
    """Stream SPEC to its end (bounded), then shut the router down."""
    toks = await asyncio.wait_for(_collect(router, SPEC), 10)
    await router.shutdown(0)
    return toks


def test_prefill_pool_dying_during_the_decode_reserve_waits_for_its_restart():
    async def go():
        router, prefill, decode = _router(unavailable_grace_s=5.0)

        async def prefill_dies(task):  # the prefill actor dies while decode reserves
            if task.request_id.endswith("#1"):
                router.pump.mark_dead(prefill)

        async def serve(task):
            _serve_leg(prefill, decode, task.request_id)

        decode.actor.on_reserve, prefill.actor.on_add = prefill_dies, serve
        return await _serve_and_stop(router), router, prefill, decode

    toks, router, prefill, decode = asyncio.run(go())
    assert toks == [7, 8]
    assert prefill.restarts == 1 and prefill.alive  # re-adopted by the event pump
    first, second = legs(decode.actor, "reserve")
    assert first.endswith("#1") and second.endswith("#2")
    assert ("abort", first) in decode.actor.calls  # the first leg's reservation released
    assert legs(prefill.actor, "add") == [second]
    assert not router.flights and not router.legs
    assert not prefill.legs and not decode.legs and prefill.outstanding_tokens == 0


def test_prefill_dying_under_add_is_redispatched_exactly_once():
    async def go():
        router, prefill, decode = _router(unavailable_grace_s=5.0)

        async def add(task):
            if task.request_id.endswith("#1"):
                raise RuntimeError("simulated: the actor died under add()")
            _serve_leg(prefill, decode, task.request_id)

        prefill.actor.on_add = add
        return await _serve_and_stop(router), router, prefill, decode

    toks, router, prefill, decode = asyncio.run(go())
    assert toks == [7, 8]
    first, second = legs(decode.actor, "reserve")
    assert first.startswith("r#") and first.endswith("#1") and second.endswith("#2")
    assert not router.legs and not prefill.legs and not decode.legs
    assert prefill.outstanding_tokens == 0


def test_decode_hears_keepalives_while_the_prefill_is_queued_and_not_after_it_ended():
    async def go():
        router, prefill, decode = _router(kv_keepalive_s=0.05)
        release = asyncio.Event()

        async def add(task):  # queued at the prefill worker until released
            async def later():
                await release.wait()
                _serve_leg(prefill, decode, task.request_id)
            asyncio.ensure_future(later())

        prefill.actor.on_add = add
        run = asyncio.ensure_future(_collect(router, SPEC))
        await asyncio.sleep(0.4)
        kept = [c for c in decode.actor.calls if c[0] == "keepalive"]
        release.set()
        toks = await asyncio.wait_for(run, 10)
        n = len([c for c in decode.actor.calls if c[0] == "keepalive"])
        await asyncio.sleep(0.3)  # the leg ended: no more keepalives for it
        after = len([c for c in decode.actor.calls if c[0] == "keepalive"])
        await router.shutdown(0)
        return toks, kept, n, after

    toks, kept, n, after = asyncio.run(go())
    assert toks == [7, 8]
    assert len(kept) >= 3 and all(c == kept[0] for c in kept)
    assert kept[0][1][0].startswith("r#") and kept[0][1][0].endswith("#1")
    assert after == n
