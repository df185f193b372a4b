"""Cancel at every phase and kill workers mid-run: every request ends with one clear
outcome, nothing leaks, and the pools keep serving."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

from cluster.router.types import ErrorCode, GenerateSpec, RouterError
from engine import LLM, SamplingParams
from tests.integration.test_pd_router import assert_quiescent

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LONG_DECODE = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)


def cancel_when(runner, spec: GenerateSpec, condition, timeout: float = 60.0) -> list[int]:
    """Stream `spec`; cancel the consuming task (a client hanging up) once
    `condition(tokens_so_far, router)` holds. Returns the tokens seen."""

    async def go():
        seen: list[int] = []

        async def consume():
            async for d in runner.router.generate(spec):
                seen.extend(d.token_ids)

        task = asyncio.ensure_future(consume())
        end = time.monotonic() + timeout
        while not condition(seen, runner.router):
            assert not task.done(), f"request finished before the phase: {task}"
            assert time.monotonic() < end, "phase never reached"
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return seen

    return runner.run(go(), timeout + 30)


def _leg_on(router, rid: str, role: str) -> bool:
    flight = router.flights.get(rid)
    w = flight and (flight.prefill if role == "prefill" else flight.decode)
    return bool(w and flight.leg_id in w.legs)


@pytest.fixture(scope="module")
def slow_link_runner(start_module_router):
    # at_end + a slow paced link: the first token arrives long before the KV does
    return start_module_router({
        "transfer": {"connector": "tcp", "send_policy": "at_end", "link_gbps": 0.004},
        "cache": {"num_blocks": 200},
        "scheduler": {"max_prefill_chunk": 16, "max_num_batched_tokens": 16},
        "limits": {"kv_wait_timeout_s": 120},
    })


def test_cancel_while_queued(slow_link_runner):
    runner = slow_link_runner
    # each hog promises ~98 of the decode worker's 200 blocks and keeps them (a long decode)
    # until the test cancels it, however fast this machine runs the tiny model
    hogs = [GenerateSpec(name, tuple(range(i + 1, 1500)), LONG_DECODE)
            for i, name in enumerate(("hog", "hog2"))]

    async def go():
        hog_task, hog2 = (asyncio.ensure_future(_drain(runner.router.generate(h))) for h in hogs)
        end = time.monotonic() + 60
        while not all(_leg_on(runner.router, h.request_id, "decode") for h in hogs):
            assert time.monotonic() < end, "the hogs were never admitted"
            await asyncio.sleep(0.01)
        queued = asyncio.ensure_future(_drain(runner.router.generate(
            GenerateSpec("queued", tuple(range(3, 1500)), GREEDY))))
        while runner.router.waiting_admission == 0:
            await asyncio.sleep(0.01)
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        for t in (hog_task, hog2):
            t.cancel()
        await asyncio.gather(hog_task, hog2, return_exceptions=True)

    runner.run(go())
    assert_quiescent(runner)


async def _drain(agen):
    out = []
    async for d in agen:
        out.extend(d.token_ids)
    return out


def test_cancel_mid_prefill(slow_link_runner):
    spec = GenerateSpec("mid-prefill", tuple(range(1, 1200)), GREEDY)
    seen = cancel_when(slow_link_runner, spec,
                       lambda toks, r: _leg_on(r, "mid-prefill", "prefill") and not toks)
    assert seen == []
    assert_quiescent(slow_link_runner)


def test_cancel_mid_transfer(slow_link_runner):
    spec = GenerateSpec("mid-transfer", tuple(range(5, 1000)), GREEDY)
    # first token seen, KV still crossing the slow link (decode has not produced anything)
    seen = cancel_when(slow_link_runner, spec, lambda toks, r: len(toks) == 1)
    assert len(seen) == 1
    assert_quiescent(slow_link_runner)


def test_cancel_while_decoding(start_router):
    runner = start_router({"transfer": {"connector": "ray"}})
    spec = GenerateSpec("decoding", tuple(range(7, 40)), LONG_DECODE)
    seen = cancel_when(runner, spec, lambda toks, r: len(toks) >= 5)
    assert 5 <= len(seen) < LONG_DECODE.max_tokens
    assert_quiescent(runner)
    # still serving, exactly
    toks, last = runner.generate(GenerateSpec("after", tuple(range(7, 40)), GREEDY))
    assert toks[: len(seen)] == seen[: GREEDY.max_tokens] and last.finish_reason == "length"
    assert_quiescent(runner)
    runner.close()


@pytest.mark.parametrize("victim", ["decode", "prefill"])
def test_worker_killed_mid_run_every_request_ends(start_router, tiny_model, victim):
    runner = start_router({"transfer": {"connector": "tcp"},
                           "scheduler": {"max_prefill_chunk": 16, "max_num_batched_tokens": 32},
                           # wait for Ray's restart even on a loaded 2-core CI machine
                           "limits": {"request_timeout_s": 140, "restart_grace_s": 100}})
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = [tuple(range(1 + i, 300 + 37 * i)) for i in range(6)]
    specs = [GenerateSpec(f"{victim}-kill-{i}", p, sp) for i, p in enumerate(prompts)]
    pool = runner.router.decode if victim == "decode" else runner.router.prefill

    async def go():
        tasks = [asyncio.ensure_future(_outcome(runner.router.generate(s))) for s in specs]
        end = time.monotonic() + 60
        while not pool[0].legs:  # kill it while it holds requests
            assert time.monotonic() < end, f"{victim}-0 never got a request"
            await asyncio.sleep(0.01)
        ray.kill(pool[0].handle, no_restart=False)  # Ray restarts it (max_restarts)
        return await asyncio.wait_for(asyncio.gather(*tasks), timeout=150)

    t0 = time.monotonic()
    outcomes = runner.run(go(), timeout=200)
    assert time.monotonic() - t0 < 150
    ref = LLM(str(tiny_model)).generate([list(p) for p in prompts], sp)
    for (toks, last), r in zip(outcomes, ref, strict=True):
        if isinstance(last, RouterError):
            assert last.code == ErrorCode.UNAVAILABLE, last
        else:
            assert last.finish_reason == "length" and toks == r.token_ids
    assert any(not isinstance(last, RouterError) for _, last in outcomes)
    # the pool recovers: the restarted worker is adopted again and serves exact tokens
    deadline = time.monotonic() + 90
    while not (all(w.alive for w in pool) and pool[0].restarts >= 1) \
            and time.monotonic() < deadline:
        time.sleep(0.5)
    assert all(w.alive for w in pool) and pool[0].restarts >= 1
    toks, last = runner.generate(GenerateSpec(f"{victim}-after", prompts[0], sp))
    assert toks == ref[0].token_ids
    assert_quiescent(runner)
    runner.close()


async def _outcome(agen):
    toks, last = [], None
    try:
        async for d in agen:
            toks.extend(d.token_ids)
            last = d
    except RouterError as e:
        return toks, e
    return toks, last
