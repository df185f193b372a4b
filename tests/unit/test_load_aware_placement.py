"""Placement on the load every worker's step message carries (what makes several front
doors place well: each sees the load the others put on a worker, not just its own)."""

from __future__ import annotations

import asyncio

from cluster.router.pool import WorkerHandle
from cluster.router.types import GenerateSpec
from engine import SamplingParams
from runtime.messages import WorkerInfo, WorkerLoad
from tests.scripted_workers import collect, make_router, serve_leg
from tests.unit.test_router_races import assert_router_clean


def test_decode_admission_asks_the_worker_with_most_unpromised_blocks_first():
    async def go():
        router, prefill, decode = make_router(n_decode=2)
        # another front door's reservations fill decode-0: its load says so
        decode[0].observe_load(WorkerLoad(kv_blocks_used=10, kv_blocks_promisable=5))
        decode[1].observe_load(WorkerLoad(kv_blocks_used=10, kv_blocks_promisable=80))

        async def serve(task):
            serve_leg(prefill, decode[1], task.leg_id)

        prefill.handle.on_add = serve
        spec = GenerateSpec("r", (1, 2, 3), SamplingParams(temperature=0.0, max_tokens=2))
        toks = await asyncio.wait_for(collect(router.generate(spec)), 10)
        await router.shutdown(0)
        return toks, router, prefill, decode

    toks, router, prefill, decode = asyncio.run(go())
    assert toks == [7, 8]
    assert decode[1].actor.calls_of("reserve") and not decode[0].actor.calls_of("reserve")
    assert_router_clean(router, prefill, decode)


def test_prefill_load_counts_what_other_front_doors_queued():
    w = WorkerHandle("p", "prefill", actor=None)
    w.refresh(WorkerInfo("p", "prefill", num_blocks=10, block_size=16))
    w.outstanding_tokens = 100  # this front door's own legs
    w.observe_load(WorkerLoad(outstanding_tokens=700))  # the worker holds 700 in all
    assert w.prefill_load == 700
    w.outstanding_tokens = 40  # ours finished meanwhile; the others' share stays
    assert w.prefill_load == 640
    d = WorkerHandle("d", "decode", actor=None)
    d.refresh(WorkerInfo("d", "decode", num_blocks=100, block_size=16))
    assert d.kv_usage == 0.0
    d.observe_load(WorkerLoad(kv_blocks_used=10, kv_blocks_promisable=30))
    assert d.kv_usage == 0.7  # used or promised
