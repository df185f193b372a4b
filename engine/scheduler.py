"""Colocated scheduler: decode-first token budget, chunked prefill on or off.

Per step (chunked prefill on): every RUNNING request decodes one token first, then
PREFILLING requests continue their prompt, then WAITING requests are admitted, each
prefill taking `C = min(remaining, chunk cap, budget left)`. With chunked prefill off it
is the classic prefill-first policy: whole prompts only, and decodes run in steps that
admit no prefill. Out of blocks -> preemption by recompute of the newest request.
The scheduler owns the queues and never touches tensors.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.execute import ScheduledItem
from engine.model_runner import SeqChunk
from engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    items: list[ScheduledItem] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(i.num_tokens for i in self.items)

    def chunks(self) -> list[SeqChunk]:
        return [i.to_chunk() for i in self.items]


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.bm = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # PREFILLING and RUNNING, oldest first
        # A sequence stops where the whole pool is full, whatever max_model_len says:
        # past that point it could only be preempted and re-admitted forever.
        self._max_len = min(config.max_model_len, block_manager.num_blocks * block_manager.block_size)

    def add_request(self, request: Request) -> None:
        if self.bm.blocks_for(request.prefill_len) > self.bm.num_blocks:
            raise ValueError(  # it would wait at the head of the queue forever
                f"prompt of {request.prefill_len} tokens cannot fit the KV cache "
                f"({self.bm.num_blocks * self.bm.block_size} tokens)")
        self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> Request | None:
        """Abort in any state; frees its blocks. Returns the request if it was known."""
        for queue in (self.waiting, self.running):
            for r in queue:
                if r.request_id == request_id:
                    queue.remove(r)
                    self._finish(r, RequestStatus.FINISHED_ABORTED)
                    return r
        return None

    def _finish(self, r: Request, status: RequestStatus | None = None) -> None:
        if status is not None:
            r.status = status
        self.bm.free(r)

    def _preempt(self, r: Request, out: SchedulerOutput) -> None:
        self.running.remove(r)
        self.bm.free(r)
        r.reset_for_recompute()
        self.waiting.appendleft(r)
        out.preempted.append(r)

    def schedule(self) -> SchedulerOutput:
        out = self._schedule_once()
        if not out.items and self.running:
            # Partial prefills hold every block and none can grow: free the newest.
            self._preempt(self.running[-1], out)
            retry = self._schedule_once()
            retry.preempted = out.preempted + retry.preempted
            out = retry
        return out

    def _schedule_once(self) -> SchedulerOutput:
        out = SchedulerOutput()
        chunked = self.config.enable_chunked_prefill
        budget = self.config.max_num_batched_tokens
        if not chunked:
            budget = max(budget, self.config.max_model_len)
            if self._schedule_waiting(out, budget, chunked):
                return out  # prefill-first: a step with prefills carries no decodes
        budget -= self._schedule_decodes(out)
        if chunked:
            budget = self._schedule_partial_prefills(out, budget)
            self._schedule_waiting(out, budget, chunked)
        return out

    def _schedule_decodes(self, out: SchedulerOutput) -> int:
        used = 0
        for r in list(self.running):
            if r.status != RequestStatus.RUNNING:  # (a victim earlier in this loop: PREEMPTED)
                continue
            while not self.bm.allocate(r, r.num_cached_tokens + 1):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is r:
                    break
            else:
                out.items.append(ScheduledItem(r, r.num_cached_tokens, 1, is_prefill=False))
                used += 1
        return used

    def _schedule_partial_prefills(self, out: SchedulerOutput, budget: int) -> int:
        for r in self.running:
            if budget <= 0:
                break
            if r.status != RequestStatus.PREFILLING:
                continue
            c = min(r.remaining_prefill, self.config.chunk_cap, budget)
            if self.bm.allocate(r, r.num_computed_tokens + c):
                out.items.append(ScheduledItem(r, r.num_computed_tokens, c, is_prefill=True))
                budget -= c
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, chunked: bool) -> bool:
        """Admit from the head while its first chunk fits. A prefix hit is looked up, not
        taken, until it does: its cached blocks count as free until someone takes them."""
        admitted = False
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            r = self.waiting[0]  # fresh or preempted: no blocks, nothing computed
            hit = self.bm.match_prefix(r.all_token_ids[: r.prefill_len]) \
                if r.may_use_prefix_cache else []
            start = len(hit) * self.bm.block_size
            remaining = r.prefill_len - start
            c = min(remaining, self.config.chunk_cap, budget) if chunked else remaining
            if c > budget or self.bm.admission_cost(hit, start + c) > self.bm.num_free_blocks:
                break
            self.waiting.popleft()
            self.bm.take_prefix(r, hit)
            r.num_computed_tokens = r.num_cached_tokens = r.prefix_hit_tokens = start
            ok = self.bm.allocate(r, start + c)
            assert ok, "admission_cost is exact: the first chunk's blocks are free"
            r.status = RequestStatus.PREFILLING if c < remaining else RequestStatus.WAITING
            self.running.append(r)
            out.items.append(ScheduledItem(r, start, c, is_prefill=True))
            budget -= c
            admitted = True
        return admitted

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance counters after the step ran; returns requests that got a token."""
        touched: list[Request] = []
        for item in out.items:
            r = item.request
            if r.is_finished:
                continue
            r.num_cached_tokens = item.start + item.num_tokens
            if item.is_prefill:
                r.num_computed_tokens = r.num_cached_tokens
            if r.num_cached_tokens // self.bm.block_size > item.start // self.bm.block_size:
                self.bm.cache_full_blocks(r, r.all_token_ids[: r.num_cached_tokens])  # new full
            if item.is_prefill and not item.completes_prefill:
                r.status = RequestStatus.PREFILLING
                continue
            r.status = RequestStatus.RUNNING
            r.append_token(sampled[r.request_id])
            if not r.is_finished and r.num_tokens >= self._max_len:
                r.status = RequestStatus.FINISHED_LENGTH
            if r.is_finished:
                self.running.remove(r)
                self._finish(r)
            touched.append(r)
        return touched
