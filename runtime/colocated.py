"""ColocatedEngine: engine.LLM (prefill and decode in one engine) as a SteppableEngine
that reports P/D-style events, so one WorkerLoop drives it wherever it runs: in the
server process (cluster/launch/local_backend.py) or as a Ray actor (cluster/launch/colocated_pool.py).

A leg's first token is a FIRST_TOKEN event followed by PREFILL_DONE (no KV travels);
later tokens are TOKENS events, one per request per step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from engine.llm import LLM
from engine.request import Request, RequestStatus
from engine.tombstones import Tombstones
from runtime.messages import EventKind, LegTiming, PrefillTask, WorkerEvent
from runtime.stats import EngineStats, device_stats


@dataclass
class _Leg:
    request: Request
    arrival: float  # monotonic
    scheduled: float | None = None  # its first step began
    first_token: float | None = None
    sent: int = 0  # output tokens reported


class ColocatedEngine:
    def __init__(self, worker_id: str, llm: LLM):
        self.worker_id = worker_id
        self.llm = llm
        self.legs: dict[str, _Leg] = {}
        self.last_step_ran = False
        self.aborted_early = Tombstones()

    @property
    def has_work(self) -> bool:
        return self.llm.has_unfinished()

    def add(self, task: PrefillTask) -> None:
        """Queue a leg; bad input raises ValueError and queues nothing."""
        if self.aborted_early.claim(task.leg_id):
            return  # its abort overtook it (threaded actor): the router already left
        r = self.llm.add_request(list(task.prompt_token_ids), task.sampling, task.leg_id)
        r.tenant = task.tenant
        self.legs[task.leg_id] = _Leg(r, time.monotonic())

    def abort(self, leg_id: str) -> bool:
        leg = self.legs.pop(leg_id, None)
        if leg is None:
            self.aborted_early.bury(leg_id)
            return False
        self.llm.abort(leg_id)
        self.aborted_early.ended(leg_id)
        return True

    def fail_all(self, message: str) -> list[WorkerEvent]:
        events = []
        for leg_id in list(self.legs):
            self.abort(leg_id)
            events.append(WorkerEvent(EventKind.FAILED, leg_id, self.worker_id, message=message))
        return events

    def step(self) -> list[WorkerEvent]:
        start = time.monotonic()
        touched = self.llm.step()
        self.last_step_ran = bool(touched) or self.llm.has_unfinished()
        now = time.monotonic()
        for leg in self.legs.values():
            r = leg.request
            if leg.scheduled is None and (r.status != RequestStatus.WAITING
                                          or r.num_computed_tokens):
                leg.scheduled = start
        events: list[WorkerEvent] = []
        for r in touched:
            leg = self.legs.get(r.request_id)
            if leg is None or leg.request is not r:
                continue
            events += self._report(r.request_id, leg, now)
        return events

    def _report(self, leg_id: str, leg: _Leg, now: float) -> list[WorkerEvent]:
        r = leg.request
        new = tuple(r.output_token_ids[leg.sent:])
        lps = tuple(r.output_logprobs[leg.sent:]) if r.sampling_params.logprobs is not None \
            else None
        leg.sent = len(r.output_token_ids)
        if r.is_finished:
            self.legs.pop(leg_id)
            self.aborted_early.ended(leg_id)
        if leg.first_token is None:
            leg.first_token = now
            scheduled = leg.scheduled if leg.scheduled is not None else now
            timing = LegTiming(queue_s=scheduled - leg.arrival, prefill_s=now - scheduled,
                               cached_tokens=r.prefix_hit_tokens)
            return [WorkerEvent(EventKind.FIRST_TOKEN, leg_id, self.worker_id, new,
                                finish_reason=r.finish_reason, timing=timing, logprobs=lps,
                                prompt_logprobs=r.prompt_logprobs_tuple()),
                    WorkerEvent(EventKind.PREFILL_DONE, leg_id, self.worker_id)]
        timing = LegTiming(decode_s=now - leg.first_token) if r.is_finished else LegTiming()
        return [WorkerEvent(EventKind.TOKENS, leg_id, self.worker_id, new,
                            finish_reason=r.finish_reason, timing=timing, logprobs=lps)]

    def stats(self) -> EngineStats:
        s, bm = self.llm.scheduler, self.llm.block_manager
        return EngineStats(role="colocated", num_running=len(s.running),
                           num_waiting=len(s.waiting), kv_blocks_used=bm.num_used_blocks,
                           kv_blocks_free=bm.num_free_blocks, num_steps=self.llm.num_steps,
                           **device_stats(self.llm.runner))
