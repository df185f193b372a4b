"""Stateful property tests: BlockManager driven through each scheduler at tiny pools.

Hypothesis plays random sequences of reserve / add / chunk-arrives / step (fake runner
outputs, no model) / abort; preemption and finishing happen inside the steps, the way
the workers run them. After every rule: promised blocks never exceed free ones,
`check_integrity()` (refcounts equal owners, no block owned twice), progress (a step with
work and no outside input pending advances some request: no deadlock), and every block
is free once every request has ended. Each machine ends by draining what is left.
Prompts share prefixes on purpose so the prefix cache is hit, and pools of 4-12 blocks
make full pools, refused admissions and preemptions the common case.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from decode_worker.scheduler import DecodeScheduler, DecodeSchedulerConfig
from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.request import Request, RequestStatus, SamplingParams
from engine.scheduler import Scheduler
from prefill_worker.policies import FAIRNESS_POLICIES
from prefill_worker.scheduler import PrefillScheduler, PrefillSchedulerConfig
from runtime.messages import DecodeTask

S = RequestStatus
FAKE_TOKEN, STOP_TOKEN = 7, 8
SETTINGS = settings(max_examples=80, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
# the decode pool's edge (a pool promised to the last block while a request grows) is
# the hardest to reach at random: more runs there
EXAMPLES = {"PrefillPool": 150, "DecodePool": 300, "ColocatedPool": 150}
seen: Counter[str] = Counter()  # states the machines reached (checked below)
IDS = [f"id{i}" for i in range(6)]  # few names: ids are reused once their request ended


def prompt(family: int, shared: int, n: int, extra_base: int) -> list[int]:
    """`shared` tokens of prefix family `family`, then private tokens: `n` in all."""
    head = [1000 * (family + 1) + i for i in range(min(shared, n))]
    return head + [extra_base + i for i in range(n - len(head))]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=(STOP_TOKEN,))


class PoolMachine(RuleBasedStateMachine):
    """Shared checks; subclasses say how to step and what is live."""

    bm: BlockManager

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    @property
    def capacity(self) -> int:
        return self.bm.num_blocks * self.bm.block_size

    def prompt_len(self, n: int, room: int = 0) -> int:
        """A length that fits the pool (with `room` tokens to spare); 0: one too long."""
        cap = self.capacity - room
        return cap + 1 if n == 0 else 1 + (n - 1) % cap

    def next_id(self) -> str:
        self.n += 1
        return f"r{self.n}"

    def has_work(self) -> bool:
        raise NotImplementedError

    def live_ids(self) -> list[str]:
        raise NotImplementedError

    @invariant()
    def integrity(self) -> None:
        if hasattr(self, "bm"):
            self.bm.check_integrity()

    @invariant()
    def nothing_used_once_everything_ended(self) -> None:
        if hasattr(self, "bm") and not self.has_work():
            assert self.bm.num_used_blocks == 0

    def teardown(self) -> None:
        if not hasattr(self, "bm"):
            return
        for _ in range(2000):
            if not self.has_work():
                break
            self.drain_step()
        assert not self.has_work(), "work left that no step can finish"
        self.bm.check_integrity()
        assert self.bm.num_used_blocks == 0

    def drain_step(self) -> None:
        raise NotImplementedError


# ---- prefill: promises + prefix cache ------------------------------------------------
class PrefillPool(PoolMachine):
    @initialize(num_blocks=st.integers(4, 12), block_size=st.integers(1, 4),
                budget=st.integers(1, 16), max_chunk=st.integers(1, 8),
                max_seqs=st.integers(1, 4), fairness=st.sampled_from(sorted(FAIRNESS_POLICIES)))
    def setup(self, num_blocks, block_size, budget, max_chunk, max_seqs, fairness):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
        self.now = 0.0
        cfg = PrefillSchedulerConfig(max_num_batched_tokens=budget, max_prefill_chunk=max_chunk,
                                     min_chunk=1, max_num_seqs=max_seqs, fairness_policy=fairness,
                                     chunk_policy="tail-merge", tenant_weights={"b": 2.0})
        self.s = PrefillScheduler(cfg, self.bm, clock=lambda: self.now)
        self.reqs: dict[str, Request] = {}

    def has_work(self) -> bool:
        return self.s.has_work

    def live_ids(self) -> list[str]:
        return [r.request_id for r, _ in self.s.waiting] + list(self.s.active)

    @precondition(lambda self: hasattr(self, "s"))
    @rule(family=st.integers(0, 1), shared=st.integers(0, 48), n=st.integers(0, 48),
          tenant=st.sampled_from(["a", "b", "c"]), rid=st.sampled_from(IDS))
    def add(self, family, shared, n, tenant, rid):
        n = self.prompt_len(n)
        self.n += 1
        r = Request(rid, prompt(family, shared, n, 10_000 * self.n), greedy(1), tenant=tenant)
        if rid in self.live_ids():  # ids are unique among live requests only
            with pytest.raises(ValueError, match="already"):
                self.s.add(r)
            return
        if n > self.capacity:
            with pytest.raises(ValueError, match="cannot fit"):
                self.s.add(r)
            return
        self.s.add(r)
        self.reqs[rid] = r

    @precondition(lambda self: hasattr(self, "s"))
    @rule()
    def step(self):
        self.drain_step()

    def drain_step(self):
        self.now += 0.5  # aging (5 s) kicks in now and then
        had_work = self.s.has_work
        items = self.s.schedule()
        assert items or not had_work, "prefills left but none scheduled: deadlock"
        for i in items:
            r = i.request
            assert len(r.block_ids) * self.bm.block_size >= i.start + i.num_tokens
            if i.start == r.prefix_hit_tokens and r.prefix_hit_tokens:
                seen["prefill prefix hit"] += 1
        self.s.advance(items)
        for i in items:
            if i.completes_prefill:
                self.s.finish(i.request, S.RUNNING)
        if self.s.waiting and len(self.s.active) < self.s.config.max_num_seqs:
            seen["prefill admission refused (pool promised)"] += 1

    @precondition(lambda self: hasattr(self, "s") and self.s.has_work)
    @rule(pick=st.integers(0, 100))
    def abort(self, pick):
        ids = self.live_ids()
        rid = ids[pick % len(ids)]
        assert self.s.abort(rid) is self.reqs[rid]
        assert self.s.abort(rid) is None

    @invariant()
    def promises_within_free_blocks(self):
        if hasattr(self, "s"):
            assert self.s._promised_blocks() <= self.bm.num_free_blocks

    @invariant()
    def tenant_ledger_holds_live_tenants_only(self):
        if hasattr(self, "s"):
            live = {r.tenant for r, _ in self.s.waiting} | {
                r.tenant for r, _ in self.s.active.values()}
            assert set(self.s.served) == live


# ---- decode: promises, chunk arrivals, preemption ------------------------------------
class DecodePool(PoolMachine):
    @initialize(num_blocks=st.integers(4, 12), block_size=st.integers(1, 4),
                headroom=st.integers(0, 2), max_seqs=st.integers(1, 4))
    def setup(self, num_blocks, block_size, headroom, max_seqs):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.s = DecodeScheduler(DecodeSchedulerConfig(max_num_seqs=max_seqs,
                                                       headroom_tokens=headroom,
                                                       max_model_len=4096), self.bm)

    def has_work(self) -> bool:
        return bool(self.s.pending or self.s.running)

    def live_ids(self) -> list[str]:
        return list(self.s.pending) + [r.request_id for r in self.s.running]

    @precondition(lambda self: hasattr(self, "s"))
    @rule(n=st.integers(0, 48), max_tokens=st.integers(1, 40), rid=st.sampled_from(IDS))
    def reserve(self, n, max_tokens, rid):
        n = self.prompt_len(n, room=1)  # room for the prompt and one generated token
        task = DecodeTask(rid, n, greedy(max_tokens))
        if rid in self.live_ids():  # ids are unique among live requests only
            with pytest.raises(ValueError, match="already"):
                self.s.reserve(task)
            return
        if n + 1 > self.capacity:
            with pytest.raises(ValueError, match="cannot fit"):
                self.s.reserve(task)
            return
        empty = not self.has_work()
        ok = self.s.reserve(task)
        assert ok or not empty, "an idle worker refused a request that fits its pool"
        seen["decode reservation " + ("accepted" if ok else "refused")] += 1

    @precondition(lambda self: hasattr(self, "s") and self.s.promised_free_blocks() > 0)
    @rule(max_tokens=st.integers(1, 40))
    def reserve_the_rest(self, max_tokens):
        """Fill the pool's promises exactly (the state a full pool is made of)."""
        k, bs = self.s.promised_free_blocks(), self.bm.block_size
        head = min(max_tokens, self.s.config.headroom_tokens)
        n = min(k * bs - head, self.capacity - 1)
        if n < 1:
            return
        assert self.s.reserve(DecodeTask(self.next_id(), n, greedy(max_tokens))), \
            "refused a request that fits the unpromised blocks exactly"
        seen["decode pool fully promised"] += self.s.promised_free_blocks() == 0

    @precondition(lambda self: hasattr(self, "s") and self.s.pending)
    @rule(pick=st.integers(0, 100), size=st.integers(0, 16))
    def chunk_arrives(self, pick, size):
        rid = list(self.s.pending)[pick % len(self.s.pending)]
        p = self.s.pending[rid]
        end = min(p.received_tokens + size, p.request.num_prompt_tokens)
        r = self.s.allocate_range(rid, end)  # a promise holds: never fails
        assert len(r.block_ids) * self.bm.block_size >= end
        p.received_tokens = end
        if end == p.request.num_prompt_tokens:  # the final chunk carries the first token
            p.first_token = FAKE_TOKEN
            self.s.start(rid)

    @precondition(lambda self: hasattr(self, "s"))
    @rule(stop=st.booleans())
    def step(self, stop):
        self.decode_step(STOP_TOKEN if stop else FAKE_TOKEN)

    def decode_step(self, token: int) -> None:
        had_running = bool(self.s.running)
        items, preempted = self.s.schedule()
        assert items or preempted or not had_running, "running requests but no progress"
        for r in preempted:
            assert r.status == S.PREEMPTED and not r.block_ids
            seen["decode preemption"] += 1
        for i in items:
            r = i.request
            r.num_cached_tokens += 1
            assert len(r.block_ids) * self.bm.block_size >= r.num_cached_tokens
            r.append_token(token)
            if not r.is_finished and r.num_tokens >= self.s.max_len:
                r.status = S.FINISHED_LENGTH
            if r.is_finished:
                self.s.finish(r)

    def drain_step(self):
        for rid in list(self.s.pending):  # the outside input: the rest of every prompt
            self.chunk_arrives(list(self.s.pending).index(rid), 1 << 20)
        self.decode_step(FAKE_TOKEN)

    @precondition(lambda self: hasattr(self, "s") and (self.s.pending or self.s.running))
    @rule(pick=st.integers(0, 100))
    def abort(self, pick):
        ids = self.live_ids()
        r = self.s.abort(ids[pick % len(ids)])
        assert r is not None and r.status == S.FINISHED_ABORTED and not r.block_ids

    @invariant()
    def promises_within_free_blocks(self):
        if hasattr(self, "s"):
            assert self.s.promised_free_blocks() >= 0
            assert set(self.s.promises) == set(self.live_ids())


# ---- colocated: chunked prefill, prefix cache, preemption by recompute ---------------
class ColocatedPool(PoolMachine):
    @initialize(num_blocks=st.integers(4, 12), block_size=st.integers(1, 4),
                budget=st.integers(1, 16), chunk=st.none() | st.integers(1, 8),
                chunked=st.booleans(), prefix=st.booleans(), max_seqs=st.integers(1, 4))
    def setup(self, num_blocks, block_size, budget, chunk, chunked, prefix, max_seqs):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix)
        cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                              max_prefill_chunk=chunk, enable_chunked_prefill=chunked,
                              max_model_len=max(2, num_blocks * block_size))
        self.s = Scheduler(cfg, self.bm)

    def has_work(self) -> bool:
        return self.s.has_unfinished

    def live_ids(self) -> list[str]:
        return [r.request_id for r in self.s.waiting] + [r.request_id for r in self.s.running]

    @precondition(lambda self: hasattr(self, "s"))
    @rule(family=st.integers(0, 1), shared=st.integers(0, 48), n=st.integers(0, 48),
          max_tokens=st.integers(1, 12))
    def add(self, family, shared, n, max_tokens):
        n = self.prompt_len(n)
        r = Request(self.next_id(), prompt(family, shared, n, 10_000 * self.n),
                    greedy(max_tokens))
        if n > self.capacity:
            with pytest.raises(ValueError, match="cannot fit"):
                self.s.add_request(r)
            return
        self.s.add_request(r)

    @precondition(lambda self: hasattr(self, "s"))
    @rule(stop=st.booleans())
    def step(self, stop):
        self.colocated_step(STOP_TOKEN if stop else FAKE_TOKEN)

    def colocated_step(self, token: int) -> None:
        had_work = self.s.has_unfinished
        out = self.s.schedule()
        assert out.items or out.preempted or not had_work, "requests left but no progress"
        seen["colocated preemption"] += len(out.preempted)
        for i in out.items:
            r = i.request
            assert len(r.block_ids) * self.bm.block_size >= i.start + i.num_tokens
            if i.is_prefill and r.prefix_hit_tokens and i.start == r.prefix_hit_tokens:
                seen["colocated prefix hit"] += 1
        sampled = {i.request.request_id: token for i in out.items if i.to_chunk().sample}
        self.s.update(out, sampled)

    def drain_step(self):
        self.colocated_step(FAKE_TOKEN)

    @precondition(lambda self: hasattr(self, "s") and self.s.has_unfinished)
    @rule(pick=st.integers(0, 100))
    def abort(self, pick):
        ids = self.live_ids()
        r = self.s.abort(ids[pick % len(ids)])
        assert r is not None and r.status == S.FINISHED_ABORTED and not r.block_ids


@pytest.mark.parametrize("machine", [PrefillPool, DecodePool, ColocatedPool],
                         ids=lambda m: m.__name__)
def test_random_lifecycles_at_tiny_pools_keep_promises_integrity_and_progress(machine):
    run_state_machine_as_test(
        machine, settings=settings(SETTINGS, max_examples=EXAMPLES[machine.__name__]))


def test_the_machines_reach_full_pools_prefix_hits_and_preemptions():
    """The properties above are only as strong as the states they visit (a fixed seed
    here, so this holds on every run; the test above explores afresh each time)."""
    seen.clear()
    for machine in (PrefillPool, DecodePool, ColocatedPool):
        run_state_machine_as_test(machine, settings=settings(SETTINGS, max_examples=80,
                                                             derandomize=True))
    for state in ("prefill prefix hit", "prefill admission refused (pool promised)",
                  "decode reservation refused", "decode pool fully promised",
                  "decode preemption", "colocated preemption", "colocated prefix hit"):
        assert seen[state] > 0, f"no run reached: {state}"
