"""PrefillEngine: the Ray-free core of a prefill worker.

Each step runs one batch of prompt chunks, exports every chunk's KV (a token range, so
the decode side may use another block size) to the connector, samples the first token
when a prompt completes, and reports events for the router.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.messages import FAILED, FIRST_TOKEN, PREFILL_DONE, PrefillTask, WorkerEvent
from engine.model_runner import ModelRunner
from engine.request import Request, RequestStatus
from engine.sampler import sample
from engine.tombstones import Tombstones
from engine.tracing import TraceRecorder
from engine.validation import validate_prompt
from kv_transfer.base import KVChunk, KVSender
from prefill_worker.scheduler import PrefillScheduler, PrefillSchedulerConfig


@dataclass
class _Job:
    task: PrefillTask
    request: Request
    arrival: float  # monotonic
    seq_no: int = 0
    first_scheduled: float | None = None
    prefill_end: float | None = None
    timing: dict[str, float] = field(default_factory=dict)


class PrefillEngine:
    def __init__(
        self,
        worker_id: str,
        config: EngineConfig,
        sched_config: PrefillSchedulerConfig,
        sender: KVSender,
        num_blocks: int,
        tracer: TraceRecorder | None = None,
    ):
        self.worker_id = worker_id
        self.config = config
        self.runner = ModelRunner(config, num_blocks)
        self.bm = BlockManager(num_blocks, config.cache.block_size,
                               config.cache.enable_prefix_caching)
        self.scheduler = PrefillScheduler(sched_config, self.bm)
        self.sender = sender
        self.tracer = tracer if tracer is not None else TraceRecorder(enabled=False)
        self.jobs: dict[str, _Job] = {}
        self.num_steps = 0
        self.last_step_ran = False
        self.chunk_sizes: dict[int, int] = {}  # chunk size -> chunks run (cumulative)
        self.step_seconds = 0.0
        self.aborted_early = Tombstones()

    # ---- commands (called on the worker's loop thread) ----------------------------------
    def add(self, task: PrefillTask) -> None:
        """Queue a prompt; bad input raises ValueError and queues nothing."""
        validate_prompt(task.prompt_token_ids, self.config.model.vocab_size,
                        self.config.scheduler.max_model_len)
        if task.request_id in self.jobs:
            raise ValueError(f"request_id {task.request_id!r} is already active")
        if self.aborted_early.claim(task.request_id):
            return  # its abort overtook it: the router has already ended this leg
        req = Request(task.request_id, list(task.prompt_token_ids), task.sampling,
                      eos_token_ids=task.eos_token_ids, tenant=task.tenant)
        self.scheduler.add(req, task.ttft_deadline_s)  # ValueError if it can never fit
        self.jobs[task.request_id] = _Job(task, req, time.monotonic())

    def abort(self, request_id: str) -> bool:
        """End the job here; an abort for an id not held here is either late (it ended
        here already: a no-op) or early (it overtook its add: a tombstone)."""
        job = self._end(request_id)
        if job is None:
            self.aborted_early.bury(request_id)
        self.scheduler.abort(request_id)
        self.sender.abort(request_id)
        return job is not None

    def _end(self, request_id: str) -> _Job | None:
        """Forget a job that ended here (any status); its id is free again at once."""
        job = self.jobs.pop(request_id, None)
        if job is not None:
            self.aborted_early.ended(request_id)
        return job

    # ---- the step -----------------------------------------------------------------------
    def step(self) -> list[WorkerEvent]:
        events = self._poll_sender()
        items = self.scheduler.schedule()
        self.last_step_ran = bool(items)
        if not items:
            return events
        t0, wall0 = time.monotonic(), time.time()
        for item in items:
            job = self.jobs[item.request.request_id]
            if job.first_scheduled is None:
                job.first_scheduled = t0
        ids, logits = self.runner.execute([i.to_chunk() for i in items])
        self.scheduler.advance(items)
        # execute() returns its sampled rows in its own order (1-token chunks first)
        finishing = {i.request.request_id: i.request for i in items if i.completes_prefill}
        done = [finishing[rid] for rid in ids]
        firsts = dict(zip(ids, sample(
            logits, [r.sampling_params for r in done], [r.generator for r in done]
        ), strict=True)) if done else {}
        compute_s = time.monotonic() - t0  # the trace span: compute only, not KV export
        for item in items:
            events += self._ship(item, firsts.get(item.request.request_id))
            self.chunk_sizes[item.num_tokens] = self.chunk_sizes.get(item.num_tokens, 0) + 1
        dt = time.monotonic() - t0
        self.num_steps += 1
        self.step_seconds += dt
        if self.tracer.enabled:
            batch_tokens = sum(i.num_tokens for i in items)
            for item in items:
                job = self.jobs.get(item.request.request_id)
                self.tracer.record(
                    item.request.request_id, "prefill_chunk", wall0, wall0 + compute_s,
                    worker=self.worker_id, chunk_id=(job.seq_no if job else None),
                    token_start=item.start, token_end=item.start + item.num_tokens,
                    scheduled_tokens=item.num_tokens, past_kv_tokens=item.start,
                    prefix_hit_tokens=item.request.prefix_hit_tokens,
                    batch_num_seqs=len(items), batch_num_tokens=batch_tokens,
                    tenant=item.request.tenant)
        return events

    def _ship(self, item, first_token: int | None) -> list[WorkerEvent]:
        r = item.request
        job = self.jobs[r.request_id]
        if job.seq_no == 0 and item.start > 0:  # prefix-cache hit: its KV must travel too
            self._send(job, 0, item.start, final=False)
        final = first_token is not None
        if not final:
            self._send(job, item.start, item.start + item.num_tokens, final=False)
            return []
        now = time.monotonic()
        job.prefill_end = now
        job.timing.update(
            queue_s=(job.first_scheduled or now) - job.arrival,
            prefill_s=now - (job.first_scheduled or now),
            cached_tokens=float(r.prefix_hit_tokens),
        )
        r.append_token(first_token)
        ended = r.is_finished  # e.g. EOS or max_tokens == 1: the decode side is not needed
        if ended:
            self.sender.abort(r.request_id)
            self._end(r.request_id)
        else:
            self._send(job, item.start, item.start + item.num_tokens, final=True,
                       first_token=first_token)
        self.scheduler.finish(r, r.status if ended else RequestStatus.RUNNING)
        return [WorkerEvent(
            FIRST_TOKEN, r.request_id, self.worker_id, (first_token,),
            finish_reason=r.finish_reason.value if ended else None, timing=dict(job.timing),
        )]

    def _send(self, job: _Job, start: int, end: int, final: bool,
              first_token: int | None = None) -> None:
        payload = self.runner.kv.export_tokens(job.request.block_ids, start, end)
        chunk = KVChunk(job.task.request_id, job.seq_no, start, end, payload, is_final=final,
                        first_token=first_token, tenant=job.task.tenant)
        job.seq_no += 1
        self.sender.send(chunk, dest=job.task.decode_endpoint)

    def _poll_sender(self) -> list[WorkerEvent]:
        ev = self.sender.poll()
        out: list[WorkerEvent] = []
        for rid in ev.finished:
            job = self._end(rid)
            if job is not None:
                end = job.prefill_end or time.monotonic()
                out.append(WorkerEvent(PREFILL_DONE, rid, self.worker_id,
                                       timing={"transfer_s": time.monotonic() - end}))
        for rid, reason in ev.failed:
            if self._end(rid) is not None:
                self.scheduler.abort(rid)
                out.append(WorkerEvent(FAILED, rid, self.worker_id,
                                       message=f"KV transfer failed: {reason}"))
        for rec in ev.records:
            self.tracer.record(request_id=rec.request_id, phase="kv_send",
                               worker=f"link:{self.worker_id}->{rec.dest}",
                               start=time.time() - (time.monotonic() - rec.start_t),
                               end=time.time() - (time.monotonic() - rec.end_t),
                               bytes=rec.nbytes)
        return out

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self.jobs)

    def stats(self) -> dict[str, float]:
        kv = self.sender.stats()
        return {
            "chunk_sizes": dict(self.chunk_sizes),
            "kv_bytes_sent": float(kv.get("bytes_sent", 0)),
            "kv_frames_sent": float(kv.get("frames_sent", 0)),
            "kv_send_queue_s": float(kv.get("queue_wait_s", 0.0)),
            "kv_transfer_s": float(kv.get("transfer_s", 0.0)),
            "kv_inflight_bytes": float(kv.get("inflight_bytes", 0)),
            "kv_queued_bytes": float(kv.get("queued_bytes", 0)),
            "kv_send_failures": float(kv.get("failures", 0)),
            "send_queue_depth": float(kv.get("active_requests", 0)),
            "num_running": len(self.scheduler.active),
            "num_waiting": len(self.scheduler.waiting),
            "kv_blocks_used": self.bm.num_used_blocks,
            "kv_blocks_free": self.bm.num_free_blocks,
            "outstanding_prefill_tokens": self.scheduler.num_outstanding_tokens,
            "jobs": len(self.jobs),
            "chunk_cap": self.scheduler.chunk_policy.cap,
            "num_steps": self.num_steps,
            "mean_step_s": self.step_seconds / max(1, self.num_steps),
        }
