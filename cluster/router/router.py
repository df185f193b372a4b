"""Router: the request lifecycle across the two pools (runs in the server process).

generate(): a decode worker's `reserve` (prompt + headroom as a promise; least KV usage
wins; the admission queue, cluster/router/admission.py, keeps arrival order, a full one is
RESOURCE_EXHAUSTED at once) and a prefill worker's `add` (least outstanding prefill
tokens, prefix affinity), both at once when nobody waits -> tokens from worker events.
Each dispatch is a *leg*: a decode preemption, a dead worker or a failed transfer starts
a new leg that recomputes prompt + tokens so far on a healthy pair, so the client's
stream simply continues. Leg ids (`<request_id>#<router tag><dispatch no.>#<leg no.>`)
are unique per dispatch and stay internal, so a client may reuse its request_id the
moment its request ended: nothing a worker still holds about an old leg (a tombstone, a
late event, a late reservation) can touch the new request. A request's id is released
as soon as it ends with any status, before its last delta or error is delivered.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from cluster.router.admin import RouterAdmin
from cluster.router.admission import DecodeAdmission
from cluster.router.delta_stream import DeltaStream
from cluster.router.events import EventPump
from cluster.router.flight import Flight, RouterConfig
from cluster.router.policies import PrefillLoad
from cluster.router.pool import ReservesInFlight, WorkerHandle, check_fits
from cluster.router.types import ErrorCode, GenerateSpec, RouterError, TokenDelta
from engine.request import SamplingParams
from runtime.messages import DecodeTask, PrefillTask

__all__ = ["Flight", "Router", "RouterConfig"]
log = logging.getLogger(__name__)


class Router(RouterAdmin):
    def __init__(self, prefill: list[WorkerHandle], decode: list[WorkerHandle],
                 config: RouterConfig, tokenizer, vocab_size: int, max_model_len: int,
                 eos_token_ids: tuple[int, ...] = (), metrics=None,
                 channel_secret: bytes = b""):
        """`channel_secret` opens the workers' control channels (runtime/channel.py)."""
        self.prefill, self.decode = prefill, decode
        self.switching: list[WorkerHandle] = []  # changing role: in neither pool
        self.config, self.tokenizer, self.metrics = config, tokenizer, metrics
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.eos_token_ids = eos_token_ids
        self.flights: dict[str, Flight] = {}  # live requests only: an ended id is free
        self.legs: dict[str, Flight] = {}
        self.admission = DecodeAdmission(self)
        self.serving, self._started = True, None  # (the pumps' start: an asyncio.Future)
        self._placement = config.make_placement()  # cluster/router/policies.py
        self.tag = secrets.token_hex(3)  # leg ids of two routers sharing workers differ
        self._dispatches = itertools.count(1)
        self._background: set[asyncio.Task] = set()
        # reserves sent by _decode_at_once still in flight, per decode worker (more than
        # one on a worker only with pipelined_reserves)
        self._reserving = ReservesInFlight()
        self.pump = EventPump(self, channel_secret)
        self.on_shutdown = None  # set by the launcher: stops the actors it started
        self.on_arrival = None  # called with each new request's spec (the planner's)

    # ---- RouterAPI (the rest: cluster/router/admin.py) -------------------------------
    async def start(self) -> None:
        """Connect the workers' channels and start the event pumps on the running loop
        (idempotent; generate() calls it)."""
        if self._started is None:
            self._started = asyncio.ensure_future(self.pump.start())
        await asyncio.shield(self._started)

    async def generate(self, spec: GenerateSpec) -> AsyncIterator[TokenDelta]:
        await self.start()
        if not self.serving:
            raise RouterError(ErrorCode.UNAVAILABLE, "server is shutting down")
        if spec.request_id in self.flights:
            raise RouterError(ErrorCode.ALREADY_EXISTS,
                              f"request_id {spec.request_id!r} is already active")
        if len(self.admission) >= self.config.max_queue_len:
            raise RouterError(ErrorCode.RESOURCE_EXHAUSTED,
                              f"admission queue is full ({self.config.max_queue_len} waiting)")
        check_fits(self.decode, len(spec.prompt_token_ids))
        flight = Flight(spec, DeltaStream(spec.request_id), time.monotonic())
        self.flights[spec.request_id] = flight
        if self.on_arrival is not None:
            self.on_arrival(spec)
        # The deadline posts an error into the stream; no wait_for around queue.get(),
        # whose cancellation can be lost when an item lands at the same moment.
        timer = asyncio.get_running_loop().call_later(
            self.config.request_timeout_s, lambda: self.fail(flight, RouterError(
                ErrorCode.DEADLINE_EXCEEDED,
                f"request exceeded {self.config.request_timeout_s:g}s")))
        try:
            await self.dispatch(flight)
            while True:
                item = await flight.queue.get()
                if isinstance(item, RouterError):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            timer.cancel()
            self._close_flight(flight)

    def stream(self, request_id: str) -> DeltaStream | None:
        """The request's DeltaStream while it lives (None once it ended)."""
        flight = self.flights.get(request_id)
        return None if flight is None else flight.queue

    def spawn(self, coro) -> asyncio.Task:
        """Run `coro` in the background (kept referenced; cancelled by shutdown)."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # ---- dispatch ---------------------------------------------------------------------
    async def dispatch(self, flight: Flight, refused: tuple | None = None) -> None:
        """Start a new leg on a decode worker (a reservation) and a prefill worker. With
        nobody waiting for admission, `reserve` and `add` go out together: the first token
        waits for the prefill alone (KV that overtakes its reserve waits for it on the
        decode worker, decode_worker/early_kv.py; a refusal: `_reserve_reply`); else (or
        after such a refusal: `refused`) the leg waits in the admission queue for a
        reservation, then the add.
        Returns once a leg is queued on a live pair or the request has ended (its error is
        then in its queue); raises RouterError when it cannot be served. A leg lost here
        (a prefill worker died) is a failure, so the retries are bounded by max_legs."""
        spec = flight.spec
        if flight.done:
            return
        if flight.failures >= self.config.max_legs:
            raise RouterError(ErrorCode.UNAVAILABLE,
                              f"gave up after {flight.failures} attempts (workers failing)")
        leg_id, prompt, sampling = self._new_leg(flight)
        dtask = DecodeTask(leg_id, len(prompt), sampling, self.eos_token_ids, tenant=spec.tenant)
        decode = None if refused else self._decode_at_once(len(prompt), spec.tenant)
        if decode is None:
            decode = await self.admission.admit(flight, dtask, refused)
            if decode is None:
                return  # the request ended while it waited
            reserve = None
        else:  # sent right before the add, once that is built: nothing runs between them
            reserve = (self.admission.core.round,
                       self._reserving.sent(id(decode), len(prompt), decode.block_size))
        flight.decode = decode
        decode.legs.add(leg_id)
        self.admission.core.hold(spec.tenant, len(prompt))
        try:  # (with `reserve`, _decode_at_once saw a live prefill worker, and no await since)
            # a colocated engine runs the whole leg: it prefills what it decodes (placed
            # apart, its tokens would come from a worker that does not hold the decode leg)
            prefill = decode if decode.role == "colocated" else self._pick_prefill(prompt)
        except RouterError:  # the prefill pool died while we reserved: a new leg waits
            if reserve is not None:  # (never sent: nothing to undo on the decode worker)
                self._reserving.answered(id(decode), reserve[1])
                decode.legs.discard(leg_id)
            self.end_leg(flight)  # (grace) for its restart
            flight.failures += 1
            await self.dispatch(flight)
            return
        flight.prefill = prefill
        prefill.legs.add(leg_id)
        prefill.outstanding_tokens += len(prompt)
        deadline_s = None if spec.ttft_deadline_ms is None else spec.ttft_deadline_ms / 1000
        task = PrefillTask(leg_id, prompt, sampling, decode.endpoint, self.eos_token_ids,
                           spec.tenant, spec.priority, deadline_s)
        if flight.first_token_at is None:  # the TTFT's admission phase ends here
            flight.dispatched_at = time.monotonic()
        # the reserve goes first (the decode worker can serve nothing before it), the add
        # right behind it
        reply = None if reserve is None else _remote(decode.actor.reserve, dtask)
        added = _remote(prefill.actor.add, task)
        if reserve is not None:
            self.spawn(self._reserve_reply(flight, decode, leg_id, reply, *reserve))
        try:
            await added
        except ValueError as e:
            raise RouterError(ErrorCode.INVALID_ARGUMENT, str(e)) from e
        except Exception as e:  # the prefill actor died under us: next leg
            log.warning("prefill %s failed on add: %s", prefill.worker_id, e)
            if flight.leg_id != leg_id or flight.done:
                return  # already re-dispatched (its decode died) or ended meanwhile
            self.end_leg(flight)  # first, so that mark_dead does not re-dispatch it too
            flight.failures += 1
            self.mark_dead(prefill)
            await self.dispatch(flight)

    def _decode_at_once(self, prompt_len: int, tenant: str) -> WorkerHandle | None:
        """The decode worker to reserve on while the prefill starts, if any: the least
        loaded live one with no reserve in flight (an admission's or one sent this way: a
        burst queues as before) and room for the prompt as its last load message says;
        none while requests wait for admission (they came first) or no prefill is alive.
        With `pipelined_reserves`, reserves in flight do not stop another: the room left
        is the last load's less the blocks they ask for, so a burst is reserved at once
        (the worker answers them all at its next step boundary, in arrival order), spread
        over the workers by KV usage counting those blocks. A tenant past its share of
        the pool's room (AdmissionCore.within_share) queues."""
        adm = self.admission
        if not self.config.reserve_with_add or len(adm) or not any(
                p.alive for p in self.prefill) or not adm.core.within_share(tenant, prompt_len):
            return None
        busy, reserving = adm.core.busy, self._reserving
        if self.config.pipelined_reserves:
            return self._least_promised(adm.candidates()[0], prompt_len)
        for w in adm.candidates()[0]:
            if w.role == "decode" and id(w) not in busy and id(w) not in reserving \
                    and w.has_room(prompt_len):
                return w
        return None

    def _least_promised(self, alive: list[WorkerHandle], prompt_len: int) -> WorkerHandle | None:
        """The decode worker with the least KV usage counting this router's reserves in
        flight (then the fewest of them), among those with room for the prompt."""
        best, best_key = None, None
        for w in alive:
            n, blocks = self._reserving.of(id(w))
            if w.role != "decode" or not w.has_room(prompt_len, blocks):
                continue
            key = (w.kv_usage + (blocks / w.num_blocks if w.num_blocks else 0.0), n)
            if best_key is None or key < best_key:
                best, best_key = w, key
        return best

    async def _reserve_reply(self, flight: Flight, w: WorkerHandle, leg_id: str, reply,
                             round_: int, blocks: int = 0) -> None:
        """The answer of a reserve sent with the prefill's add. Refused: the leg ends on
        the prefill worker (decode holds nothing of it) and a new leg queues for admission
        as a refused request does; cannot fit: RESOURCE_EXHAUSTED; the worker died: it is
        marked dead and a new leg queues."""
        error, dead, ok = None, False, False
        try:
            ok = await reply
        except ValueError as e:  # can never fit that worker
            error = RouterError(ErrorCode.RESOURCE_EXHAUSTED, str(e))
        except Exception as e:  # dead worker (a reserve that landed is undone)
            log.warning("decode %s failed on reserve: %s", w.worker_id, e)
            self.abort_on(w, leg_id)
            dead = True
        finally:
            self._reserving.answered(id(w), blocks)
        if ok:
            return
        current = flight.leg_id == leg_id and not flight.done  # (else it ended, and its
        if current:  # end aborted it on both workers)
            w.legs.discard(leg_id)  # it holds nothing of the leg: no abort goes to it
            fresh = round_ == self.admission.core.round  # no room freed since it was asked
            self.end_leg(flight)  # (a new round that frees nothing on w)
            round_ = self.admission.core.round if fresh else -1
        if dead:
            self.mark_dead(w)
        if not current:
            return
        if error is not None:
            self.fail(flight, error)
            return
        try:
            await self.dispatch(flight, (w, -1 if dead else round_))
        except RouterError as e:
            self.fail(flight, e)
        except Exception as e:  # noqa: BLE001 - the request fails, the router serves on
            self.fail(flight, RouterError(ErrorCode.UNAVAILABLE, f"re-dispatch failed: {e}"))

    def _new_leg(self, flight: Flight) -> tuple[str, tuple[int, ...], SamplingParams]:
        leg_id = f"{flight.spec.request_id}#{self.tag}{next(self._dispatches):x}#{flight.leg + 1}"
        prompt, sampling = flight.start_leg(leg_id)
        self.legs[leg_id] = flight
        return leg_id, prompt, sampling

    def _pick_prefill(self, prompt: tuple[int, ...]) -> WorkerHandle:
        alive = [w for w in self.prefill if w.alive]
        if not alive:
            raise RouterError(ErrorCode.UNAVAILABLE, "no prefill worker is alive")
        wid = self._placement.pick([PrefillLoad(w.worker_id, w.prefill_load)
                                    for w in alive], prompt)
        return next(w for w in alive if w.worker_id == wid)

    # ---- leg / flight endings ---------------------------------------------------------
    def abort_on(self, w: WorkerHandle, leg_id: str) -> None:
        """Abort `leg_id` on `w`; the admission queue's head retries once it is done."""
        try:
            ref = w.actor.abort.remote(leg_id)
        except Exception:
            return

        async def then_wake() -> None:
            with contextlib.suppress(Exception):
                await ref
            self.wake_admission()

        self.spawn(then_wake())

    def end_leg(self, flight: Flight, ended: tuple[WorkerHandle | None, ...] = ()) -> None:
        """Forget the current leg on both workers. It is aborted on each live worker that
        still holds it, except those in `ended`, which ended their part of it themselves
        (finished, failed or preempted it): a worker is never sent an abort for a leg it
        has no more, which would only leave a tombstone behind."""
        leg_id = flight.leg_id
        self.legs.pop(leg_id, None)
        p = flight.prefill
        if p is not None and leg_id in p.legs and not flight.prefill_done:
            p.outstanding_tokens = max(0, p.outstanding_tokens - flight.leg_prompt_len)
        if flight.decode is not None:
            self.admission.core.unhold(flight.spec.tenant, flight.leg_prompt_len)
        for w in {id(w): w for w in (p, flight.decode) if w is not None}.values():
            if leg_id in w.legs and w.alive and not any(w is e for e in ended):
                self.abort_on(w, leg_id)
            w.legs.discard(leg_id)
        flight.prefill = flight.decode = None
        self.admission.wake_head()

    def release(self, flight: Flight) -> None:
        """The request ended: its id is free from now on (before its last item is read)."""
        flight.done = True
        rid = flight.spec.request_id
        if self.flights.get(rid) is flight:
            del self.flights[rid]
            if self.metrics is not None:
                self.metrics.forget(rid)
        self.admission.wake(flight)

    def fail(self, flight: Flight, err: RouterError) -> None:
        if flight.done:
            return
        self.release(flight)
        self.end_leg(flight)
        flight.queue.put_nowait(err)

    def _close_flight(self, flight: Flight) -> None:
        if not flight.done:  # client went away or an error escaped: abort everywhere
            self.release(flight)
            self.end_leg(flight)


def _remote(method: Any, *args: Any) -> Any:
    """``method.remote(*args)``, or a failed Future where the call itself raised (a dead
    actor may refuse it): awaiting either raises the same way."""
    try:
        return method.remote(*args)
    except Exception as e:  # noqa: BLE001 - raised where it is awaited
        fut = asyncio.get_running_loop().create_future()
        fut.set_exception(e)
        return fut
