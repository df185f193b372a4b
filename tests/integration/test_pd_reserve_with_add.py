"""Reserve and add sent together, through the real service (Ray actors, tcp KV links,
control channels): a leg whose reserve is refused (by construction: a refuse_admission
fault on every request's first leg) is aborted on its prefill worker and served exactly
by the next leg; aborts right after dispatch (reserve and add in flight) and after the
first token free both workers; a tight decode pool under concurrent load refuses
reserves for real and still serves every request exactly. Ends with a leak check: no
blocks used, no queue, nothing held for unreserved legs on any decode worker."""

from __future__ import annotations

import asyncio

import torch

from cluster.launch.launcher import LaunchOptions
from cluster.router.types import ErrorCode, GenerateSpec, RouterError
from engine import LLM, SamplingParams
from tests.integration.test_pd_router import _outcome, assert_quiescent

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 2000, (int(k),), generator=g).tolist()
            for k in torch.randint(5, 40, (n,), generator=g)]


def _decode_figures(runner) -> list[dict]:
    return [w.extra for w in runner.stats().workers if w.role == "decode"]


def test_refused_and_aborted_legs_with_reserve_sent_with_add_leak_nothing(start_router,
                                                                          tiny_model):
    plan = {"seed": 1,
            "faults": [{"kind": "refuse_admission", "request_filter": r"^refuse-.*#1$"}]}
    runner = start_router({"transfer": {"connector": "tcp"},
                           "cache": {"num_blocks": 12, "block_size": 16},
                           "scheduler": {"max_prefill_chunk": 16}},
                          LaunchOptions(fault_injection=plan))
    router = runner.router
    assert router.config.reserve_with_add
    ps = prompts(10, seed=3)
    reference = [o.token_ids for o in LLM(str(tiny_model), block_size=16).generate(ps, GREEDY)]

    # 1. every first leg refused while its prefill runs: the next leg serves it exactly
    for i in range(3):
        toks, last = runner.generate(GenerateSpec(f"refuse-{i}", tuple(ps[i]), GREEDY))
        assert not isinstance(last, RouterError), last
        assert toks == reference[i]
    refused = sum(f.get("kv_reserves_refused", 0) for f in _decode_figures(runner))
    assert refused >= 3

    # 2. aborts: right after dispatch (reserve and add in flight), and after a token
    async def aborted(rid: str, after_first: bool):
        task = asyncio.ensure_future(_outcome(router.generate(
            GenerateSpec(rid, tuple(ps[3]), LONG))))
        while not (router.flights.get(rid) and router.flights[rid].prefill is not None
                   and (not after_first or router.flights[rid].generated)):
            assert not task.done(), task
            await asyncio.sleep(0.001)
        assert await router.abort(rid)
        return await asyncio.wait_for(task, 60)

    for rid, after_first in (("abort-at-dispatch", False), ("abort-after-first", True)):
        toks, err = runner.run(aborted(rid, after_first))
        assert isinstance(err, RouterError) and err.code == ErrorCode.CANCELLED, err
        assert len(toks) < LONG.max_tokens
    assert_quiescent(runner)

    # 3. a tight pool (12 blocks: ~2 legs at a time) under 7 concurrent requests
    results = runner.generate_many([GenerateSpec(f"tight-{i}", tuple(p), GREEDY)
                                    for i, p in enumerate(ps[3:], start=3)])
    for (toks, last), ref in zip(results, reference[3:], strict=True):
        assert not isinstance(last, RouterError), last
        assert toks == ref
    assert_quiescent(runner)
    for f in _decode_figures(runner):
        assert f.get("kv_early_held_chunks", 0) == 0 and f.get("kv_early_held_bytes", 0) == 0
    assert not router.legs and router.waiting_admission == 0
    assert all(w.outstanding_tokens == 0 and not w.legs for w in router.workers)
    runner.close()


def test_pipelined_reserves_serve_a_burst_on_a_tight_pool_exactly(start_router, tiny_model):
    """pools.pipelined_reserves: a burst's reserves go out together (the worker's last load,
    less the reserves in flight, says whether one fits); on a tight pool (12 blocks) some are
    refused for real and queue for admission. Every request is served exactly; nothing
    leaks, and every reserve sent with an add was answered."""
    runner = start_router({"transfer": {"connector": "tcp"},
                           "cache": {"num_blocks": 12, "block_size": 16},
                           "scheduler": {"max_prefill_chunk": 16},
                           "pools": {"pipelined_reserves": True}})
    router = runner.router
    assert router.config.reserve_with_add and router.config.pipelined_reserves
    ps = prompts(12, seed=5)
    reference = [o.token_ids for o in LLM(str(tiny_model), block_size=16).generate(ps, GREEDY)]
    results = runner.generate_many([GenerateSpec(f"burst-{i}", tuple(p), GREEDY)
                                    for i, p in enumerate(ps)])
    for (toks, last), ref in zip(results, reference, strict=True):
        assert not isinstance(last, RouterError), last
        assert toks == ref
    assert not router._reserving
    assert_quiescent(runner)
    for f in _decode_figures(runner):
        assert f.get("kv_early_held_chunks", 0) == 0 and f.get("kv_early_held_bytes", 0) == 0
