"""DecodeEngine: the Ray-free core of a decode worker.

Each step: take arrived KV chunks from the connector into this worker's own blocks
(token ranges -> local slots, any block size), start requests whose KV and first token
are complete, then run one continuous-batching decode step over every running request
and report all new tokens of the step together. KV that overtakes its leg's reserve (the
router sends reserve and the prefill's add at once) waits in EarlyKV until it comes.

With ``stream_interval`` N > 1 a leg's tokens are reported every N tokens, as the front
door streams them (SGLang's scheduler does the same): a step's message then carries a
token for one leg in N, so the router and the channel do per-token work once per N
tokens. A leg's first decode step (it carries the first token), a finish, log-probs and
a preemption or failure report at once what the leg holds; an abort drops it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from decode_worker.early_kv import EarlyKV, EarlyKVConfig
from decode_worker.intake import KVIntake, Landed
from decode_worker.scheduler import DecodeScheduler, DecodeSchedulerConfig
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.execute import (
    Sampled,
    ScheduledItem,
    StepLaunch,
    execute_and_sample,
    launch_and_sample,
)
from engine.request import Request, RequestStatus
from engine.tombstones import Tombstones
from engine.tp_driver import make_runner
from engine.tracing import TraceRecorder
from kv_transfer.base import KVChunk, KVReceiver
from runtime.messages import NO_TIMING, DecodeTask, EventKind, LegTiming, WorkerEvent
from runtime.stats import DecodeStats, device_stats

if TYPE_CHECKING:
    from kv_transfer.faults import FaultInjector


_HANDED = "handed to the intake"  # _write's: the range is on the intake's thread


@dataclass(slots=True)
class _InFlight:
    """The step on the device while the host works one step ahead."""

    launch: StepLaunch
    items: list[ScheduledItem]
    t0: float
    wall0: float


class DecodeEngine:
    def __init__(
        self,
        worker_id: str,
        config: EngineConfig,
        sched_config: DecodeSchedulerConfig,
        receiver: KVReceiver,
        num_blocks: int,
        tracer: TraceRecorder | None = None,
        faults: FaultInjector | None = None,
        early: EarlyKVConfig | None = None,
        stream_interval: int = 1,
        runner: Any = None,
    ):
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.worker_id = worker_id
        self.stream_interval = stream_interval
        self._held: dict[str, list[int]] = {}  # leg -> tokens not reported yet
        self.faults = faults  # fault injection (tests only): may refuse admission
        self.config = config
        # rank 0's, under TP; ``runner``: one that another engine ran (a role switch)
        self.runner = make_runner(config, num_blocks) if runner is None else runner
        self.bm = BlockManager(num_blocks, config.cache.block_size, enable_prefix_caching=False)
        self.scheduler = DecodeScheduler(sched_config, self.bm)
        self.receiver = receiver
        self.tracer = tracer if tracer is not None else TraceRecorder(enabled=False)
        self.started: dict[str, float] = {}  # leg id -> monotonic decode start
        self.aborted_early = Tombstones()
        self.early = EarlyKV(early, self.aborted_early)  # KV that came before its reserve
        self._ready: list[KVChunk] = []  # early chunks whose reserve came: written first
        self._ready_complete: list[str] = []  # ... and the legs all of whose KV was in
        self.max_len = min(config.scheduler.max_model_len, self.scheduler.max_len)
        self.num_steps = 0
        self.last_step_ran = False
        self.step_seconds = 0.0
        self.overlap = sched_config.overlap  # the host one step ahead (docs/design.md §3)
        self._inflight: _InFlight | None = None  # (overlap) the step on the device
        # (overlap) the KV's check and copy off the loop thread, joined within each step
        # call (decode_worker/intake.py); None: inline, as the serial loop does
        self._intake = KVIntake.for_cache(self.runner.kv) if self.overlap else None
        self._landed: list[Landed] = []  # joined, not yet taken in

    # ---- commands -------------------------------------------------------------------
    def reserve(self, task: DecodeTask) -> bool:
        t, leg = self.aborted_early, task.leg_id
        if self.faults is not None and self.faults.refuse_admission(leg):
            ok = False  # as if full: the router tries another worker, then waits
        elif (leg in t.buried or leg in t.ended_ids) and t.claim(leg):
            ok = False  # its abort (or its early KV's loss) overtook it
        else:
            try:
                ok = self.scheduler.reserve(task)
            except ValueError:
                self.early.on_reserve(leg, False, self.receiver)
                raise
        held = self.early.on_reserve(leg, ok, self.receiver)  # KV that came before it
        if not ok:
            return False
        self.receiver.expect(leg)
        if held is not None:  # written at the next step, before anything newer
            self._ready += held.chunks
            if held.complete:
                self._ready_complete.append(leg)
        return True

    def abort(self, leg_id: str) -> bool:
        """End the leg here; an abort for an id not held here is either late (it ended
        here already: a no-op) or early (it overtook its reserve: a tombstone)."""
        self.receiver.abort(leg_id)
        if self._end(leg_id):
            return True
        self.early.drop(leg_id, "aborted")
        self.aborted_early.bury(leg_id)
        return False

    def fail_all(self, message: str) -> list[WorkerEvent]:
        """Fail every leg held here (a step failed): free its blocks, drop its frames."""
        self._inflight = None  # (overlap) the step in flight is lost with its legs
        self._settle()
        events = self._take_landed()
        for leg_id in list(self.early.held):
            self.early.close(leg_id, "failed", self.receiver)
        held = list(self.scheduler.pending) + [r.request_id for r in self.scheduler.running]
        return events + [e for leg_id in held for e in self._fail(leg_id, message)]

    def _settle(self, leg_id: str | None = None) -> None:
        """Wait for the ranges handed to the intake (``leg_id``: up to that leg's), before
        their blocks are freed."""
        if self._intake is not None and self._intake.busy:
            self._landed += self._intake.join(leg_id)

    def _end(self, leg_id: str) -> bool:
        """Forget a leg that ended here (any status); its id is free again at once."""
        self._settle(leg_id)  # none of its ranges still being written into its blocks
        self.started.pop(leg_id, None)
        self._held.pop(leg_id, None)
        known = self.scheduler.abort(leg_id) is not None
        if known:
            self.aborted_early.ended(leg_id)
        return known

    def _fail(self, leg_id: str, message: str) -> list[WorkerEvent]:
        """Fail one leg (e.g. its KV intake went wrong): free it, drop its frames."""
        self.receiver.abort(leg_id)
        held = self._flush(leg_id)
        if not self._end(leg_id) and not self.early.close(leg_id, "failed", self.receiver):
            return held
        return [*held, WorkerEvent(EventKind.FAILED, leg_id, self.worker_id, message=message)]

    def _flush(self, leg_id: str) -> list[WorkerEvent]:
        """The leg's held tokens as one TOKENS event (before it leaves this worker other
        than by an abort: what it generated is the router's to keep)."""
        held = self._held.pop(leg_id, None)
        if not held:
            return []
        return [WorkerEvent(EventKind.TOKENS, leg_id, self.worker_id, tuple(held), None, "",
                            time.time())]

    def keepalive(self, leg_ids: list[str]) -> int:
        return self.scheduler.touch(leg_ids, time.monotonic())

    def headroom_blocks(self) -> int:
        return self.scheduler.promised_free_blocks()

    # ---- the step -------------------------------------------------------------------
    def step(self) -> list[WorkerEvent]:
        if self.overlap:
            return self._step_ahead()
        events = self._take_kv()
        events += self._expire()
        items, preempted = self.scheduler.schedule()
        events += self._preempted(preempted)
        self.last_step_ran = bool(items)
        if not items:
            return events
        t0, wall0 = time.monotonic(), time.time()
        sampled = execute_and_sample(self.runner, items)
        now, wall = time.monotonic(), time.time()
        max_len, running = self.max_len, RequestStatus.RUNNING
        for s in sampled:  # (locals: these loops run once per generated token)
            r = s.request
            r.num_cached_tokens += 1
            r.append_token(s.token_id)
            if r.status == running and len(r.prompt_token_ids) + len(r.output_token_ids) \
                    >= max_len:
                r.status = RequestStatus.FINISHED_LENGTH
        self._report(sampled, events, now, wall)
        self._account(sampled, len(items), t0, wall0, now)
        return events

    def _step_ahead(self) -> list[WorkerEvent]:
        """One step with the host one step ahead of the device (docs/design.md §3,
        "Overlap"). Step N is on the device when this begins. While it runs: KV intake,
        expiry, and N + 1 scheduled as if N's requests continue (those that N finishes
        for certain -- max_tokens, the length cap -- are left out). Then N's ids come to
        the host; a request N ended (a stop token) or that ended while N ran (an abort, a
        failure, a preemption) is dropped from N + 1 and its token from N, if any, is
        never reported; N + 1 is launched, and N's events are built while it runs."""
        if self._intake is not None and self._intake.busy:  # written since the last call
            self._landed += self._intake.harvest()
        events = self._take_landed() if self._landed else []
        events += self._take_kv()
        events += self._expire()
        fly, self._inflight = self._inflight, None
        skip: set[str] = set()
        max_len, running = self.max_len, RequestStatus.RUNNING
        if fly is not None:
            for it in fly.items:
                r = it.request
                n = len(r.output_token_ids) + 1  # with the token on its way
                if n >= r.sampling_params.max_tokens or len(r.prompt_token_ids) + n >= max_len:
                    skip.add(r.request_id)
        items, preempted = self.scheduler.schedule(skip)
        events += self._preempted(preempted)
        sampled: list[Sampled] = []
        now = wall = 0.0
        if fly is not None:
            got = fly.launch.result()  # the step's one host sync
            now, wall = time.monotonic(), time.time()
            for s in got:
                r = s.request
                if r.status != running:
                    continue  # it ended while N ran: N's token is never reported
                r.append_token(s.token_id)
                if r.status == running and len(r.prompt_token_ids) + \
                        len(r.output_token_ids) >= max_len:
                    r.status = RequestStatus.FINISHED_LENGTH
                sampled.append(s)
            if items:  # N's finishes leave N + 1 before it starts
                items = [i for i in items if i.request.status == running]
        self.last_step_ran = bool(items) or fly is not None
        if items:
            t0, wall0 = time.monotonic(), time.time()
            launch = launch_and_sample(self.runner, items)
            for it in items:  # the KV at each item's position is the step's to write
                it.request.num_cached_tokens += 1
            self._inflight = _InFlight(launch, items, t0, wall0)
        if fly is not None:  # while N + 1 runs
            self._report(sampled, events, now, wall)
            self._account(sampled, len(fly.items), fly.t0, fly.wall0, now)
        if self._intake is not None:  # the ranges written by now; with nothing on the
            # device, waited for (the loop would only nap until they are)
            self._landed += self._intake.harvest() if self.last_step_ran else \
                self._intake.join()
            events += self._take_landed()
        return events

    def _take_landed(self) -> list[WorkerEvent]:
        """Take in the ranges the intake wrote: each one's credit goes back; one in place
        counts for its leg (if the leg is still the one it was handed for); one that
        could not be written fails its leg."""
        events: list[WorkerEvent] = []
        landed, self._landed = self._landed, []
        pending = self.scheduler.pending
        for ld in landed:
            self.receiver.release(ld.chunk)
            rid = ld.chunk.request_id
            ld.pending.in_intake -= 1
            if ld.problem is not None:
                if pending.get(rid) is ld.pending:
                    events += self._fail(rid, ld.problem)
            elif pending.get(rid) is ld.pending:
                self._in_place(ld.pending, ld.chunk)
        return events

    def _preempted(self, preempted: list[Request]) -> list[WorkerEvent]:
        events: list[WorkerEvent] = []
        for r in preempted:
            self.started.pop(r.request_id, None)
            self.aborted_early.ended(r.request_id)
            events += self._flush(r.request_id)
            events.append(WorkerEvent(EventKind.PREEMPTED, r.request_id, self.worker_id,
                                      message="decode worker out of KV blocks"))
        return events

    def _report(self, sampled: list[Sampled], events: list[WorkerEvent], now: float,
                wall: float) -> None:
        """One event per request whose token was appended (all sent as one message per
        step); a finished request leaves the scheduler."""
        worker, running = self.worker_id, RequestStatus.RUNNING
        tokens, interval, held_of = EventKind.TOKENS, self.stream_interval, self._held
        for s in sampled:
            r, tok = s.request, s.token_id
            timing, finish = NO_TIMING, None
            if r.status != running:  # finished (append_token or the length cap)
                finish = r.finish_reason
                self.scheduler.finish(r)
                self.aborted_early.ended(r.request_id)
                timing = LegTiming(decode_s=now - self.started.pop(r.request_id, now))
            # the leg's first step also carries its first token (outputs = [first, tok]):
            # the router streams from this or the prefill's message, whichever comes first
            outs = r.output_token_ids
            ids: tuple[int, ...] = (tok,)
            if interval > 1:  # held until the router's next release: k decode tokens in
                if (len(outs) - 1) % interval and len(outs) != 2 and finish is None \
                        and s.logprobs is None:
                    held = held_of.get(r.request_id)
                    if held is None:
                        held_of[r.request_id] = [tok]
                    else:
                        held.append(tok)
                    continue
                held = held_of.pop(r.request_id, None)
                if held:
                    ids = (*held, tok)
            events.append(WorkerEvent(tokens, r.request_id, worker, ids, finish, "", wall,
                                      timing, None if s.logprobs is None else (s.logprobs,),
                                      None, outs[0] if len(outs) == 2 else None))

    def _account(self, sampled: list[Sampled], batch: int, t0: float, wall0: float,
                 now: float) -> None:
        self.num_steps += 1
        self.step_seconds += now - t0
        if self.tracer.enabled:
            for r in (s.request for s in sampled):
                self.tracer.record(r.request_id, "decode_step", wall0, wall0 + (now - t0),
                                   worker=self.worker_id, past_kv_tokens=r.num_cached_tokens - 1,
                                   batch_num_seqs=batch, batch_num_tokens=batch,
                                   tenant=r.tenant)

    def _take_kv(self) -> list[WorkerEvent]:
        """Write every chunk of the poll (or drop it with its request) and release it; a
        chunk that cannot be written fails its own request, never the poll."""
        ev = self.receiver.poll()
        events: list[WorkerEvent] = []
        chunks, self._ready = self._ready + ev.chunks, []
        completed, self._ready_complete = self._ready_complete + ev.completed, []
        pending, now = self.scheduler.pending, self.scheduler.clock()
        for chunk in chunks:
            if chunk.request_id not in pending and not self.scheduler.find_running(
                    chunk.request_id):  # no reservation (yet): held, unreleased
                held, problem = self.early.offer(chunk, now, self.receiver)
                if problem is not None:
                    events.append(WorkerEvent(EventKind.FAILED, chunk.request_id,
                                              self.worker_id, message=problem))
                if held:
                    continue
            handed = False
            try:
                problem = self._write(chunk)
                handed = problem is _HANDED
            except Exception as e:  # noqa: BLE001 - e.g. a payload of the wrong shape
                problem = (f"KV chunk [{chunk.token_start}, {chunk.token_end}) could not be "
                           f"written: {type(e).__name__}: {e}")
            finally:
                if not handed:  # (a range handed to the intake: released once written)
                    self.receiver.release(chunk)
            if handed:
                continue
            if problem is not None:
                events += self._fail(chunk.request_id, problem)
        for rid, reason in ev.failed:
            events += self._fail(rid, f"KV receive failed: {reason}")
        for rid in completed:
            p = pending.get(rid)
            if p is not None:
                p.complete = True
            else:
                self.early.mark_complete(rid)
        for rid, p in list(self.scheduler.pending.items()):
            if p.complete and p.first_token is not None and not p.in_intake:
                if p.received_tokens < p.request.num_prompt_tokens:
                    events += self._fail(rid, (
                        f"KV incomplete: {p.received_tokens} of "
                        f"{p.request.num_prompt_tokens} tokens"))
                    continue
                self.scheduler.start(rid)
                self.started[rid] = time.monotonic()
                if self.tracer.enabled:
                    self.tracer.record(rid, "decode_admit", worker=self.worker_id)
        return events

    def _write(self, chunk: KVChunk) -> str | None:
        """Copy one chunk into the request's blocks; returns what is wrong with it, if
        anything (the request then fails)."""
        p = self.scheduler.pending.get(chunk.request_id)
        if p is None:
            return None  # unknown, aborted or failed request: discard
        n, layers = p.request.num_prompt_tokens, self.config.model.num_layers
        if chunk.token_end > n:
            return (f"KV chunk [{chunk.token_start}, {chunk.token_end}) is beyond the "
                    f"announced prompt of {n} tokens")
        if chunk.layer_end > layers:
            return (f"KV chunk has layers [{chunk.layer_start}, {chunk.layer_end}) but the "
                    f"model has {layers}")
        first, vocab = chunk.first_token, self.config.model.vocab_size
        if chunk.is_final and (first is None or not 0 <= first < vocab):
            return f"final KV chunk carries first token {first!r}, not a token id < {vocab}"
        if chunk.is_final:
            p.first_token = chunk.first_token
        if chunk.num_tokens:
            r = self.scheduler.allocate_range(chunk.request_id, chunk.token_end)
            if self._intake is not None:  # checked and copied off the loop thread
                self._intake.put(chunk, r.block_ids, p)
                p.in_intake += 1
                return _HANDED
            self.runner.kv.import_tokens(r.block_ids, chunk.token_start, chunk.payload,
                                         layer_start=chunk.layer_start,
                                         head_start=chunk.head_start)  # (0: every head)
            self._in_place(p, chunk)
        return None

    def _in_place(self, p, chunk: KVChunk) -> None:
        """A range written into its leg's blocks counts toward the leg's prompt."""
        key = (chunk.token_start, chunk.token_end)
        # (an emulated device may be sent only its first layers: engine/emulate/)
        if chunk.layer_end == getattr(self.runner, "layers_sent", self.config.model.num_layers) \
                and key not in p.ranges:
            p.ranges.add(key)
            p.received_tokens += chunk.num_tokens

    def _expire(self) -> list[WorkerEvent]:
        out, now = [], self.scheduler.clock()  # (the KV waits count on the scheduler's)
        for rid in self.scheduler.expired(now):
            out += self._fail(rid, "timed out waiting for KV from the prefill worker")
        for rid in self.early.expired(now):
            self.early.close(rid, "expired", self.receiver)
            out.append(WorkerEvent(EventKind.FAILED, rid, self.worker_id, message=(
                f"KV arrived but no reservation came within "
                f"{self.early.config.ttl_s:g}s")))
        return out

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.pending or self.scheduler.running
                    or self._inflight is not None)

    def stats(self) -> DecodeStats:
        rx = self.receiver.stats()
        return DecodeStats(
            role="decode",
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.pending),
            kv_blocks_used=self.bm.num_used_blocks,
            kv_blocks_free=self.bm.num_free_blocks,
            num_steps=self.num_steps,
            mean_step_s=self.step_seconds / max(1, self.num_steps),
            kv_blocks_promisable=self.scheduler.promised_free_blocks(),
            kv_cache_usage_perc=self.bm.usage,
            kv_checksum_failures=int(rx.get("checksum_failures", 0)),
            kv_duplicate_frames=int(rx.get("duplicates", 0)),
            kv_rx_active_requests=int(rx.get("active_requests", 0)),
            kv_early_held_chunks=self.early.nchunks, kv_early_held_bytes=self.early.nbytes,
            kv_early_dropped_chunks=sum(self.early.dropped_chunks.values()),
            kv_reserves_refused=self.early.refusals,
            **device_stats(self.runner),
        )
