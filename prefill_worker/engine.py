"""PrefillEngine: the Ray-free core of a prefill worker.

Each step runs one batch of prompt chunks, exports every chunk's KV (a token range, so
the decode side may use another block size) to the connector, samples the first token
when a prompt completes, and reports events for the router.

The step's events go out first: its chunks are exported in the step, but handed to the
connector at the start of the next step (which the loop runs at once after a step that
ran), so the first token's message never waits on KV framing or on waking a link; the
decode side gets the first token from the router or from the final chunk, whichever
comes first. The connector is polled only while legs here have KV in flight.

Layer-wise (``layerwise_groups`` > 0, ``transfer.layerwise``): a prompt's final chunk,
the one whose transfer no later chunk's compute can hide, is exported by groups of
layers (``KVCache.export_layerwise``) and handed to the connector as soon as its step is
launched, before the step's end is waited for, so its first layers are on the wire
while its later layers compute (``KVChunk.layers_ready``); its first token, sampled at
the step's end, is bound to it then and travels on its last piece (docs/design.md §4).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.execute import Sampled, launch_and_sample
from engine.kv_cache import LayerwiseExport
from engine.request import Request, RequestStatus
from engine.tombstones import Tombstones
from engine.tp_driver import make_runner
from engine.tracing import TraceRecorder
from engine.validation import validate_prompt
from kv_transfer.base import KVChunk, KVSender
from prefill_worker.scheduler import PrefillScheduler, PrefillSchedulerConfig
from runtime.messages import EventKind, LegTiming, PrefillTask, WorkerEvent
from runtime.stats import PrefillStats, device_stats
from runtime.tp_links import SEP

log = logging.getLogger(__name__)


class _Job:
    # a plain class: a dataclass's generated __init__ runs interpreted even where this
    # module is compiled (the simulator's `make sim-fast`), and there is one per leg
    __slots__ = ("task", "request", "arrival", "seq_no", "first_scheduled", "prefill_end")

    def __init__(self, task: PrefillTask, request: Request, arrival: float):
        self.task = task
        self.request = request
        self.arrival = arrival  # monotonic
        self.seq_no = 0
        self.first_scheduled: float | None = None
        self.prefill_end: float | None = None


def _in_vocab(ids: tuple[int, ...], vocab: int) -> bool:
    """validate_prompt's token test in one pass (min() and max() are two, and stay calls
    into the interpreter where mypyc compiles this module: `make sim-fast`)."""
    for t in ids:
        if not 0 <= t < vocab:
            return False
    return True


class PrefillEngine:
    def __init__(
        self,
        worker_id: str,
        config: EngineConfig,
        sched_config: PrefillSchedulerConfig,
        sender: KVSender,
        num_blocks: int,
        tracer: TraceRecorder | None = None,
        layerwise_groups: int = 0,
        runner: Any = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ):
        """``layerwise_groups``: send each prompt's final chunk in this many groups of
        layers while its step runs (0: whole, after the step). ``clock`` and
        ``wall_clock``: what the engine reads for time.monotonic and time.time (the
        simulator's virtual clock, sim/prefill.py)."""
        self.worker_id = worker_id
        self.clock, self.wall_clock = clock, wall_clock
        self.layerwise_groups = layerwise_groups
        self.config = config
        # rank 0's, under TP; ``runner``: one that another engine ran (a role switch)
        self.runner = make_runner(config, num_blocks) if runner is None else runner
        self.bm = BlockManager(num_blocks, config.cache.block_size,
                               config.cache.enable_prefix_caching)
        self.scheduler = PrefillScheduler(sched_config, self.bm, clock=clock)
        self.sender = sender  # poll, abort, stats; and sends to a one-rank decode worker
        # sends to a decode worker of several ranks (its endpoint lists theirs, joined with
        # SEP) go through this one (runtime.tp_links.HeadSender: chunks cut by KV heads);
        # None: `sender` takes every send (one-rank decode pools, or a TP prefill group)
        self.rank_sender: KVSender | None = None
        self.tracer = tracer if tracer is not None else TraceRecorder(enabled=False)
        self.jobs: dict[str, _Job] = {}  # by leg id
        self.num_steps = 0
        self.last_step_ran = False
        self.chunk_sizes: dict[int, int] = {}  # chunk size -> chunks run (cumulative)
        self._handoff: deque[tuple] = deque()  # exported this step, sent at the next one's
        self._shipping: set[str] = set()  # legs with KV handed to the sender, not yet done
        self.step_seconds = 0.0
        self.aborted_early = Tombstones()

    # ---- commands (called on the worker's loop thread) ----------------------------------
    def add(self, task: PrefillTask) -> None:
        """Queue a prompt; bad input raises ValueError and queues nothing."""
        ids, vocab, max_len = (task.prompt_token_ids, self.config.model.vocab_size,
                               self.config.scheduler.max_model_len)
        # a front door has validated it; a worker still refuses what would break its step
        # (this test passes for every valid prompt; the message comes from the check)
        if not (0 < len(ids) < max_len and _in_vocab(ids, vocab)):
            validate_prompt(ids, vocab, max_len)
        if task.leg_id in self.jobs:
            raise ValueError(f"leg {task.leg_id!r} is already active")
        t, leg = self.aborted_early, task.leg_id
        if (leg in t.buried or leg in t.ended_ids) and t.claim(leg):
            return  # its abort overtook it: the router has already ended this leg
        req = Request(task.leg_id, list(task.prompt_token_ids), task.sampling,
                      eos_token_ids=task.eos_token_ids, tenant=task.tenant)
        # ValueError if it can never fit
        self.scheduler.add(req, task.ttft_deadline_s, task.priority)
        self.jobs[task.leg_id] = _Job(task, req, self.clock())

    def abort(self, leg_id: str) -> bool:
        """End the job here; an abort for an id not held here is either late (it ended
        here already: a no-op) or early (it overtook its add: a tombstone)."""
        try:  # in order (a TP group's ranks pair exports with sends), then drop
            self._hand_off()
        except Exception:  # a broken connector: the abort goes on, the rest is moot
            log.exception("handing KV over to the connector failed; dropping %d chunk(s)",
                          len(self._handoff))
            self._handoff.clear()
        job = self._end(leg_id)
        if job is None:
            self.aborted_early.bury(leg_id)
        self.scheduler.abort(leg_id)
        self.sender.abort(leg_id)
        return job is not None

    def fail_all(self, message: str) -> list[WorkerEvent]:
        """End every job (a step failed): free its blocks, drop its queued KV."""
        events = []
        for leg_id in list(self.jobs):
            self.abort(leg_id)
            events.append(WorkerEvent(EventKind.FAILED, leg_id, self.worker_id,
                                      message=message))
        return events

    def _end(self, leg_id: str) -> _Job | None:
        """Forget a job that ended here (any status); its id is free again at once."""
        job = self.jobs.pop(leg_id, None)
        if job is not None:
            self.aborted_early.ended(leg_id)
        self._shipping.discard(leg_id)
        return job

    # ---- the step -----------------------------------------------------------------------
    def step(self) -> list[WorkerEvent]:
        self._hand_off()
        events = self._poll_sender() if self._shipping else []
        # (an idle scheduler decides nothing: most calls only hand KV off or poll acks)
        items = self.scheduler.schedule() if self.scheduler.has_work else []
        self.last_step_ran = bool(items)
        if not items:
            return events
        t0, wall0 = self.clock(), self.wall_clock()
        for item in items:
            job = self.jobs[item.request.request_id]
            if job.first_scheduled is None:
                job.first_scheduled = t0
        launch = launch_and_sample(self.runner, items)
        early: dict[str, LayerwiseExport] = {}  # final chunks sent by layers, by leg
        try:
            if self.layerwise_groups:
                self._send_layerwise(items, early)
            # only a prompt's last chunk samples: its first token
            firsts = {s.request.request_id: s for s in launch.result()}
            self.scheduler.advance(items)
            compute_s = self.clock() - t0  # the trace span: compute only, not KV export
            for item in items:
                rid = item.request.request_id
                events += self._ship(item, firsts.get(rid), early.get(rid))
                self.chunk_sizes[item.num_tokens] = self.chunk_sizes.get(item.num_tokens, 0) + 1
        finally:  # a step that failed fails the chunks it sent by layers (bound ones stay)
            for lw in early.values():
                lw.fail(RuntimeError("the prefill step failed"))
        dt = self.clock() - t0
        self.num_steps += 1
        self.step_seconds += dt
        if self.tracer.enabled:
            batch_tokens = sum(i.num_tokens for i in items)
            device = {}
            window = getattr(self.runner, "step_window", None)  # the emulated device's
            if window is not None:  # its step on the device timeline, in wall seconds
                off = self.wall_clock() - self.clock()
                device = {"device_start": window[0] + off,
                          "device_end": window[0] + window[1] + off}
            for item in items:
                held = self.jobs.get(item.request.request_id)
                self.tracer.record(
                    item.request.request_id, "prefill_chunk", wall0, wall0 + compute_s,
                    worker=self.worker_id, chunk_id=(held.seq_no if held else None),
                    token_start=item.start, token_end=item.start + item.num_tokens,
                    scheduled_tokens=item.num_tokens, past_kv_tokens=item.start,
                    prefix_hit_tokens=item.request.prefix_hit_tokens,
                    batch_num_seqs=len(items), batch_num_tokens=batch_tokens,
                    tenant=item.request.tenant, **device)
        return events

    def _layerwise_dest(self, task: PrefillTask) -> bool:
        """Whether a leg's final chunk may go by layers: to one receiver through this
        worker's own sender (a chunk cut by KV heads for a multi-rank decode worker is
        copied on the caller's thread, which would wait for the whole step; a TP prefill
        group pairs each rank's exports with its sends)."""
        return (self.config.tensor_parallel_size == 1
                and not (self.rank_sender is not None and SEP in task.decode_endpoint))

    def _send_layerwise(self, items, out: dict[str, LayerwiseExport]) -> None:
        """Hand the final chunks of the step just launched to the connector, exported by
        groups of layers (into ``out``, by leg, before each is sent); their first tokens
        are bound once the step's result is in."""
        for item in items:
            job = self.jobs[item.request.request_id]
            if not item.completes_prefill or not self._layerwise_dest(job.task):
                continue
            if job.seq_no == 0 and item.start > 0:  # its prefix-cache hit goes first
                self._send(job, 0, item.start, final=False)
            self._hand_off()
            end = item.start + item.num_tokens
            lw = self.runner.kv.export_layerwise(job.request.block_ids, item.start, end,
                                                 self.layerwise_groups)
            task = job.task
            out[task.leg_id] = lw
            self.sender.send(KVChunk(task.leg_id, job.seq_no, item.start, end, lw.payload,
                                     is_final=True, tenant=task.tenant, layers_ready=lw),
                             dest=task.decode_endpoint)
            self._shipping.add(task.leg_id)
            job.seq_no += 1

    def _ship(self, item, first: Sampled | None,
              layerwise: LayerwiseExport | None = None) -> list[WorkerEvent]:
        r = item.request
        job = self.jobs[r.request_id]
        if job.seq_no == 0 and item.start > 0:  # prefix-cache hit: its KV must travel too
            self._send(job, 0, item.start, final=False)
        if layerwise is not None and first is None:  # cannot be: only a final chunk samples
            layerwise.fail(RuntimeError("the chunk sent by layers sampled no token"))
        if first is None:
            self._send(job, item.start, item.start + item.num_tokens, final=False)
            return []
        now = self.clock()
        job.prefill_end = now
        began = job.first_scheduled if job.first_scheduled is not None else now
        timing = LegTiming(queue_s=began - job.arrival, prefill_s=now - began,
                           cached_tokens=r.prefix_hit_tokens)
        first_token = first.token_id
        r.append_token(first_token)
        ended = r.is_finished  # e.g. EOS or max_tokens == 1: the decode side is not needed
        if ended:
            self._hand_off()  # its prefix chunk, if any, goes (and is dropped) in order
            self.sender.abort(r.request_id)
            if layerwise is not None:  # dropped by the abort: its link thread goes on
                layerwise.bind_first_token(None)
            self._end(r.request_id)
        elif layerwise is not None:  # sent already: its last piece carries the token
            layerwise.bind_first_token(first_token)
        else:
            self._send(job, item.start, item.start + item.num_tokens, final=True,
                       first_token=first_token)
        self.scheduler.finish(r, r.status if ended else RequestStatus.RUNNING)
        # the prompt's log-probs, complete now, travel with the first token
        return [WorkerEvent(EventKind.FIRST_TOKEN, r.request_id, self.worker_id,
                            (first_token,), finish_reason=r.finish_reason if ended else None,
                            timing=timing,
                            logprobs=None if first.logprobs is None else (first.logprobs,),
                            prompt_logprobs=r.prompt_logprobs_tuple())]

    def _send(self, job: _Job, start: int, end: int, final: bool,
              first_token: int | None = None) -> None:
        # the copy is ordered before any later write of these blocks; the link thread
        # waits for it, so this thread goes on to the next chunk at once
        pending = self.runner.kv.export_async(job.request.block_ids, start, end)
        self._handoff.append((job.task, job.seq_no, start, end, final, first_token, pending))
        job.seq_no += 1

    def _hand_off(self) -> None:
        """Give the exported chunks to the connector, in order (also those of a leg being
        aborted: the sender then drops them, and a TP group's ranks, which pair each
        export with its send, stay in step)."""
        while self._handoff:  # one at a time: a send that raises leaves the rest queued
            task, seq_no, start, end, final, first_token, pending = self._handoff.popleft()
            chunk = KVChunk(task.leg_id, seq_no, start, end, pending.payload, is_final=final,
                            first_token=first_token, tenant=task.tenant,
                            ready=None if pending.event is None else pending)
            dest, ranks = task.decode_endpoint, self.rank_sender
            (ranks if ranks is not None and SEP in dest else self.sender).send(chunk, dest=dest)
            if task.leg_id in self.jobs:
                self._shipping.add(task.leg_id)

    def _poll_sender(self) -> list[WorkerEvent]:
        ev = self.sender.poll()
        out: list[WorkerEvent] = []
        clock = self.clock
        for leg_id in ev.finished:
            job = self._end(leg_id)
            if job is not None:
                now = clock()
                end = job.prefill_end if job.prefill_end is not None else now
                out.append(WorkerEvent(EventKind.PREFILL_DONE, leg_id, self.worker_id,
                                       timing=LegTiming(transfer_s=now - end)))
        for leg_id, reason in ev.failed:
            if self._end(leg_id) is not None:
                self.scheduler.abort(leg_id)
                out.append(WorkerEvent(EventKind.FAILED, leg_id, self.worker_id,
                                       message=f"KV transfer failed: {reason}"))
        for rec in ev.records if self.tracer.enabled else ():
            self.tracer.record(request_id=rec.request_id, phase="kv_send",
                               worker=f"link:{self.worker_id}->{rec.dest}",
                               start=self.wall_clock() - (clock() - rec.start_t),
                               end=self.wall_clock() - (clock() - rec.end_t),
                               bytes=rec.nbytes, chunk_id=rec.seq_no)
        return out

    @property
    def kv_in_flight(self) -> int:
        """Legs whose KV is exported or sending (0 once every leg ended: a leak check)."""
        return len(self._shipping) + len(self._handoff)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self.jobs)

    def stats(self) -> PrefillStats:
        kv = self.sender.stats()
        return PrefillStats(
            role="prefill",
            num_running=len(self.scheduler.active),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=self.bm.num_used_blocks,
            kv_blocks_free=self.bm.num_free_blocks,
            num_steps=self.num_steps,
            mean_step_s=self.step_seconds / max(1, self.num_steps),
            send_queue_depth=int(kv.get("active_requests", 0)),
            jobs=len(self.jobs),
            outstanding_prefill_tokens=self.scheduler.num_outstanding_tokens,
            chunk_cap=self.scheduler.chunk_policy.cap,
            chunk_sizes=dict(self.chunk_sizes),
            kv_bytes_sent=float(kv.get("bytes_sent", 0)),
            kv_frames_sent=float(kv.get("frames_sent", 0)),
            kv_send_queue_s=float(kv.get("queue_wait_s", 0.0)),
            kv_transfer_s=float(kv.get("transfer_s", 0.0)),
            kv_inflight_bytes=float(kv.get("inflight_bytes", 0)),
            kv_queued_bytes=float(kv.get("queued_bytes", 0) + kv.get("export_wait_bytes", 0)),
            kv_send_failures=float(kv.get("failures", 0)),
            **device_stats(self.runner),
        )
