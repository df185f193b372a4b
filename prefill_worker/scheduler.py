"""Prefill-side scheduler: admission by block promise, fairness order, chunk sizes.

Admission promises a request every block its whole prompt will need (its earlier chunks'
KV must stay resident for the later chunks' attention), so admitted prefills can always
finish and never deadlock each other; physical blocks are still allocated per chunk.
Each step: requests in the fairness policy's order get `C = chunk_policy.size(remaining,
budget left)` until the token budget is spent.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from engine.block_manager import BlockManager
from engine.request import Request, RequestStatus
from engine.scheduler import ScheduledItem
from prefill_worker.policies import FAIRNESS_POLICIES, PrefillState, make_chunk_policy, order


@dataclass(frozen=True)
class PrefillSchedulerConfig:
    max_num_batched_tokens: int = 512
    max_chunk: int = 256
    min_chunk: int = 16
    max_num_seqs: int = 32
    fairness: str = "fcfs"
    chunk_policy: str = "fixed"
    aging_s: float = 5.0
    tenant_weights: Mapping[str, float] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if self.fairness not in FAIRNESS_POLICIES:
            raise ValueError(
                f"fairness_policy must be one of {sorted(FAIRNESS_POLICIES)}, got {self.fairness!r}"
            )
        make_chunk_policy(self.chunk_policy, max(1, self.max_chunk))  # validates the name
        for name in ("max_num_batched_tokens", "max_chunk", "min_chunk", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.aging_s <= 0:
            raise ValueError("aging_s must be > 0")
        object.__setattr__(self, "tenant_weights", MappingProxyType(dict(self.tenant_weights)))


class PrefillScheduler:
    def __init__(
        self, config: PrefillSchedulerConfig, block_manager: BlockManager,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.bm = block_manager
        self.clock = clock
        self.chunk_policy = make_chunk_policy(config.chunk_policy, config.max_chunk,
                                              config.min_chunk)
        self.waiting: deque[tuple[Request, PrefillState]] = deque()
        self.active: dict[str, tuple[Request, PrefillState]] = {}
        self.served: dict[str, float] = {}  # tenant -> tokens / weight (for wfq)

    # ---- queue --------------------------------------------------------------------
    def add(self, request: Request, deadline_s: float | None = None) -> None:
        now = self.clock()
        state = PrefillState(
            request.request_id, now, request.prefill_len, request.prefill_len, request.tenant,
            None if deadline_s is None else now + deadline_s,
        )
        self.waiting.append((request, state))

    def abort(self, request_id: str) -> Request | None:
        entry = self.active.pop(request_id, None)
        if entry is None:
            entry = next((e for e in self.waiting if e[0].request_id == request_id), None)
            if entry is None:
                return None
            self.waiting.remove(entry)
        entry[0].status = RequestStatus.FINISHED_ABORTED
        self.bm.free(entry[0])
        return entry[0]

    @property
    def num_outstanding_tokens(self) -> int:
        return sum(s.remaining for _, s in self.waiting) + sum(
            s.remaining for _, s in self.active.values())

    def _promised_blocks(self) -> int:
        return sum(self.bm.blocks_needed(r, r.prefill_len) for r, _ in self.active.values())

    def _admit(self) -> None:
        while self.waiting and len(self.active) < self.config.max_num_seqs:
            r, s = self.waiting[0]
            if not r.block_ids:
                hit = self.bm.match_prefix(r.all_token_ids[: r.prefill_len])
                if hit:
                    self.bm.take_prefix(r, hit)
                    n = len(hit) * self.bm.block_size
                    r.num_computed_tokens = r.num_cached_tokens = r.prefix_hit_tokens = n
                    s.remaining = r.remaining_prefill
            need = self.bm.blocks_needed(r, r.prefill_len)
            if need > self.bm.num_free_blocks - self._promised_blocks():
                return
            self.waiting.popleft()
            self.active[r.request_id] = (r, s)

    # ---- steps --------------------------------------------------------------------
    def schedule(self) -> list[ScheduledItem]:
        self._admit()
        now = self.clock()
        budget = self.config.max_num_batched_tokens
        items: list[ScheduledItem] = []
        states = [s for _, s in self.active.values()]
        for s in order(self.config.fairness, states, now, self.config.aging_s, self.served):
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
            w = self.config.tenant_weights.get(r.tenant, 1.0)
            self.served[r.tenant] = self.served.get(r.tenant, 0.0) + c / w
        return items

    def advance(self, items: list[ScheduledItem]) -> None:
        """Counters after the step ran (KV of every item is now written)."""
        for item in items:
            r = item.request
            r.num_computed_tokens = r.num_cached_tokens = item.start + item.num_tokens
            self.active[r.request_id][1].remaining = r.remaining_prefill
            self.bm.cache_full_blocks(r, r.all_token_ids[: r.num_cached_tokens])

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Prefill done (its KV exported): release the blocks (cached ones go to the LRU)."""
        self.active.pop(request.request_id, None)
        request.status = status
        self.bm.free(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.active)
