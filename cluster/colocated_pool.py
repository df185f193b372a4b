"""A pool of colocated engines as Ray actors: the baseline of the interference study.

Each actor runs a whole `engine.LLM` (prefill and decode on one worker, chunked prefill
on or off) behind the same actor interface as the P/D workers, so the same Router
spreads requests over them (least outstanding tokens ~ round-robin for equal loads)
and the same client measures both layouts.
"""

from __future__ import annotations

import time
from typing import Any

import ray

from cluster.worker_base import ACTOR_CONCURRENCY, WorkerBase
from cluster.worker_runtime import WorkerLoop
from cluster.worker_spec import WorkerSpec
from engine.llm import LLM
from engine.messages import FIRST_TOKEN, PREFILL_DONE, TOKENS, DecodeTask, PrefillTask, WorkerEvent
from engine.tombstones import Tombstones


class ColocatedEngine:
    """Adapts engine.LLM to the WorkerLoop protocol, reporting P/D-style events."""

    def __init__(self, worker_id: str, llm: LLM):
        self.worker_id = worker_id
        self.llm = llm
        self.sent: dict[str, int] = {}
        self.arrival: dict[str, float] = {}
        self.last_step_ran = False
        self.aborted_early = Tombstones()

    @property
    def has_work(self) -> bool:
        return self.llm.has_unfinished()

    def add(self, task: PrefillTask) -> None:
        if self.aborted_early.claim(task.request_id):
            return  # its abort overtook it (threaded actor): the router already left
        self.llm.add_request(list(task.prompt_token_ids), task.sampling, task.request_id)
        self.sent[task.request_id] = 0
        self.arrival[task.request_id] = time.monotonic()

    def abort(self, request_id: str) -> bool:
        self.llm.abort(request_id)
        self.arrival.pop(request_id, None)
        if self.sent.pop(request_id, None) is None:
            self.aborted_early.bury(request_id)
            return False
        return True

    def step(self) -> list[WorkerEvent]:
        touched = self.llm.step()
        self.last_step_ran = bool(touched) or self.llm.has_unfinished()
        events: list[WorkerEvent] = []
        for r in touched:
            rid = r.request_id
            if rid not in self.sent:
                continue
            new = tuple(r.output_token_ids[self.sent[rid]:])
            first = self.sent[rid] == 0
            self.sent[rid] = len(r.output_token_ids)
            reason = r.finish_reason.value if r.is_finished else None
            timing = {}
            if first:
                timing = {"prefill_s": time.monotonic() - self.arrival[rid],
                          "cached_tokens": float(r.prefix_hit_tokens)}
            events.append(WorkerEvent(FIRST_TOKEN if first else TOKENS, rid, self.worker_id,
                                      new, finish_reason=reason, timing=timing))
            if first:
                events.append(WorkerEvent(PREFILL_DONE, rid, self.worker_id))
            if r.is_finished:
                self.sent.pop(rid, None)
                self.arrival.pop(rid, None)
        return events

    def stats(self) -> dict[str, float]:
        s = self.llm.stats()
        return {"num_running": s["num_requests_running"], "num_waiting": s["num_requests_waiting"],
                "kv_blocks_used": s["kv_blocks_used"], "kv_blocks_free": s["kv_blocks_free"],
                "num_steps": self.llm.num_steps}


class ColocatedWorker(WorkerBase):
    """One colocated engine; plays both pool roles for the Router."""

    def __init__(self, spec: WorkerSpec, enable_chunked_prefill: bool):
        super().__init__(spec)
        llm = LLM(spec.model_dir, block_size=spec.block_size,
                  max_num_batched_tokens=spec.max_num_batched_tokens,
                  max_prefill_chunk=spec.prefill.get("max_chunk"),
                  enable_chunked_prefill=enable_chunked_prefill,
                  enable_prefix_caching=spec.enable_prefix_caching, num_blocks=self.num_blocks,
                  device=self.cfg.device, dtype=spec.dtype,
                  attention_backend=spec.attention_backend, max_num_seqs=spec.max_num_seqs,
                  compile=spec.compile,
                  max_model_len=spec.max_model_len,
                  kv_cache_memory_bytes=spec.kv_cache_memory_bytes)
        self.engine = ColocatedEngine(spec.worker_id, llm)
        self.loop = WorkerLoop(self.engine, thread_init=llm.runner.bind)

    def reserve(self, task: DecodeTask) -> bool:
        return True  # the colocated engine admits and preempts on its own

    def add(self, task: PrefillTask) -> None:
        self.loop.call(lambda: self.engine.add(task))

    def set_decode_pressure(self, pressure: float) -> None:
        pass

    def ready(self) -> dict[str, Any]:
        info = super().ready()
        info["endpoint"] = "colocated"
        return info


RemoteColocatedWorker = ray.remote(max_concurrency=ACTOR_CONCURRENCY)(ColocatedWorker)
