"""The simulated router: cluster/router/router.py's request lifecycle on the simulated clock.

Reproduced: the bounded admission queue (sim/admission.py drives the router's own
AdmissionCore); the reserve sent with the add when nobody waits (sim/router_reserve.py); the first token from the prefill or decode's first step, whichever comes
first (cluster/router/events.py; timed in sim/results.py); prefill placement by a
registered policy over outstanding prefill tokens (cluster/router/policies.py); legs (a preemption or a failure
starts a new leg that recomputes prompt + tokens so far); request deadlines; the
periodic keepalives, stats and adaptive-chunk pressure (sim/router_upkeep.py).

Modelled instead of run: every router <-> worker call is a one-way latency (``rpc_s``;
a measured calibration takes it from the real service's idle dispatch, which includes
the router's CPU per message at idle), router <-> client is ``client_s``; tokens reach
the router by the control plane's delivery model (engine/costs/delivery.py: first-token latency,
per-step delivery, coalescing while the path is busy), applied in sim/prefill.py and
sim/results.py. The router's CPU as a shared server (queueing under load) is not
modelled; worker death and restarts are not. KV-wait keepalives are sent as
cluster/router/events.py sends them.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bench.workload import WorkloadRequest  # (at run time: mypyc's dataclass reads it)
from sim.adapters import (
    DecodeLoad,
    PrefillLoad,
    ReservesInFlight,
    block_hashes,
    simulated_token,
)
from sim.admission import SimAdmission
from sim.router_reserve import ReserveWithAdd

if TYPE_CHECKING:
    from sim.cluster import Simulation
    from sim.decode import SimDecode
    from sim.prefill import SimPrefill

@dataclass(eq=False, slots=True, init=False)  # (slots: lighter, faster attributes)
class Flight:
    """A request in the router: its current leg, its tokens and timings, how it ended.
    (Its own __init__: mypyc compiles it; a dataclass's generated one runs interpreted.)"""

    req: WorkloadRequest
    arrival: float  # at the router
    send_s: float  # when the client sent it
    leg: int
    leg_id: str
    failures: int
    preemptions: int
    prefill: SimPrefill | None
    decode: SimDecode | None
    leg_prompt_len: int
    generated: int
    tokens: list  # router times (float) and decode segments
    timing: dict[str, float]
    done: bool
    error: str
    finish_reason: str
    end_time: float | None
    prefill_done: bool
    leg_first_seen: bool

    def __init__(self, req: WorkloadRequest, arrival: float, send_s: float):
        self.req, self.arrival, self.send_s = req, arrival, send_s
        self.leg = self.failures = self.preemptions = self.leg_prompt_len = self.generated = 0
        self.leg_id = self.error = self.finish_reason = ""
        self.prefill, self.decode, self.end_time = None, None, None
        self.tokens, self.timing = [], {}
        self.done = self.prefill_done = self.leg_first_seen = False


class SimRouter(ReserveWithAdd):
    def __init__(self, sim: Simulation):
        self.sim, self.loop = sim, sim.loop
        self.cfg = sim.plan.router
        self.flights: dict[str, Flight] = {}
        self.legs: dict[str, Flight] = {}
        self.finished: list[Flight] = []
        self.placement = sim.placement
        # a prompt is hashed once, at placement, for the placement and its prefill
        # worker's prefix cache (BlockManager.note_hashes)
        bs = sim.plan.prefill_block_size
        self._hash_bs = bs if sim.plan.prefix_caching else 0
        self._pick_hashes = getattr(self.placement, "block_size", bs) == bs
        self._arrival = sim.costs.arrival_spread
        self.outstanding = {w.worker_id: 0 for w in sim.prefill}
        self.held: dict[str, set[str]] = {w.worker_id: set() for w in sim.prefill + sim.decode}
        self.kv_view = {w.worker_id: 0.0 for w in sim.decode}  # the router's stale stats
        # each decode worker's unpromised free blocks as its last load message said
        self.promisable = {w.worker_id: w.bm.num_blocks for w in sim.decode}
        self.same_size = len({(w.bm.num_blocks, w.bm.block_size) for w in sim.decode}) == 1
        self.reserving = ReservesInFlight()  # reserves sent with adds, not yet answered
        # the placement and decode-order policies' inputs, kept current (a NamedTuple per
        # worker is rebuilt when its figures change, not per decision)
        self.prefill_loads = [PrefillLoad(w.worker_id, 0) for w in sim.prefill]
        self.decode_loads = [DecodeLoad(w.worker_id, 0.0, 0) for w in sim.decode]
        self._load_index = {w.worker_id: i for ws in (sim.prefill, sim.decode)
                            for i, w in enumerate(ws)}
        self._dispatches = itertools.count(1)
        self.decode_by_id = {w.worker_id: w for w in sim.decode}
        self.admission = SimAdmission(self)
        self.decode_capacity = max(w.bm.num_blocks * w.bm.block_size for w in sim.decode)
        self._deadlines: deque[Flight] = deque()
        self.rejected = 0
        self.last_end = 0.0  # when the last request ended

    # ---- arrivals -------------------------------------------------------------------
    def arrive(self, req: WorkloadRequest, send_s: float) -> None:
        now = self.loop.now
        flight = Flight(req, now, send_s)
        if len(self.admission) >= self.cfg.max_queue_len:
            return self._reject(flight, "RESOURCE_EXHAUSTED: admission queue is full "
                                f"({self.cfg.max_queue_len} waiting)")
        cap = self.decode_capacity
        if req.prompt_len + 1 > cap:
            return self._reject(flight, f"RESOURCE_EXHAUSTED: prompt of {req.prompt_len} "
                                f"tokens cannot fit any decode worker's KV cache ({cap} tokens)")
        self.flights[req.request_id] = flight
        self._deadlines.append(flight)  # in arrival order: one timer for the oldest
        if len(self._deadlines) == 1:
            self.loop.at(now + self.cfg.request_timeout_s, self._deadline_tick)
        self.dispatch(flight)

    def _reject(self, flight: Flight, error: str) -> None:
        flight.done, flight.error = True, error
        self.last_end = self.loop.now
        self.rejected += 1
        self.finished.append(flight)
        self._client_done()

    def _client_done(self) -> None:
        if self.sim.options.max_concurrency is not None:  # the client waits for the end
            self.loop.at(self.loop.now + self.sim.client_s, self.sim.client_done)

    def _deadline_tick(self) -> None:
        """Fail every request older than the timeout; re-arm for the oldest one left."""
        limit, q = self.cfg.request_timeout_s, self._deadlines
        while q and (q[0].done or q[0].arrival + limit <= self.loop.now):
            f = q.popleft()
            self.fail(f, f"DEADLINE_EXCEEDED: request exceeded {limit:g}s")
        if q:
            self.loop.at(q[0].arrival + limit, self._deadline_tick)

    # ---- dispatch: admission queue, decode reservation, prefill placement -----------
    def dispatch(self, flight: Flight, refused: tuple | None = None) -> None:
        """A new leg: its reserve with its add (sim/router_reserve.py) when nobody waits,
        else (or after such a reserve's refusal) it queues for admission."""
        if flight.done:
            return
        if flight.failures >= self.cfg.max_legs:
            return self.fail(flight, f"UNAVAILABLE: gave up after {flight.failures} attempts")
        flight.leg += 1
        flight.leg_id = f"{flight.req.request_id}#{next(self._dispatches):x}#{flight.leg}"
        flight.leg_prompt_len = flight.req.prompt_len + flight.generated
        flight.prefill_done = flight.leg_first_seen = False
        self.legs[flight.leg_id] = flight
        decode = None if refused else self.decode_at_once(flight.leg_prompt_len)
        if decode is None:
            return self.admission.enqueue(flight, refused)
        self.reserve_with_add(flight, decode)

    def wake_head(self) -> None:
        self.admission.wake_head()

    def place(self, flight: Flight, decode: SimDecode) -> None:
        """The head's decode reservation held: pick its prefill worker and queue it."""
        flight.decode = decode
        self.held[decode.worker_id].add(flight.leg_id)
        self._decode_load(decode.worker_id)
        req = flight.req
        prompt = req.prompt_token_ids  # (nothing downstream writes to a prompt: shared)
        if flight.generated or type(prompt) is not list:
            prompt = [*prompt, *[simulated_token()] * flight.generated]
        hashes = block_hashes(prompt, self._hash_bs) if self._hash_bs else None
        wid = self.placement.pick(self.prefill_loads, prompt,
                                  hashes if self._pick_hashes else None)
        p = self.sim.prefill_by_id[wid]
        flight.prefill = p
        self.held[wid].add(flight.leg_id)
        self._add_outstanding(wid, len(prompt))
        deadline = None if req.ttft_deadline_ms is None else req.ttft_deadline_ms / 1000
        delay = self.sim.rpc_s
        if self._arrival and flight.leg == 1:  # what the real dispatch adds (engine/costs/model.py)
            delay = max(delay + self.sim.costs.arrival_extra_s(req.request_id)[0], 0.0)
        self.loop.after(delay, p.command, p.add, flight.leg_id, prompt,
                        req.max_tokens - flight.generated, req.tenant, decode, deadline, hashes)

    def _add_outstanding(self, wid: str, tokens: int) -> None:
        n = self.outstanding[wid] = max(0, self.outstanding[wid] + tokens)
        self.prefill_loads[self._load_index[wid]] = PrefillLoad(wid, n)

    def _decode_load(self, wid: str) -> None:
        self.decode_loads[self._load_index[wid]] = DecodeLoad(
            wid, self.kv_view[wid], len(self.held[wid]))
        self.admission.loads_changed()

    # ---- worker events --------------------------------------------------------------
    def _current(self, leg: str, w: Any, role: str) -> Flight | None:
        f = self.legs.get(leg)
        if f is None or f.done or f.leg_id != leg or getattr(f, role) is not w:
            return None
        return f

    def on_first_token(self, w: SimPrefill, leg: str, ended: bool, timing: dict) -> None:
        f = self._current(leg, w, "prefill")
        if f is None:
            return
        f.timing.update(timing)
        if f.leg_first_seen:  # (decode's copy of it went out already)
            return
        f.leg_first_seen = True
        f.generated += 1
        f.tokens.append(self.loop.now)
        if ended:
            self._finish(f, (w,))

    def on_prefill_done(self, w: SimPrefill, leg: str, transfer_s: float) -> None:
        f = self._current(leg, w, "prefill")
        if f is None:
            return
        f.timing["transfer_s"] = f.timing.get("transfer_s", 0.0) + transfer_s
        if leg in self.held[w.worker_id] and not f.prefill_done:
            f.prefill_done = True
            self._add_outstanding(w.worker_id, -f.leg_prompt_len)
            self.held[w.worker_id].discard(leg)

    def on_decode_end(self, w: SimDecode, leg: str, first: int, count: int, finished: bool,
                      decode_s: float) -> None:
        f = self._current(leg, w, "decode")
        if f is None:
            return
        if count:  # the leg's first step carried its first token too: the router
            # streamed whichever copy came first (sim/results.py times both)
            f.tokens.append((w, first, count, f.leg_first_seen))
            f.generated += count + (not f.leg_first_seen)
            f.leg_first_seen = True
        if finished:
            f.timing["decode_s"] = f.timing.get("decode_s", 0.0) + decode_s
            self._finish(f, (w, f.prefill))
        else:  # preempted: a leg that streamed its first token made progress
            self.redispatch(f, failed=not f.leg_first_seen, ended=(w,))

    def on_failed(self, w: Any, leg: str, message: str) -> None:
        f = self.legs.get(leg)
        if f is None or f.done or f.leg_id != leg or w not in (f.prefill, f.decode):
            return
        self.redispatch(f, failed=True, ended=(w,))

    def on_add_rejected(self, w: SimPrefill, leg: str, message: str) -> None:
        f = self._current(leg, w, "prefill")
        if f is not None:
            self.fail(f, f"INVALID_ARGUMENT: {message}")

    # ---- endings --------------------------------------------------------------------
    def _finish(self, f: Flight, ended: tuple) -> None:
        f.finish_reason = "length"
        f.end_time = self.loop.now
        self.release(f)
        self.end_leg(f, ended)

    def redispatch(self, f: Flight, *, failed: bool, ended: tuple = ()) -> None:
        if failed:
            f.failures += 1
        else:
            f.preemptions += 1
        self.end_leg(f, ended)
        self.loop.at(self.loop.now, self.dispatch, f)

    def end_leg(self, f: Flight, ended: tuple = ()) -> None:
        leg = f.leg_id
        self.legs.pop(leg, None)
        p = f.prefill
        if p is not None and leg in self.held[p.worker_id] and not f.prefill_done:
            self._add_outstanding(p.worker_id, -f.leg_prompt_len)
        for w in (p, f.decode):  # (a prefill and a decode worker: never the same one)
            if w is None:
                continue
            held = self.held[w.worker_id]
            if leg in held and w not in ended:  # (workers compare by identity)
                self.abort_on(w, leg)
            held.discard(leg)
        if f.decode is not None:
            self._decode_load(f.decode.worker_id)
        f.prefill = f.decode = None
        self.wake_head()

    def abort_on(self, w: Any, leg: str) -> None:
        """Abort ``leg`` on ``w``; the queue's head retries once that is done."""
        def run() -> None:
            w.abort(leg)
            self.sim.emit(self.wake_head)

        self.sim.emit(w.command, run)

    def release(self, f: Flight) -> None:
        f.done = True
        self.last_end = self.loop.now
        if self.flights.get(f.req.request_id) is f:
            del self.flights[f.req.request_id]
            self.finished.append(f)
            self._client_done()
        self.admission.forget(f)

    def fail(self, f: Flight, error: str) -> None:
        if f.done:
            return
        f.error = error
        self.release(f)
        self.end_leg(f)
