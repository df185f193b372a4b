"""Decode-side scheduler: KV admission by promise, per-chunk block allocation,
continuous batching, preemption by recompute.

Admission (`reserve`) counts the request's prompt plus headroom against the free blocks
as a *promise*; blocks are allocated only as KV chunks arrive. Invariant: the blocks
still owed on promises never exceed the free blocks (`promised_free_blocks() >= 0`), so
a chunk always finds its blocks and half-received requests cannot deadlock the pool.

A promise holds for the request's whole stay: a started request keeps what is left of
its headroom and decodes into it without competing with anyone. Beyond its promise a
running request may only take *unpromised* free blocks; when there are none, the newest
running request is preempted (recompute through a prefill worker), never a promise.

The blocks still owed on promises are kept as a running total (every allocation and
release goes through `_allocate` / `_release`), so `promised_free_blocks()` is O(1) and a
step is linear in the running list. Time comes from `clock` (the wall clock in a worker,
a simulated one in sim/): the KV wait of `expired` counts on it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from decode_worker.early_kv import EarlyKVConfig
from engine.block_manager import BlockManager
from engine.execute import ScheduledItem
from engine.request import Request, RequestStatus
from runtime.messages import DecodeTask


@dataclass(frozen=True)
class DecodeSchedulerConfig:
    max_num_seqs: int = 64
    headroom_tokens: int = 64  # decode room promised beyond the prompt
    max_model_len: int = 2048
    kv_wait_timeout_s: float = 60.0
    early_kv: EarlyKVConfig = field(default_factory=EarlyKVConfig)  # (the engine's EarlyKV)
    overlap: bool = False  # the engine's host one step ahead of the device (its overlap)

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.headroom_tokens < 0 or self.max_model_len < 2:
            raise ValueError("max_num_seqs >= 1, headroom_tokens >= 0, max_model_len >= 2")
        if self.kv_wait_timeout_s <= 0:
            raise ValueError("kv_wait_timeout_s must be > 0")


@dataclass
class Pending:
    """A request whose KV is still arriving (WAITING_FOR_KV)."""

    request: Request
    since: float
    received_tokens: int = 0
    ranges: set[tuple[int, int]] | None = None
    first_token: int | None = None
    complete: bool = False
    in_intake: int = 0  # ranges still being written off the loop (decode_worker/intake.py)


class DecodeScheduler:
    def __init__(self, config: DecodeSchedulerConfig, block_manager: BlockManager,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.bm = block_manager
        self.clock = clock
        self.pending: dict[str, Pending] = {}
        self.running: list[Request] = []  # oldest first
        self._running_ids: dict[str, Request] = {}
        self.promises: dict[str, int] = {}  # request_id -> blocks promised (pending, running)
        self._owed_total = 0  # sum of _owed over every pending and running request
        # A sequence stops where the whole pool is full: past that point it could only
        # preempt itself and come back forever.
        self.max_len = min(config.max_model_len, block_manager.num_blocks * block_manager.block_size)

    def _owed(self, r: Request) -> int:
        """Blocks promised to `r` that it has not allocated yet."""
        return max(0, self.promises.get(r.request_id, 0) - len(r.block_ids))

    def promised_free_blocks(self) -> int:
        return self.bm.num_free_blocks - self._owed_total

    def owed_blocks(self) -> int:
        """Blocks owed on promises, summed afresh (what `_owed_total` must equal)."""
        return (sum(self._owed(p.request) for p in self.pending.values())
                + sum(self._owed(r) for r in self.running))

    def _allocate(self, r: Request, num_tokens: int) -> bool:
        before = self._owed(r)
        ok = self.bm.allocate(r, num_tokens)
        self._owed_total += self._owed(r) - before
        return ok

    def reserve(self, task: DecodeTask) -> bool:
        """Admit a request if its prompt + headroom fits the unpromised free blocks."""
        if task.leg_id in self.pending or self.find_running(task.leg_id):
            raise ValueError(f"leg {task.leg_id!r} is already on this worker")
        if self.bm.blocks_for(task.prompt_len + 1) > self.bm.num_blocks:
            raise ValueError(
                f"prompt of {task.prompt_len} tokens cannot fit this decode worker's KV cache "
                f"({self.bm.num_blocks * self.bm.block_size} tokens)")
        remaining = task.sampling.max_tokens - task.num_generated
        tokens = min(task.prompt_len + min(remaining, self.config.headroom_tokens), self.max_len)
        promise = max(self.bm.blocks_for(task.prompt_len), self.bm.blocks_for(tokens))
        if promise > self.promised_free_blocks():
            return False
        req = Request(task.leg_id, [0] * task.prompt_len, task.sampling,
                      eos_token_ids=task.eos_token_ids, tenant=task.tenant,
                      status=RequestStatus.WAITING_FOR_KV)
        self.pending[task.leg_id] = Pending(req, self.clock(), ranges=set())
        self.promises[task.leg_id] = promise
        self._owed_total += promise
        return True

    def find_running(self, request_id: str) -> Request | None:
        return self._running_ids.get(request_id)

    def abort(self, request_id: str) -> Request | None:
        p = self.pending.pop(request_id, None)
        r = p.request if p else self.find_running(request_id)
        if r is None:
            return None
        if self._running_ids.pop(request_id, None) is not None:
            self.running.remove(r)
        r.status = RequestStatus.FINISHED_ABORTED
        self._release(r)
        return r

    def _release(self, r: Request) -> None:
        self._owed_total -= self._owed(r)
        self.bm.free(r)
        self.promises.pop(r.request_id, None)

    def allocate_range(self, request_id: str, token_end: int) -> Request | None:
        """Blocks for a chunk ending at `token_end`, within the request's promise. Raises
        ValueError (the request fails, nobody else) for a chunk beyond the prompt."""
        p = self.pending.get(request_id)
        if p is None:
            return None
        n = p.request.num_prompt_tokens
        if token_end > n:
            raise ValueError(f"KV chunk ends at token {token_end}, beyond the announced "
                             f"prompt of {n} tokens")
        if not self._allocate(p.request, token_end):  # unreachable while promises hold
            raise RuntimeError(f"no free block for {request_id!r} within its promise "
                               f"({self.promises.get(request_id)} blocks)")
        p.since = self.clock()  # progress: the KV wait counts from the latest chunk
        return p.request

    def touch(self, request_ids: list[str], now: float | None = None) -> int:
        """The router vouches that these requests' prefills are queued or running on a live
        worker: their KV wait restarts (a long prefill queue is not a lost transfer)."""
        now = self.clock() if now is None else now
        n = 0
        for rid in request_ids:
            p = self.pending.get(rid)
            if p is not None:
                p.since, n = now, n + 1
        return n

    def start(self, request_id: str) -> Request:
        """All KV and the first token are in: WAITING_FOR_KV -> RUNNING (keeps its promise)."""
        p = self.pending.pop(request_id)
        r = p.request
        r.num_computed_tokens = r.num_cached_tokens = r.num_prompt_tokens
        assert p.first_token is not None, "start() follows the final chunk's first token"
        r.status = RequestStatus.RUNNING
        r.output_token_ids.append(p.first_token)
        self.running.append(r)
        self._running_ids[request_id] = r
        return r

    def expired(self, now: float | None = None) -> list[str]:
        now = self.clock() if now is None else now
        return [rid for rid, p in self.pending.items()
                if now - p.since > self.config.kv_wait_timeout_s]

    def grow(self, r: Request, num_tokens: int) -> bool:
        """Room for `num_tokens` tokens: first from r's own promise, then only from blocks
        nobody was promised."""
        bm, held = self.bm, len(r.block_ids)  # (blocks_needed, _owed: inlined, per step)
        need = -(-num_tokens // bm.block_size) - held
        if need <= 0:
            return True  # the slots are in r's blocks already
        owed = max(0, self.promises.get(r.request_id, 0) - held)
        if need - min(need, owed) > bm.num_free_blocks - self._owed_total:
            return False
        if not self.bm.allocate(r, num_tokens):  # need <= owed(r) + unpromised <= free
            return False
        self._owed_total -= min(need, owed)
        return True

    def schedule(self, skip: frozenset[str] | set[str] = frozenset()
                 ) -> tuple[list[ScheduledItem], list[Request]]:
        """One decode token per running request; preempts the newest when out of blocks.
        ``skip``: requests left out of this step (the overlapped engine's, which the step
        in flight finishes for certain)."""
        items: list[ScheduledItem] = []
        preempted: list[Request] = []
        running_ids, bs = self._running_ids, self.bm.block_size
        for r in self.running[: self.config.max_num_seqs]:
            if r.request_id not in running_ids or (skip and r.request_id in skip):
                continue  # preempted by an earlier request of this step (or skipped)
            start = r.num_cached_tokens
            if len(r.block_ids) * bs > start:  # the new token's slot is in r's blocks
                items.append(ScheduledItem(r, start, 1, False))
                continue
            while not self.grow(r, start + 1):
                victim = self.running.pop()
                del running_ids[victim.request_id]
                self._release(victim)
                victim.status = RequestStatus.PREEMPTED
                preempted.append(victim)
                if victim is r:
                    break
            else:
                items.append(ScheduledItem(r, start, 1, False))
        if preempted:  # one may have been scheduled before it was chosen as a victim
            items = [i for i in items if i.request.status == RequestStatus.RUNNING]
        return items, preempted

    def finish(self, r: Request) -> None:
        self.running.remove(r)
        del self._running_ids[r.request_id]
        self._release(r)
