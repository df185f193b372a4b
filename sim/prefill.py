"""A simulated prefill worker: the real PrefillScheduler (admission by block promise,
fairness order, chunk policy) over the real BlockManager (prefix caching included), on
the simulated clock. What prefill_worker/engine.py PrefillEngine does around it (jobs,
shipping each chunk's KV to the link, the first token, PREFILL_DONE once the sends are
acked) is mirrored here; the model's compute, sampling and KV export are costs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from sim.adapters import (
    BlockManager,
    PrefillScheduler,
    RequestStatus,
    ScheduledItem,
    prefill_request,
    simulated_token,
)
from sim.worker import SimWorker

if TYPE_CHECKING:
    from sim.cluster import Simulation
    from sim.decode import SimDecode
    from sim.link import SimLink


@dataclass(eq=False, slots=True)  # (slots: lighter, faster attributes)
class Job:
    leg_id: str
    tenant: str
    decode: SimDecode
    arrival: float
    seq_no: int = 0
    first_scheduled: float | None = None
    prefill_end: float | None = None


class SimPrefill(SimWorker):
    role: ClassVar[str] = "prefill"

    def __init__(self, sim: Simulation, worker_id: str):
        super().__init__(sim, worker_id)
        plan = sim.plan
        self.bm = BlockManager(plan.prefill_blocks, plan.prefill_block_size, plan.prefix_caching)
        self.sched = PrefillScheduler(plan.prefill, self.bm, clock=sim.loop)
        self.jobs: dict[str, Job] = {}
        self.links: dict[str, SimLink] = {}
        self._aborted_early: set[str] = set()
        self._finished: list[str] = []  # legs whose sends were all acked
        self._failed: list[tuple[str, str]] = []
        self._items: list[ScheduledItem] = []
        self._t0 = self._compute = 0.0
        self.chunk_sizes: dict[int, int] = {}
        self._one_chunk: dict[tuple[int, int], float] = {}  # (C, P) -> prefill_s
        # pure functions of their argument, asked once per value: tokens -> kv_export_s,
        # chunks in the step -> step_overhead_s
        self._export: dict[int, float] = {}
        self._overhead: dict[int, float] = {}
        self.kv_bytes_sent = 0
        self.spread = self.costs.prefill_spread  # a drawn extra per step (engine/costs/model.py)
        self.arrival = self.costs.arrival_spread  # ... and per request's first token

    @property
    def has_work(self) -> bool:
        return self.sched.has_work or bool(self.jobs)

    def pending_io(self) -> bool:
        return bool(self._finished or self._failed)

    # ---- commands ------------------------------------------------------------------
    def add(self, leg_id: str, prompt: list[int], max_tokens: int, tenant: str,
            decode: SimDecode, deadline_s: float | None,
            hashes: list[bytes] | None = None) -> None:
        if leg_id in self._aborted_early:
            self._aborted_early.discard(leg_id)
            return
        req = prefill_request(leg_id, prompt, max_tokens, tenant)
        try:
            self.sched.add(req, deadline_s)
        except ValueError as e:  # it can never fit this worker: the router rejects it
            self.sim.emit(self.sim.router.on_add_rejected, self, leg_id, str(e))
            return
        if hashes is not None:  # hashed by the router's placement
            self.bm.note_hashes(leg_id, hashes)
        self.jobs[leg_id] = Job(leg_id, tenant, decode, self.loop.now)

    def abort(self, leg_id: str) -> None:
        job = self.jobs.pop(leg_id, None)
        if job is None:
            self._aborted_early.add(leg_id)
        self.sched.abort(leg_id)
        if job is not None:
            self.link_to(job.decode).abort(leg_id)

    def set_decode_pressure(self, pressure: float) -> None:
        self.sched.chunk_policy.observe_decode_pressure(pressure)

    # ---- link events ----------------------------------------------------------------
    def link_to(self, decode: SimDecode) -> SimLink:
        link = self.links.get(decode.worker_id)
        if link is None:
            link = self.links[decode.worker_id] = self.sim.make_link(self, decode)
        return link

    def send_finished(self, leg_id: str) -> None:
        self._finished.append(leg_id)
        self.io_ready()

    def send_failed(self, leg_id: str, reason: str) -> None:
        self._failed.append((leg_id, reason))
        self.io_ready()

    # ---- the step -------------------------------------------------------------------
    def _poll_sender(self) -> None:
        if not (self._finished or self._failed):
            return
        now, router = self.loop.now, self.sim.router
        finished, self._finished = self._finished, []
        failed, self._failed = self._failed, []
        for leg in finished:
            job = self.jobs.pop(leg, None)
            if job is not None:
                end = job.prefill_end if job.prefill_end is not None else now
                self.sim.emit(router.on_prefill_done, self, leg, now - end)
        for leg, reason in failed:
            if self.jobs.pop(leg, None) is not None:
                self.sched.abort(leg)
                self.sim.emit(router.on_failed, self, leg, f"KV transfer failed: {reason}")

    def start_step(self) -> tuple[float, bool] | None:
        self._poll_sender()
        if not self.sched.has_work:  # schedule() of an empty scheduler decides nothing
            return None
        items = self.sched.schedule()
        if not items:
            return None
        now = self._t0 = self.loop.now
        costs, export = self.costs, self._export
        exported = 0.0
        finals = 0
        for item in items:
            job = self.jobs[item.request.request_id]
            if job.first_scheduled is None:
                job.first_scheduled = now
            if job.seq_no == 0 and item.start > 0:  # a prefix hit's KV travels too
                exported += costs.kv_export_s(item.start)
            t = export.get(item.num_tokens)
            if t is None:
                t = export[item.num_tokens] = costs.kv_export_s(item.num_tokens)
            exported += t
            finals += item.completes_prefill
        if len(items) == 1:  # a pure function of (C, P): asked once per pair
            key = (items[0].num_tokens, items[0].start)
            t = self._one_chunk.get(key)
            if t is None:
                t = self._one_chunk[key] = costs.prefill_s([key])
            self._compute = t
        else:
            self._compute = costs.prefill_s([(i.num_tokens, i.start) for i in items])
        overhead = self._overhead.get(len(items))
        if overhead is None:
            overhead = self._overhead[len(items)] = costs.step_overhead_s("prefill", len(items))
        duration = (self._compute + exported + overhead
                    + (costs.sample_s(finals) if finals else 0.0))
        if self.spread:
            first = any(i.start == 0 for i in items)  # as tools/sim_scaled.py runs_first_chunk
            duration = max(duration + costs.prefill_extra_s(first), 0.0)
        self._items = items
        self.num_steps += 1
        self.busy_s += duration
        return duration, True

    def end_step(self) -> None:
        items, self._items = self._items, []
        self.sched.advance(items)
        tracer = self.sim.tracer
        batch_tokens = sum(i.num_tokens for i in items)
        for item in items:
            job = self.jobs[item.request.request_id]
            if tracer is not None:
                r = item.request
                tracer.span(r.request_id, "prefill_chunk", self.worker_id, self._t0,
                            self._t0 + self._compute, chunk_id=job.seq_no,
                            token_start=item.start, token_end=item.start + item.num_tokens,
                            scheduled_tokens=item.num_tokens, past_kv_tokens=item.start,
                            prefix_hit_tokens=r.prefix_hit_tokens, batch_num_seqs=len(items),
                            batch_num_tokens=batch_tokens, tenant=r.tenant)
            self._ship(item, job)
            self.chunk_sizes[item.num_tokens] = self.chunk_sizes.get(item.num_tokens, 0) + 1

    def _send(self, job: Job, start: int, end: int, first_token: int | None) -> None:
        self.link_to(job.decode).send(job.leg_id, job.tenant, job.seq_no, start, end,
                                      first_token)
        self.kv_bytes_sent += (end - start) * self.sim.plan.kv_bytes_per_token
        job.seq_no += 1

    def _ship(self, item: ScheduledItem, job: Job) -> None:
        """PrefillEngine._ship: the chunk's KV to the link; the first token when it ends."""
        r = item.request
        if job.seq_no == 0 and item.start > 0:
            self._send(job, 0, item.start, None)
        end = item.start + item.num_tokens
        if not item.completes_prefill:
            self._send(job, item.start, end, None)
            return
        now = job.prefill_end = self.loop.now
        first = job.first_scheduled if job.first_scheduled is not None else now
        timing = {"queue_s": first - job.arrival, "prefill_s": now - first,
                  "cached_tokens": float(r.prefix_hit_tokens)}
        r.append_token(simulated_token())
        ended = r.is_finished  # max_tokens == 1: the decode side is not needed
        if ended:
            self.link_to(job.decode).abort(job.leg_id)
            del self.jobs[job.leg_id]
        else:
            self._send(job, item.start, end, simulated_token())
        self.sched.finish(r, r.status if ended else RequestStatus.RUNNING)
        # through the control plane's first-token path (engine/costs/delivery.py), not a plain call
        delay = self.sim.delivery.first_token_s
        if self.arrival:  # a leg's id is "<request>#<dispatch>#<leg>" (sim/router.py)
            request_id, _, leg = job.leg_id.rsplit("#", 2)
            if leg == "1":  # as the router draws the dispatch: a request's first leg
                delay = max(delay + self.costs.arrival_extra_s(request_id)[1], 0.0)
        self.loop.at(self.loop.now + delay, self.sim.router.on_first_token, self, job.leg_id,
                     ended, timing)

    def stats(self) -> dict[str, Any]:
        return {"role": self.role, "steps": self.num_steps,
                "mean_step_s": self.busy_s / self.num_steps if self.num_steps else None,
                "busy_s": self.busy_s, "kv_bytes_sent": float(self.kv_bytes_sent),
                "chunk_sizes": dict(sorted(self.chunk_sizes.items())),
                "prefix_hits": self.bm.prefix_hits, "prefix_queries": self.bm.prefix_queries}
