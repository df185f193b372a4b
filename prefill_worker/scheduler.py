"""Prefill-side scheduler: admission by block promise, fairness order, chunk sizes.

Admission promises a request every block its whole prompt will need (its earlier chunks'
KV must stay resident for the later chunks' attention), so admitted prefills can always
finish and never deadlock each other; physical blocks are still allocated per chunk.
Invariant: the blocks promised to admitted prefills never exceed the free blocks. With
prefix caching, cached free blocks count as free until a hit takes them, so admission
charges a hit for the cached blocks it takes and takes nothing unless the request fits.
Each step: requests in the fairness policy's order get `C = chunk_policy.size(remaining,
budget left)` until the token budget is spent.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType

from engine.block_manager import BlockManager
from engine.execute import ScheduledItem
from engine.request import Request, RequestStatus
from prefill_worker.policies import (
    CHUNK_POLICIES,
    FAIRNESS_POLICIES,
    PrefillState,
    TenantLedger,
    make_chunk_policy,
    order,
)


@dataclass(frozen=True)
class PrefillSchedulerConfig:
    """Field names are the serving config's (`scheduler.<name>`)."""

    max_num_batched_tokens: int = 512
    max_prefill_chunk: int = 256
    min_chunk: int = 16
    max_num_seqs: int = 32
    fairness_policy: str = "fcfs"
    chunk_policy: str = "fixed"
    aging_s: float = 5.0
    tenant_weights: Mapping[str, float] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        for name, registry in (("fairness_policy", FAIRNESS_POLICIES),
                               ("chunk_policy", CHUNK_POLICIES)):
            if getattr(self, name) not in registry:
                raise ValueError(registry.unknown(getattr(self, name)))
        for name in ("max_num_batched_tokens", "max_prefill_chunk", "min_chunk", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.aging_s <= 0:
            raise ValueError("aging_s must be > 0")
        bad = {t: w for t, w in self.tenant_weights.items() if not w > 0}
        if bad:
            raise ValueError(f"tenant_weights must be > 0, got {bad}")
        object.__setattr__(self, "tenant_weights", MappingProxyType(dict(self.tenant_weights)))

    def __reduce__(self):
        """Pickles (it travels to the worker actors in their WorkerSpec), unlike the
        read-only proxy of its weights, which is rebuilt on the other side."""
        args = [dict(v) if f.name == "tenant_weights" else v
                for f in fields(self) for v in [getattr(self, f.name)]]
        return (PrefillSchedulerConfig, tuple(args))


class PrefillScheduler:
    def __init__(
        self, config: PrefillSchedulerConfig, block_manager: BlockManager,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.bm = block_manager
        self.clock = clock
        self.chunk_policy = make_chunk_policy(config.chunk_policy, config.max_prefill_chunk,
                                              config.min_chunk)
        self._fairness_key = FAIRNESS_POLICIES.get(config.fairness_policy)  # once, not per step
        self.waiting: deque[tuple[Request, PrefillState]] = deque()
        self.active: dict[str, tuple[Request, PrefillState]] = {}
        self._queued: set[str] = set()  # ids in `waiting`
        self.served = TenantLedger(config.tenant_weights)  # tenant -> tokens / weight (wfq)

    # ---- queue --------------------------------------------------------------------
    def add(self, request: Request, deadline_s: float | None = None, priority: int = 0) -> None:
        """Queue a prefill; ValueError if its id is live here or it can never fit the pool.

        `priority`: the request's (GenerateRequest.priority), read by the "priority"
        fairness policy (lower first)."""
        rid = request.request_id
        if rid in self.active or rid in self._queued:
            raise ValueError(f"request_id {rid!r} is already queued or running")
        if self.bm.blocks_for(request.prefill_len) > self.bm.num_blocks:
            raise ValueError(
                f"prompt of {request.prefill_len} tokens cannot fit this prefill worker's KV "
                f"cache ({self.bm.num_blocks * self.bm.block_size} tokens)")
        now = self.clock()
        state = PrefillState(
            rid, now, request.prefill_len, request.prefill_len, request.tenant,
            None if deadline_s is None else now + deadline_s, priority=priority,
        )
        self.waiting.append((request, state))
        self._queued.add(rid)
        self.served.join(request.tenant)

    def abort(self, request_id: str) -> Request | None:
        entry = self.active.pop(request_id, None)
        if entry is None:
            if request_id not in self._queued:
                return None
            entry = next(e for e in self.waiting if e[0].request_id == request_id)
            self.waiting.remove(entry)
            self._queued.discard(request_id)
        self._end(entry[0], RequestStatus.FINISHED_ABORTED)
        return entry[0]

    def _end(self, r: Request, status: RequestStatus) -> None:
        r.status = status
        self.bm.free(r)
        self.served.leave(r.tenant)

    @property
    def num_outstanding_tokens(self) -> int:
        return sum(s.remaining for _, s in self.waiting) + sum(
            s.remaining for _, s in self.active.values())

    def _promised_blocks(self) -> int:
        return sum(self.bm.blocks_needed(r, r.prefill_len) for r, _ in self.active.values())

    def _admit(self) -> None:
        """Admit from the head while the whole prompt fits the unpromised free blocks.

        A prefix hit is looked up, not taken, until the request fits: the cached blocks
        it would take leave the free pool, and a head that holds them while it waits
        could leave an admitted prefill short of its promise forever."""
        while self.waiting and len(self.active) < self.config.max_num_seqs:
            r, s = self.waiting[0]
            if r.may_use_prefix_cache:  # (hashed once per request, kept while it waits)
                tokens = _leading(r, r.prefill_len)
                hit = self.bm.match_prefix(tokens, self.bm.request_hashes(r, tokens))
            else:
                hit = []
            cost = self.bm.admission_cost(hit, r.prefill_len)
            if cost > self.bm.num_free_blocks - (self._promised_blocks() if self.active else 0):
                return
            self.waiting.popleft()
            self._queued.discard(r.request_id)
            self.bm.take_prefix(r, hit)
            n = len(hit) * self.bm.block_size
            r.num_computed_tokens = r.num_cached_tokens = r.prefix_hit_tokens = n
            s.remaining = r.remaining_prefill
            self.active[r.request_id] = (r, s)
            self.served.activate(r.tenant)

    # ---- steps --------------------------------------------------------------------
    def schedule(self) -> list[ScheduledItem]:
        if self.active:  # (no one running: the tick would find no least service)
            self.served.tick(s.tenant for _, s in self.active.values())
        self._admit()
        now = self.clock()
        budget = self.config.max_num_batched_tokens
        items: list[ScheduledItem] = []
        states = [s for _, s in self.active.values()]
        for s in order(self._fairness_key, states, now, self.config.aging_s, self.served):
            if budget <= 0:
                break
            r, _ = self.active[s.request_id]
            c = self.chunk_policy.size(r.remaining_prefill, budget)
            if c <= 0 or not self.bm.allocate(r, r.num_computed_tokens + c):
                continue
            r.status = RequestStatus.PREFILLING
            items.append(ScheduledItem(r, r.num_computed_tokens, c, is_prefill=True))
            budget -= c
            s.last_served = now
            self.served.charge(r.tenant, c)
        return items

    def advance(self, items: list[ScheduledItem]) -> None:
        """Counters after the step ran (KV of every item is now written)."""
        for item in items:
            r = item.request
            r.num_computed_tokens = r.num_cached_tokens = item.start + item.num_tokens
            self.active[r.request_id][1].remaining = r.remaining_prefill
            self.bm.cache_full_blocks(r, _leading(r, r.num_cached_tokens))

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Prefill done (its KV exported): release the blocks (cached ones go to the LRU)."""
        if self.active.pop(request.request_id, None) is not None:
            self._end(request, status)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.active)


def _leading(r: Request, n: int) -> list[int]:
    """r's first n tokens (read only): the prompt itself when it holds them, no copy."""
    prompt = r.prompt_token_ids
    if n == len(prompt):
        return prompt
    return prompt[:n] if n < len(prompt) else r.all_token_ids[:n]
