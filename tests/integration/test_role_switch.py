"""Workers that change role live (pools.role_switch; cluster/launch/role_worker.py and
Router.switch_role), through the real service: Ray actors, tcp KV links, control
channels, the tiny model. A decode worker holding a long stream is drained (the stream
ends where it is, new requests go elsewhere), becomes a prefill worker over the same
runner (no reload) and serves prompts; then it turns back into a decode worker and
serves streams. Every output equals engine.LLM's greedy output; ends with the leak
check (no block used, no queue, no leg on any worker)."""

from __future__ import annotations

import asyncio

from cluster.router.types import GenerateSpec, RouterError
from engine import LLM, SamplingParams
from tests.integration.test_pd_reserve_with_add import prompts
from tests.integration.test_pd_router import _outcome, assert_quiescent

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)


def test_a_worker_switches_roles_live_and_every_stream_stays_exact(start_router, tiny_model):
    runner = start_router({"pools": {"decode_workers": 2, "role_switch": True,
                                     "cpus_per_worker": 0.5},
                           "transfer": {"connector": "tcp"},
                           "cache": {"block_size": 16},
                           "scheduler": {"max_prefill_chunk": 16}})
    router = runner.router
    ps = prompts(13, seed=5)
    llm = LLM(str(tiny_model), block_size=16)
    ref = [o.token_ids for o in llm.generate(ps, GREEDY)]
    ref_long = llm.generate([ps[0]], LONG)[0].token_ids

    def exact(results, refs) -> None:
        for (toks, last), r in zip(results, refs, strict=True):
            assert not isinstance(last, RouterError), last
            assert toks == r

    exact(runner.generate_many([GenerateSpec(f"a{i}", tuple(p), GREEDY)
                                for i, p in enumerate(ps[1:5], start=1)]), ref[1:5])

    async def switch_under_load():
        long = asyncio.ensure_future(_outcome(router.generate(
            GenerateSpec("long", tuple(ps[0]), LONG))))
        while not (router.flights.get("long") and router.flights["long"].generated):
            assert not long.done(), long
            await asyncio.sleep(0.005)
        holder = router.flights["long"].decode
        switch = asyncio.ensure_future(router.switch_role(holder.worker_id, "prefill"))
        while holder not in router.switching:
            await asyncio.sleep(0.001)
        others = await asyncio.gather(*(_outcome(router.generate(
            GenerateSpec(f"b{i}", tuple(ps[i]), GREEDY))) for i in range(5, 9)))
        took = await asyncio.wait_for(switch, 120)
        return holder, await long, others, took

    holder, long_out, others, took = runner.run(switch_under_load())
    assert long_out[0] == ref_long, "the drained worker's stream changed"
    exact(others, ref[5:9])
    assert holder in router.prefill and holder.role == "prefill" and took > 0
    assert len(router.prefill) == 2 and len(router.decode) == 1
    print(f"switch decode -> prefill took {took * 1e3:.1f} ms (drain included)")

    # as a prefill worker: least-outstanding placement gives it prompts of a burst
    exact(runner.generate_many([GenerateSpec(f"c{i}", tuple(p), GREEDY)
                                for i, p in enumerate(ps[9:13], start=9)]), ref[9:13])
    st = {w.worker_id: w for w in runner.stats().workers}
    assert st[holder.worker_id].role == "prefill"
    assert st[holder.worker_id].extra["kv_bytes_sent"] > 0  # it sent prompts' KV

    back = runner.run(router.switch_role(holder.worker_id, "decode"))
    assert holder in router.decode and holder.role == "decode" and back > 0
    exact(runner.generate_many([GenerateSpec(f"d{i}", tuple(p), GREEDY)
                                for i, p in enumerate(ps[1:9], start=1)]), ref[1:9])
    assert_quiescent(runner)
    assert not router.switching and not router.legs
