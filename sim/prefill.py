"""A simulated prefill worker: the real prefill_worker/engine.py PrefillEngine (its
scheduler, BlockManager, jobs, KV shipping, first token, PREFILL_DONE once the sends are
acked) on the simulated clock, run by the worker loop of sim/worker.py.

The engine's runner, clock and KV sender are the simulator's (sim/executor.py): a step
costs what the cost model says, its chunks' KV goes to the simulated links, and the
events a step returns go to the simulated router when the step ends, as the real loop
sends them once ``step()`` returns (runtime/loop.py); the first token through the
control plane's first-token path (engine/costs/delivery.py), the rest as messages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from sim.adapters import EventKind, PrefillEngine, WorkerEvent, prefill_task
from sim.executor import PrefillExecutor, SimSender, StepClock
from sim.worker import SimWorker

if TYPE_CHECKING:
    from sim.cluster import Simulation
    from sim.decode import SimDecode
    from sim.link import SimLink


class SimPrefill(SimWorker):
    role: ClassVar[str] = "prefill"

    def __init__(self, sim: Simulation, worker_id: str):
        super().__init__(sim, worker_id)
        plan = sim.plan
        self.clock = StepClock(sim.loop)
        self.sender = SimSender(self.link_to, plan.kv_bytes_per_token)
        self.engine = PrefillEngine(
            worker_id, plan.prefill_engine, plan.prefill, self.sender, plan.prefill_blocks,
            tracer=sim.tracer, runner=PrefillExecutor(sim.costs, self.clock),  # type: ignore[arg-type]
            clock=self.clock, wall_clock=self.clock)
        self.bm = self.engine.bm
        self.links: dict[str, SimLink] = {}
        self._events: list[WorkerEvent] = []  # the running step's, out at its end
        self.arrival = self.costs.arrival_spread  # a drawn extra per request's first token

    @property
    def has_work(self) -> bool:
        return self.engine.has_work

    def pending_io(self) -> bool:
        return self.sender.has_events

    # ---- commands ------------------------------------------------------------------
    def add(self, leg_id: str, prompt: list[int], max_tokens: int, tenant: str,
            decode: SimDecode, deadline_s: float | None,
            hashes: list[bytes] | None = None) -> None:
        try:
            self.engine.add(prefill_task(leg_id, prompt, max_tokens, tenant, decode.worker_id,
                                         deadline_s))
        except ValueError as e:  # it can never fit this worker: the router rejects it
            self.sim.emit(self.sim.router.on_add_rejected, self, leg_id, str(e))
            return
        if hashes is not None and leg_id in self.engine.jobs:  # hashed by the router's placement
            self.bm.note_hashes(leg_id, hashes)

    def abort(self, leg_id: str) -> None:
        self.engine.abort(leg_id)

    def set_decode_pressure(self, pressure: float) -> None:
        self.engine.scheduler.chunk_policy.observe_decode_pressure(pressure)

    # ---- link events ----------------------------------------------------------------
    def link_to(self, decode_id: str) -> SimLink:
        link = self.links.get(decode_id)
        if link is None:
            link = self.links[decode_id] = self.sim.make_link(self, self.sim.decode_by_id[decode_id])
        return link

    def send_finished(self, leg_id: str) -> None:
        self.sender.finished(leg_id)
        self.io_ready()

    def send_failed(self, leg_id: str, reason: str) -> None:
        self.sender.failed(leg_id, reason)
        self.io_ready()

    # ---- the step -------------------------------------------------------------------
    def start_step(self) -> tuple[float, bool] | None:
        clock = self.clock
        clock.offset = 0.0
        events = self.engine.step()
        duration, clock.offset = clock.offset, 0.0
        if not self.engine.last_step_ran:
            self._deliver(events)
            return None
        self._events = events
        return duration, True

    def end_step(self) -> None:
        events, self._events = self._events, []
        self._deliver(events)

    def _deliver(self, events: list[WorkerEvent]) -> None:
        sim, router = self.sim, self.sim.router
        for ev in events:
            if ev.kind is EventKind.FIRST_TOKEN:
                delay = sim.delivery.first_token_s
                if self.arrival:  # a leg's id is "<request>#<dispatch>#<leg>" (sim/router.py)
                    request_id, _, leg = ev.leg_id.rsplit("#", 2)
                    if leg == "1":  # as the router draws the dispatch: a request's first leg
                        delay = max(delay + self.costs.arrival_extra_s(request_id)[1], 0.0)
                t = ev.timing
                self.loop.at(self.loop.now + delay, router.on_first_token, self, ev.leg_id,
                             ev.finished, {"queue_s": t.queue_s, "prefill_s": t.prefill_s,
                                           "cached_tokens": float(t.cached_tokens)})
            elif ev.kind is EventKind.PREFILL_DONE:
                sim.emit(router.on_prefill_done, self, ev.leg_id, ev.timing.transfer_s)
            else:
                sim.emit(router.on_failed, self, ev.leg_id, ev.message)

    def stats(self) -> dict[str, Any]:
        e = self.engine
        return {"role": self.role, "steps": e.num_steps,
                "mean_step_s": e.step_seconds / e.num_steps if e.num_steps else None,
                "busy_s": e.step_seconds, "kv_bytes_sent": float(self.sender.bytes_sent),
                "chunk_sizes": dict(sorted(e.chunk_sizes.items())),
                "prefix_hits": self.bm.prefix_hits, "prefix_queries": self.bm.prefix_queries}
