"""A simulated decode worker: the real DecodeScheduler (promises, admission per arriving
chunk, continuous batching, preemption of the newest) over the real BlockManager. Around
it, what decode_worker/engine.py DecodeEngine does: take the arrived KV pieces at the
start of a step (allocation per chunk, credit back to the link), start legs whose KV is
complete, one decode step, tokens out, finished legs freed.

Fast stepping (sim/decode_runs.py): after the real ``schedule()`` ran a step, the next
steps that can neither finish a leg nor preempt anyone are taken as one run, cut at the
first step boundary after a command or a KV piece.

KV-wait expiry runs on the simulated clock (``DecodeScheduler(clock=loop)``): a timer at
the oldest pending leg's deadline cuts a run (or wakes a napping worker) so the step that
starts after it expires the leg, as the real step's ``_expire`` does; the router's
keepalives (sim/router.py) restart the wait of legs whose prefill is still on.
"""

from __future__ import annotations

import math
from array import array
from itertools import accumulate
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from engine.costs.model import SMALL_RUN
from sim.adapters import (
    BlockManager,
    DecodeScheduler,
    DecodeTask,
    RequestStatus,
    ScheduledItem,
    simulated_token,
)
from sim.decode_kv import KVIntake

_accumulate = np.add.accumulate

if TYPE_CHECKING:
    from sim.cluster import Simulation
    from sim.link import Piece


class SimDecode(KVIntake):
    role: ClassVar[str] = "decode"

    def __init__(self, sim: Simulation, worker_id: str):
        super().__init__(sim, worker_id)
        plan = sim.plan
        self.bm = BlockManager(plan.decode_blocks, plan.decode_block_size,
                               enable_prefix_caching=False)
        self.sched = DecodeScheduler(plan.decode, self.bm, clock=sim.loop)
        self.max_len = min(plan.max_model_len, self.sched.max_len)
        self.num_steps = 0
        self.busy_s = 0.0
        self.num_layers = plan.num_layers
        self.kvb = plan.kv_bytes_per_token
        self.fast = sim.options.decode_stepping == "fast"
        self.join_s = self.costs.leg_join_s()
        self.handoff_spread = self.costs.handoff_spread
        self.inbox: list[Piece] = []
        self.early: dict[str, list[Piece]] = {}  # KV that came before its reserve (decode_kv)
        self.closed: set[str] = set()  # legs whose later KV is dropped here
        self.started: dict[str, float] = {}
        self.first_step: dict[str, int] = {}  # leg -> index of its first decode step
        self._aborted_early: set[str] = set()
        self.step_times = array("d")  # end of every step that ran the model
        self.step_batch = array("i")
        self._items: list[ScheduledItem] = []
        self._ends = np.empty(0)
        self._run = 0  # steps in the current (macro) step
        self._out: list[tuple] = []  # legs that left, reported at the end of the step
        self._soft: list[tuple] = []  # commands that run at the boundary self._soft_at
        self._soft_at = 0  # steps of the run done at that boundary
        self._soft_version = 0
        self._t0 = 0.0
        self._fixed: dict[int, float] = {}  # batch size -> step overhead + sampling
        self._failed: list[str] = []  # legs whose KV wait expired, reported at step end
        self._expiry_at: float | None = None  # the pending expiry check
        self._expiry_due = False

    @property
    def has_work(self) -> bool:
        return bool(self.sched.pending or self.sched.running)

    def pending_io(self) -> bool:
        return bool(self.inbox) or self._expiry_due

    # ---- commands and I/O ---------------------------------------------------------
    def command(self, fn, *args) -> None:
        # a reservation or a keepalive changes no running leg: it runs at the next step
        # boundary and the run goes on after it when no decision can change (_boundary)
        # (by name: a method compiled by mypyc, `make sim-fast`, has no __func__)
        if isinstance(getattr(fn, "__self__", None), SimDecode) and fn.__name__ in _SOFT:
            if self._soft_command(fn, args):
                return
        else:
            self._cut()
        super().command(fn, *args)

    def keepalive(self, legs: list[str]) -> None:
        """DecodeEngine.keepalive: these legs' prefills are on, their KV wait restarts."""
        self.sched.touch(legs)

    def reserve(self, task: DecodeTask, reply) -> None:
        leg, ok, error = task.leg_id, False, None
        if leg in self._aborted_early:
            self._aborted_early.discard(leg)
        else:
            try:
                ok = self.sched.reserve(task)
            except ValueError as e:  # can never fit: the router says so at once
                error = str(e)
        if ok:
            self._arm_expiry()
        reply(ok, error)
        self.early_reserved(leg, ok)  # KV that came before it: written next, or dropped

    # ---- KV-wait expiry -----------------------------------------------------------
    def _arm_expiry(self) -> None:
        """One timer at the oldest pending leg's deadline (deadlines only move later, and a
        leg reserved later has a later one), so while any leg is pending either the timer
        is armed no later than the first deadline or an expiry is due: a step before the
        timer's time can skip the scan."""
        if self._expiry_at is not None or not self.sched.pending:
            return
        timeout = self.sched.config.kv_wait_timeout_s
        since = min(p.since for p in self.sched.pending.values())
        at = since + timeout
        while at - since <= timeout:  # the first time `expired()` sees it (float rounding:
            at = math.nextafter(at, math.inf)  # one nextafter may not be enough)
        self._expiry_at = max(at, self.loop.now)
        self.loop.at(self._expiry_at, self._expiry_check)

    def _expiry_check(self) -> None:
        self._expiry_at = None
        if not self.sched.pending:
            return
        if not self.sched.expired():  # the wait restarted meanwhile (a chunk, a keepalive)
            self._arm_expiry()
            return
        self._expiry_due = True  # the next step expires it (re-armed there)
        if self.stepping:
            self._cut()
        else:
            self.io_ready()

    def _expire(self, now: float) -> None:
        """DecodeEngine._expire: fail the legs whose KV stopped coming."""
        self._expiry_due = False
        if self.sched.pending:
            for leg in self.sched.expired(now):
                if self._end(leg):
                    self._failed.append(leg)
                    self.early_closed(leg)
            self._arm_expiry()

    def abort(self, leg_id: str) -> None:
        if not self._end(leg_id):
            self._aborted_early.add(leg_id)
        self.early_closed(leg_id)

    def _end(self, leg_id: str) -> bool:
        self.started.pop(leg_id, None)
        self.first_step.pop(leg_id, None)
        return self.sched.abort(leg_id) is not None

    # ---- the step -----------------------------------------------------------------
    def start_step(self) -> tuple[float, bool] | None:
        now = self._t0 = self.loop.now
        import_s = self._take_kv(now) if self.inbox else 0.0
        at = self._expiry_at  # nothing can expire before the armed check (see _arm_expiry)
        if self._expiry_due or (at is not None and now >= at):
            self._expire(now)
        sched = self.sched
        items, preempted = sched.schedule()
        free = self.sim.router.promisable[self.worker_id] = sched.promised_free_blocks()  # (publish_load)
        for r in preempted:  # reported with the step's events, at its end
            self._out.append(self._leg_out(r.request_id, r, finished=False))
        if not items:
            self._flush(now)
            self._items, self._run = [], 0
            return (import_s, False) if import_s > 0 else None
        n, first, b = len(self.step_times), self.first_step, len(items)
        ctx = longest = 0
        joined = False
        for it in items:
            start = it.start
            ctx += start
            if start > longest:
                longest = start
            rid = it.request.request_id
            if rid not in first:
                first[rid] = n
                joined = True
        if joined:  # a step that legs join costs more (engine/costs/model.py leg_join_s)
            import_s += self.join_s
        ctx, longest = ctx + b, longest + 1  # each item attends its context and the new token
        k = self._run_length(items, free) if self.fast else 1
        fixed = self._fixed.get(b)
        if fixed is None:  # the costs are pure functions of the batch: asked once per size
            fixed = self._fixed[b] = self.costs.step_overhead_s("decode", b) + self.costs.sample_s(b)
        run = self.costs.decode_run_s(b, ctx, longest, k)
        durations: Any  # a list for a short run, else a numpy array
        if k <= SMALL_RUN:  # the same float operations as the numpy path, without numpy
            durations = [x + fixed for x in run]
            durations[0] += import_s
            durations[0] += now  # summed from now: the same additions as step by step
            self._ends = list(accumulate(durations))
        else:
            durations = np.asarray(run) + fixed
            durations[0] = float(durations[0]) + import_s + now  # (two additions, in order)
            self._ends = _accumulate(durations)  # (cumsum's own add.accumulate, 2x cheaper)
        if self._out or self._failed:  # reported with the first step's events
            self._flush(float(self._ends[0]))
        self._items, self._run = items, k
        return float(self._ends[-1]) - now, True

    def end_step(self) -> None:
        items, j = self._items, self._run
        self._items = []
        if not j:  # a step that only took KV in
            self.busy_s += self.loop.now - self._t0
            return
        ends = self._ends[:j]
        if isinstance(ends, list):
            self.step_times.extend(ends)
        else:
            self.step_times.frombytes(ends.tobytes())
        self.step_batch.extend(array("i", (len(items),)) * j)
        self.num_steps += j
        self.busy_s += float(ends[-1]) - self._t0
        tracer, token = self.sim.tracer, simulated_token()
        if tracer is not None:
            ends = list(ends)
            starts = [self._t0, *ends[:-1]]
            for s, e in zip(starts, ends, strict=True):
                for it in items:
                    tracer.span(it.request.request_id, "decode_step", self.worker_id, s, e,
                                batch_num_seqs=len(items), batch_num_tokens=len(items),
                                tenant=it.request.tenant)
        running, stopped = RequestStatus.RUNNING, RequestStatus.FINISHED_STOPPED
        grow, bs, max_len = self.sched.grow, self.bm.block_size, self.max_len
        for it in items:
            r = it.request
            if r.status != running:
                continue  # aborted while the steps ran: already freed
            n = r.num_cached_tokens + j
            if j > 1:
                if len(r.block_ids) * bs < n and not grow(r, n):
                    raise AssertionError(f"{r.request_id}: blocks for a checked run are missing")
                r.output_token_ids.extend([token] * (j - 1))
            r.num_cached_tokens = n
            r.append_token(token)
            status = r.status
            if status < stopped and len(r.prompt_token_ids) + len(r.output_token_ids) >= max_len:
                r.status = status = RequestStatus.FINISHED_LENGTH
            if status >= stopped:  # Request.is_finished
                self.sched.finish(r)
                self._out.append(self._leg_out(r.request_id, r, finished=True))
        self._flush(self.loop.now)

    def _leg_out(self, leg_id: str, r, finished: bool) -> tuple:
        """A leg left this worker (finished or preempted): what the router hears of it."""
        first = self.first_step.pop(leg_id, len(self.step_times))
        count = len(r.output_token_ids) - 1  # the first came from the prefill worker
        start = self.started.pop(leg_id, self.loop.now)
        return (leg_id, first, count, finished, self.loop.now - start)

    def _flush(self, at: float) -> None:
        """Report the legs that left with the events of the step ending ``at``."""
        if self._failed:
            failed, self._failed = self._failed, []
            for leg_id in failed:
                self.loop.at(at + self.sim.rpc_s, self.sim.router.on_failed, self, leg_id,
                             "timed out waiting for KV from the prefill worker")
        if not self._out:
            return
        out, self._out = self._out, []
        for leg_id, first, count, finished, decode_s in out:
            self.loop.at(at + self.sim.rpc_s, self.sim.router.on_decode_end, self, leg_id,
                         first, count, finished, decode_s)

    def publish_load(self) -> int:
        """The load of the worker's channel message (decode_worker/worker.py load()) as
        the router last heard it: its unpromised free blocks, at each step start."""
        free = self.sim.router.promisable[self.worker_id] = self.sched.promised_free_blocks()
        return free

    def stats(self) -> dict[str, Any]:
        return {"role": self.role, "steps": self.num_steps,
                "mean_step_s": self.busy_s / self.num_steps if self.num_steps else None,
                "busy_s": self.busy_s, "kv_bytes_sent": 0.0,
                "mean_batch": (sum(self.step_batch) / len(self.step_batch)
                               if self.step_batch else None)}


_SOFT = ("reserve", "keepalive")  # SimDecode's commands that need not end a run
