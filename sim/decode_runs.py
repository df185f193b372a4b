"""Fast stepping of a simulated decode worker: runs of decode steps taken as one.

Between two events that concern a decode worker, consecutive steps differ only by one
token per running leg. When the real ``schedule()`` has run a step and the next ``k - 1``
steps can neither finish a leg nor need more blocks than nobody was promised (so the
scheduler can preempt no one), the k steps are taken as one: durations from the cost
model, one ``DecodeScheduler.grow`` per leg at the run's end. A command or a KV piece that
arrives meanwhile cuts the run at the first step boundary after it, exactly where the
real loop would take it; a reservation or a keepalive runs at that boundary and the run
goes on after it when no decision can change. ``--decode-stepping exact`` calls
``schedule()`` for every step; tests/unit/test_sim_runs.py checks both give the same run.

``RunCutter`` is SimDecode's base (sim/decode.py): it reads and sets the run's state
(``_items``, ``_ends``, ``_run``, ``_soft*``) and the worker's scheduler.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Any

from sim.adapters import BlockManager, DecodeScheduler, RequestStatus, ScheduledItem
from sim.worker import SimWorker

if TYPE_CHECKING:
    from sim.link import Piece

MAX_RUN = 1024  # most steps taken as one


class RunCutter(SimWorker):
    # set by SimDecode.__init__ (declared here for the type checker and mypyc)
    sched: DecodeScheduler
    bm: BlockManager
    max_len: int
    inbox: list[Piece]
    _items: list[ScheduledItem]
    _ends: Any  # the run's step end times: a list, or a numpy array for a long run
    _run: int
    _soft: list[tuple]
    _soft_at: int
    _soft_version: int

    def publish_load(self) -> int:
        raise NotImplementedError

    def _cut(self) -> None:
        """End a multi-step run at the first step boundary from now on (the commands
        waiting for that boundary then run with the others, in arrival order)."""
        if self._soft:  # they wait for this same boundary: they run there, first
            self._commands[:0] = self._soft
            self._soft = []
            self._soft_version += 1
        if not self.stepping or self._run <= 1:
            return
        j = bisect.bisect_left(self._ends, self.loop.now, 0, self._run)
        if j + 1 < self._run:
            self._run = j + 1
            self.reschedule_end(float(self._ends[j]))

    def _soft_command(self, fn, args: tuple) -> bool:
        """Hold a reservation or keepalive for the step boundary it waits for, without
        ending the run there; False when that boundary is the run's end anyway."""
        if not self.stepping or self._run <= 1:
            return False
        j = bisect.bisect_left(self._ends, self.loop.now, 0, self._run)
        if j + 1 >= self._run:
            return False
        if not self._soft:  # one boundary at a time: a later command waits for the same
            self._soft_at = j + 1
            self._soft_version += 1
            self.loop.at(float(self._ends[j]), self._boundary, self._soft_version)
        self._soft.append((fn, args))
        return True

    def _boundary(self, version: int) -> None:
        """``_soft_at`` steps of the run are done: the blocks they took are taken (what
        ``schedule()`` allocates step by step), the held commands run, and the run goes on
        when its remaining steps still fit what nobody was promised (so the real
        scheduler could preempt no one); else it ends here and the next step is a fresh
        ``schedule()``."""
        if version != self._soft_version or not self._soft:
            return
        commands, self._soft = self._soft, []
        done, grow, bs = self._soft_at, self.sched.grow, self.bm.block_size
        items = [it for it in self._items if it.request.status == RequestStatus.RUNNING]
        # Blocks a leg takes from its own promise leave promised_free_blocks() as it is,
        # and a reservation or keepalive reads nothing else: such growth waits for the
        # run's end (one grow per leg). Growth beyond a promise is taken here, first.
        promises, held = self.sched.promises, []
        for it in items:
            r = it.request
            nb, want = len(r.block_ids), -(-(r.num_cached_tokens + done) // bs)
            held.append((r.num_cached_tokens, max(nb, want)))
            if want > promises.get(r.request_id, 0) and want > nb:
                break
        else:
            items = []  # every leg's growth is within its promise
        for it in items:
            r = it.request
            if len(r.block_ids) * bs < r.num_cached_tokens + done:
                if not grow(r, r.num_cached_tokens + done):
                    raise AssertionError(f"{r.request_id}: blocks for a checked run are missing")
        if items:
            held = [(it.request.num_cached_tokens, len(it.request.block_ids)) for it in items]
        for fn, args in commands:
            fn(*args)
        free = self.publish_load()
        run = self._run
        need = sum(max(0, -(-(c + run) // bs) - nb) for c, nb in held)
        if self.inbox or need > free:  # (a reserve's early KV)
            self._run = done
            self.reschedule_end(self.loop.now)

    def _run_length(self, items: list[ScheduledItem], free: int) -> int:
        """Steps that can go as one after this one: none finishes a leg before the last,
        and their blocks fit ``free``, what nobody was promised (so no preemption can
        happen): ``promised_free_blocks()`` as the step start published it."""
        k, max_len, bs = MAX_RUN, self.max_len, self.bm.block_size
        held = []
        for it in items:
            r = it.request
            out = len(r.output_token_ids)
            left = min(r.sampling_params.max_tokens - out,
                       max_len - len(r.prompt_token_ids) - out)
            if left < k:
                k = max(1, left)
            held.append((r.num_cached_tokens, len(r.block_ids)))
        if k <= 1:
            return 1

        def need(steps: int) -> int:  # BlockManager.blocks_needed over the items
            n = 0
            for c, nb in held:
                m = -(-(c + steps) // bs) - nb
                if m > 0:
                    n += m
            return n

        if need(k) <= free:
            return k
        lo, hi = 1, k  # need(lo) <= free < need(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if need(mid) <= free else (lo, mid)
        return lo
