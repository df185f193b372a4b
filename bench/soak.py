"""Soak / chaos harness: drive a running service with a seeded request mix, cancel
streams at every phase, kill worker actors, then check that nothing leaked or hung.

    pdserve soak --addr 127.0.0.1:50051 --requests 1000 --rate 8 --cancel-rate 0.3 \\
        --kill-every 30 --ray-address auto --model tiny --metrics-url \\
        http://127.0.0.1:9090/metrics --json soak.json
    pdserve soak --pressure --requests 1000 --model tiny      # runs its own small service

The plan (bench/soak_plan.py) mixes chat, long-document and shared-prefix requests with
Poisson arrivals; cancels (and, with ``pressure``, Abort RPCs) take turns at the target
phases: before the first token after a short delay (in-process: when the router's
``phase_probe`` shows the phase), at the first token (transfer), after some tokens
(decode). ``pressure`` also sends client deadlines, reuses ended requests' ids (once the
earlier request ended) and drains the service (bench/soak_service.py); kills are in
bench/soak_chaos.py. The end checks (bench/soak_report.py): one terminal status per
request, none over ``deadline_s``, an idle service (no KV blocks, queues, sends or
in-flight bytes), greedy tokens equal to ``engine.LLM``'s (the unfinished a prefix).
"""

from __future__ import annotations

import asyncio
import math
import time

import grpc
from tqdm import tqdm

from bench.soak_chaos import KillRecord, chaos, find_victims
from bench.soak_plan import PHASES, TERMINAL, SoakConfig, SoakRequest, build_plan
from bench.soak_probes import PhaseProbe, SoakHooks, router_leg_probe, router_phase_probe
from bench.soak_report import RequestRecord, SoakReport, finish_report
from cluster.grpc.auth import auth_metadata, channel_credentials
from cluster.grpc.convert import FINISH_FROM_PROTO, build_request
from engine.quantiles import median
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc

DEADLINE_SLACK_S = 0.002  # grpc core's timers count whole milliseconds

__all__ = ["PHASES", "TERMINAL", "KillRecord", "SoakConfig", "SoakHooks", "SoakRequest",
           "SoakRunner", "build_plan", "find_victims", "router_leg_probe",
           "router_phase_probe", "run_soak"]


class SoakRunner:
    """One soak run; `phase_probe(request_id)` (in-process tests) reports the request's
    true phase at the moment it is cancelled, else the client's view is recorded."""

    def __init__(self, cfg: SoakConfig, phase_probe: PhaseProbe | None = None,
                 hooks: SoakHooks | None = None):
        self.cfg = cfg
        self.hooks = hooks or SoakHooks()
        self.phase_probe = phase_probe or self.hooks.phase_probe
        self.records: dict[str, RequestRecord] = {}  # by SoakRequest.key
        self.kills: list[KillRecord] = []
        self.drain_at_s: float | None = None
        self._t0 = 0.0
        self._traffic_done = asyncio.Event()
        self._bar = None
        self._ttfts: dict[str, list[float]] = {}  # kind -> TTFTs seen so far
        self._ended: dict[str, asyncio.Event] = {}  # key -> set once the request ended
        self._aborts: dict[str, asyncio.Task] = {}  # key -> its Abort RPC
        self._draining = asyncio.Event()
        self._open = 0  # streams sent and not ended

    async def run(self) -> SoakReport:
        cfg = self.cfg
        options = [("grpc.max_receive_message_length", 64 << 20)]
        channel = (grpc.aio.secure_channel(cfg.addr, channel_credentials(cfg.tls_ca), options)
                   if cfg.tls_ca else grpc.aio.insecure_channel(cfg.addr, options))
        async with channel:
            stub = pb_grpc.GenerationStub(channel)
            md = auth_metadata(cfg.token)
            info = await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=md, timeout=60)
            pools = await self._pools(stub, md) if cfg.pressure else {}
            if cfg.pressure and cfg.pool_tokens is None:
                from dataclasses import replace

                self.cfg = cfg = replace(cfg, pool_tokens=min(pools.values()))
            plan = build_plan(cfg, info.vocab_size, info.max_model_len)
            actors = []
            if cfg.kill_every_s is not None and cfg.max_kills != 0:
                # find the victims before any traffic: no Ray access fails fast
                actors = await asyncio.get_running_loop().run_in_executor(
                    None, find_victims, cfg.ray_address, cfg.actor_tag)
            self._t0 = time.monotonic()
            self._bar = tqdm(total=len(plan), desc="soak", unit="req", leave=False,
                             disable=not cfg.progress)
            kills = asyncio.ensure_future(
                chaos(cfg, actors, self._t0, self._traffic_done, self.kills))
            drain = asyncio.ensure_future(self._drain(plan))
            try:
                await asyncio.gather(*(self._one(stub, md, r) for r in plan))
            finally:
                self._bar.close()
            self._traffic_done.set()
            await kills
            drained = await drain
            traffic_s = time.monotonic() - self._t0
            return await finish_report(self, plan, stub, md, traffic_s, pools=pools,
                                       drained=drained)

    async def _pools(self, stub, md) -> dict[str, int]:
        """Tokens of the smallest KV pool of each role (GetStats blocks x block_size)."""
        st = await stub.GetStats(pb.GetStatsRequest(), metadata=md, timeout=60)
        out: dict[str, int] = {}
        for w in st.workers:
            tokens = (w.kv_blocks_used + w.kv_blocks_free) * self.cfg.block_size
            out[w.role] = min(out.get(w.role, tokens), tokens)
        return out

    async def _drain(self, plan: list[SoakRequest]) -> str | None:
        """Start the drain as the first request planned after it arrives; wait for it."""
        if not self.cfg.drain:
            return None
        if self.hooks.start_drain is None:
            self._draining.set()  # the late arrivals go anyway; the report says why
            return "not run: the soak drains only a service it runs itself (--pressure " \
                   "without --addr); SIGTERM a remote server to drain it"
        at = min((r.arrival_s for r in plan if r.after_drain), default=None)
        if at is None:
            return None
        await asyncio.sleep(max(0.0, self._t0 + at - time.monotonic()))
        self.drain_at_s = time.monotonic() - self._t0
        loop = asyncio.get_running_loop()
        done = await loop.run_in_executor(None, self.hooks.start_drain)
        self._draining.set()
        busy = self._open
        await asyncio.wrap_future(done)
        return f"drained at {self.drain_at_s:.1f}s with {busy} streams open, done after " \
               f"{time.monotonic() - self._t0 - self.drain_at_s:.1f}s"

    # ---- one request -----------------------------------------------------------------
    async def _one(self, stub, md, req: SoakRequest) -> None:
        rec = self.records[req.key] = RequestRecord(
            req.request_id, req.kind, req.key, cancel_planned=req.cancel_phase,
            abort_planned=req.abort_phase, client_deadline_s=req.client_deadline_s,
            reuses=req.reuses, after_drain=req.after_drain)
        ended = self._ended.setdefault(req.key, asyncio.Event())
        try:
            await asyncio.sleep(max(0.0, self._t0 + req.arrival_s - time.monotonic()))
            if req.reuses is not None:  # the id is free once that request has ended
                await self._ended.setdefault(req.reuses, asyncio.Event()).wait()
                if req.reuses in self._aborts:  # and no Abort of it can land on this one
                    await asyncio.wait({self._aborts[req.reuses]})
            if req.after_drain:
                await self._draining.wait()
            await self._stream(stub, md, req, rec)
        finally:
            ended.set()
            self._bar.set_postfix(kills=len(self.kills), refresh=False)
            self._bar.update(1)

    async def _stream(self, stub, md, req: SoakRequest, rec: RequestRecord) -> None:
        deadline = min(req.client_deadline_s or math.inf, self.cfg.deadline_s)
        # before the call: its deadline runs from its creation, so a client deadline's
        # DEADLINE_EXCEEDED is never seen "early" when creating the call takes a while
        t0 = time.monotonic()
        call = stub.Generate(build_request(
            list(req.prompt), request_id=req.request_id, temperature=req.temperature,
            max_tokens=req.max_tokens, ignore_eos=req.ignore_eos, seed=req.seed),
            metadata=md, timeout=deadline)
        rec.start_s = t0 - self._t0
        self._open += 1
        act = (lambda: self._abort(stub, md, req, rec)) if req.abort_phase else (
            lambda: self._cancel(call, rec))
        timer = None
        if req.aimed_phase in ("queued", "admission", "prefill"):
            timer = (asyncio.ensure_future(self._act_in_phase(act, rec, req))
                     if self.phase_probe else asyncio.get_running_loop().call_later(
                         self._cancel_delay(req), act))
        try:
            async for r in call:
                self._sample_leg(rec)
                if rec.terminal_count:
                    rec.violations.append("a message after the final one")
                rec.tokens.extend(r.token_ids)
                if rec.ttft_s is None and r.token_ids:
                    rec.ttft_s = time.monotonic() - t0
                    self._ttfts.setdefault(req.kind, []).append(rec.ttft_s)
                if r.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    rec.terminal_count += 1
                    rec.finish_reason = FINISH_FROM_PROTO[r.finish_reason]
                elif req.cancel_after_tokens and len(rec.tokens) >= req.cancel_after_tokens:
                    act()
            if rec.finish_reason in ("stop", "length"):
                rec.outcome = "finished"
            elif rec.finish_reason == "abort" and (rec.abort_sent or self._draining.is_set()):
                rec.outcome = "aborted"  # by our Abort RPC, or by the drain's deadline
            else:
                rec.outcome = f"unexpected:finish_reason={rec.finish_reason}"
        except asyncio.CancelledError:
            if not rec.cancel_sent:
                raise  # the soak itself is being cancelled
            if rec.terminal_count:  # our cancel raced the final message, which won
                rec.outcome, rec.message = "finished", "cancel sent as the stream ended"
            else:
                self._end(rec, "CANCELLED", "cancelled by the soak")
        except grpc.aio.AioRpcError as e:
            self._rpc_error(rec, e, time.monotonic() - t0)
        finally:
            if timer is not None:
                timer.cancel()
            self._sample_leg(rec)  # a stream that never spoke still shows its legs
            self._open -= 1
            rec.e2e_s = time.monotonic() - t0

    def _rpc_error(self, rec: RequestRecord, e: grpc.aio.AioRpcError, elapsed: float) -> None:
        code = e.code().name
        if code == "CANCELLED" and rec.cancel_sent and rec.terminal_count:
            rec.outcome, rec.message = "finished", "cancel sent as the stream ended"
        elif code == "CANCELLED" and rec.cancel_sent:
            self._end(rec, "CANCELLED", e.details() or "")
        elif code == "DEADLINE_EXCEEDED" and rec.client_deadline_s is not None \
                and elapsed >= rec.client_deadline_s * 0.99 - DEADLINE_SLACK_S:
            self._end(rec, "DEADLINE_EXCEEDED", e.details() or "client deadline")
        elif code == "DEADLINE_EXCEEDED":
            self._end(rec, "hang", f"no end within {self.cfg.deadline_s:g}s")
        elif code in TERMINAL:
            self._end(rec, code, e.details() or "")
        else:
            self._end(rec, f"unexpected:{code}", e.details() or "")
        if not rec.message:
            rec.violations.append(f"status {code} without a message")

    async def _act_in_phase(self, act, rec: RequestRecord, req: SoakRequest) -> None:
        """In-process runs: cancel/abort once the router shows the target phase (bounded
        wait; a first token or the end of the window acts whatever the phase)."""
        if req.aimed_phase == "admission":  # right behind the Generate: races admission
            await asyncio.sleep(req.cancel_after_s)
            return act()
        order = ("admission", "queued", "prefill", "transfer", "decode")
        later = order[order.index(req.aimed_phase) + 1:]
        # a long document may wait for admission a while before its prefill starts
        end = time.monotonic() + (2.0 if req.aimed_phase == "queued" else 15.0)
        while time.monotonic() < end and not rec.tokens and not rec.terminal_count:
            phase = self.phase_probe(rec.request_id)
            if phase == req.aimed_phase or phase in later:
                break  # there, or it went past without stopping there
            await asyncio.sleep(0.002)
        act()

    def _cancel_delay(self, req: SoakRequest) -> float:
        """A remote client cannot see the phase: aim a mid-prefill cancel at a random point
        before the first token, scaled by the TTFTs this run has seen for the same kind."""
        seen = self._ttfts.get(req.kind, [])
        if req.aimed_phase != "prefill" or len(seen) < 5:
            return req.cancel_after_s
        return req.cancel_frac * median(seen[-50:])

    def _end(self, rec: RequestRecord, outcome: str, message: str) -> None:
        rec.terminal_count += 1
        rec.outcome, rec.message = outcome, message

    def _observe(self, rec: RequestRecord, planned: str | None) -> str | None:
        n = len(rec.tokens)
        observed = self.phase_probe(rec.request_id) if self.phase_probe else None
        self._sample_leg(rec)
        return observed or (planned if n == 0 else "transfer" if n == 1 else "decode")

    def _sample_leg(self, rec: RequestRecord) -> None:
        if self.hooks.leg_probe is not None:
            leg = self.hooks.leg_probe(rec.request_id)
            if leg is not None:
                rec.max_leg = max(rec.max_leg or 0, leg)

    def _cancel(self, call, rec: RequestRecord) -> None:
        if rec.cancel_sent or rec.terminal_count:
            return
        rec.cancel_sent = True
        rec.cancel_observed = self._observe(rec, rec.cancel_planned)
        call.cancel()

    def _abort(self, stub, md, req: SoakRequest, rec: RequestRecord) -> None:
        if rec.abort_sent or rec.terminal_count:
            return
        rec.abort_sent = True
        rec.cancel_observed = self._observe(rec, rec.abort_planned)

        async def send() -> None:
            try:
                resp = await stub.Abort(pb.AbortRequest(request_id=req.request_id),
                                        metadata=md, timeout=60)
                rec.abort_found = resp.found
            except grpc.aio.AioRpcError as e:
                if not self._draining.is_set():  # a drained server stops answering: fine
                    rec.violations.append(f"Abort RPC failed: {e.code().name} {e.details()}")

        self._aborts[req.key] = asyncio.ensure_future(send())


async def run_soak(cfg: SoakConfig, phase_probe: PhaseProbe | None = None,
                   hooks: SoakHooks | None = None) -> SoakReport:
    return await SoakRunner(cfg, phase_probe, hooks).run()
