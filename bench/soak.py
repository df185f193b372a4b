"""Soak / chaos harness: drive a running service with a seeded request mix, cancel
streams at every phase, kill worker actors, then check that nothing leaked or hung.

    pdserve soak --addr 127.0.0.1:50051 --requests 1000 --rate 8 --cancel-rate 0.3 \\
        --kill-every 30 --ray-address auto --model tiny --metrics-url \\
        http://127.0.0.1:9090/metrics --json soak.json

The workload mixes chat, long-document and shared-prefix requests (mostly greedy) with
Poisson arrivals at ``rate``. A ``cancel_rate`` share of the streams is cancelled; the
four target phases (queued, prefill, transfer, decode) take turns so each is hit:
queued/prefill cancel after a short random delay before the first token (in-process,
with a ``phase_probe`` into the router, at the moment the router shows that phase),
transfer at the first token (the prefill's token; its KV is still in flight or just
landed), decode after a random number of tokens. With ``kill_every_s`` a random worker of alternating
pools is killed through Ray (see cluster/faults.py) every S seconds after the previous
victim is back, at most ``max_restarts`` times per actor. At the end the run waits for
quiescence and checks (bench/soak_report.py): exactly one terminal status per request
(finished, CANCELLED, UNAVAILABLE, RESOURCE_EXHAUSTED), none over ``deadline_s``, zero
KV blocks / queues / send queues / in-flight KV bytes on every worker, and greedy
tokens equal to ``engine.LLM``'s (complete outputs equal, cancelled ones a prefix).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from tqdm import tqdm

from bench.soak_plan import PHASES, TERMINAL, SoakConfig, SoakRequest, build_plan
from bench.soak_report import SoakReport, finish_report
from cluster.auth import auth_metadata, channel_credentials
from cluster.convert import FINISH_FROM_PROTO, build_request
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc

__all__ = ["PHASES", "TERMINAL", "SoakConfig", "SoakRequest", "SoakRunner", "build_plan",
           "find_victims", "router_phase_probe", "run_soak"]
log = logging.getLogger(__name__)


@dataclass
class RequestRecord:
    request_id: str
    kind: str
    outcome: str = "pending"  # a TERMINAL value, "hang" or "unexpected:<why>"
    message: str = ""
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    terminal_count: int = 0
    violations: list[str] = field(default_factory=list)
    start_s: float = 0.0
    ttft_s: float | None = None
    e2e_s: float = 0.0
    cancel_planned: str | None = None
    cancel_sent: bool = False
    cancel_observed: str | None = None  # phase at the moment of the cancel


@dataclass
class KillRecord:
    at_s: float
    worker_id: str
    role: str
    actor: str
    back_after_s: float | None  # None: did not come back in restart_timeout_s


PhaseProbe = Callable[[str], "str | None"]


class SoakRunner:
    """One soak run; `phase_probe(request_id)` (in-process tests) reports the request's
    true phase at the moment it is cancelled, else the client's view is recorded."""

    def __init__(self, cfg: SoakConfig, phase_probe: PhaseProbe | None = None):
        self.cfg = cfg
        self.phase_probe = phase_probe
        self.records: dict[str, RequestRecord] = {}
        self.kills: list[KillRecord] = []
        self._t0 = 0.0
        self._traffic_done = asyncio.Event()
        self._bar = None
        self._ttfts: dict[str, list[float]] = {}  # kind -> TTFTs seen so far

    async def run(self) -> SoakReport:
        cfg = self.cfg
        options = [("grpc.max_receive_message_length", 64 << 20)]
        channel = (grpc.aio.secure_channel(cfg.addr, channel_credentials(cfg.tls_ca), options)
                   if cfg.tls_ca else grpc.aio.insecure_channel(cfg.addr, options))
        async with channel:
            stub = pb_grpc.GenerationStub(channel)
            md = auth_metadata(cfg.token)
            info = await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=md, timeout=60)
            plan = build_plan(cfg, info.vocab_size, info.max_model_len)
            actors = []
            if cfg.kill_every_s is not None and cfg.max_kills != 0:
                # find the victims before any traffic: no Ray access fails fast
                actors = await asyncio.get_running_loop().run_in_executor(
                    None, find_victims, cfg.ray_address, cfg.actor_tag)
            self._t0 = time.monotonic()
            self._bar = tqdm(total=len(plan), desc="soak", unit="req", leave=False,
                             disable=not cfg.progress)
            chaos = asyncio.ensure_future(self._chaos(actors))
            try:
                await asyncio.gather(*(self._one(stub, md, r) for r in plan))
            finally:
                self._bar.close()
            self._traffic_done.set()
            await chaos
            traffic_s = time.monotonic() - self._t0
            return await finish_report(self, plan, stub, md, traffic_s)

    # ---- one request -----------------------------------------------------------------
    async def _one(self, stub, md, req: SoakRequest) -> None:
        rec = self.records[req.request_id] = RequestRecord(
            req.request_id, req.kind, cancel_planned=req.cancel_phase)
        await asyncio.sleep(max(0.0, self._t0 + req.arrival_s - time.monotonic()))
        call = stub.Generate(build_request(
            list(req.prompt), request_id=req.request_id, temperature=req.temperature,
            max_tokens=req.max_tokens, ignore_eos=req.ignore_eos, seed=req.seed),
            metadata=md, timeout=self.cfg.deadline_s)
        t0 = time.monotonic()
        rec.start_s = t0 - self._t0
        timer = None
        if req.cancel_phase in ("queued", "prefill"):
            timer = (asyncio.ensure_future(self._cancel_in_phase(call, rec, req))
                     if self.phase_probe else asyncio.get_running_loop().call_later(
                         self._cancel_delay(req), self._cancel, call, rec))
        try:
            async for r in call:
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
                    self._cancel(call, rec)
            if rec.finish_reason in ("stop", "length"):
                rec.outcome = "finished"
            else:
                rec.outcome = f"unexpected:finish_reason={rec.finish_reason}"
        except asyncio.CancelledError:
            if not rec.cancel_sent:
                raise  # the soak itself is being cancelled
            if rec.terminal_count:  # our cancel raced the final message, which won
                rec.outcome, rec.message = "finished", "cancel sent as the stream ended"
            else:
                self._ended(rec, "CANCELLED", "cancelled by the soak")
        except grpc.aio.AioRpcError as e:
            code = e.code().name
            if code == "CANCELLED" and rec.cancel_sent and rec.terminal_count:
                rec.outcome, rec.message = "finished", "cancel sent as the stream ended"
            elif code == "CANCELLED" and rec.cancel_sent:
                self._ended(rec, "CANCELLED", e.details() or "")
            elif code == "DEADLINE_EXCEEDED":
                self._ended(rec, "hang", f"no end within {self.cfg.deadline_s:g}s")
            elif code in TERMINAL:
                self._ended(rec, code, e.details() or "")
            else:
                self._ended(rec, f"unexpected:{code}", e.details() or "")
            if not rec.message:
                rec.violations.append(f"status {code} without a message")
        finally:
            if timer is not None:
                timer.cancel()
            rec.e2e_s = time.monotonic() - t0
            self._bar.set_postfix(kills=len(self.kills), refresh=False)
            self._bar.update(1)

    async def _cancel_in_phase(self, call, rec: RequestRecord, req: SoakRequest) -> None:
        """In-process runs: cancel once the router shows the target phase (bounded wait;
        a first token or the end of the window cancels whatever the phase)."""
        later = PHASES[PHASES.index(req.cancel_phase) + 1:]
        # a long document may wait for admission a while before its prefill starts
        end = time.monotonic() + (2.0 if req.cancel_phase == "queued" else 15.0)
        while time.monotonic() < end and not rec.tokens and not rec.terminal_count:
            phase = self.phase_probe(req.request_id)
            if phase == req.cancel_phase or phase in later:
                break  # there, or it went past without stopping there
            await asyncio.sleep(0.002)
        self._cancel(call, rec)

    def _cancel_delay(self, req: SoakRequest) -> float:
        """A remote client cannot see the phase: aim a mid-prefill cancel at a random point
        before the first token, scaled by the TTFTs this run has seen for the same kind."""
        seen = self._ttfts.get(req.kind, [])
        if req.cancel_phase != "prefill" or len(seen) < 5:
            return req.cancel_after_s
        recent = sorted(seen[-50:])
        return req.cancel_frac * recent[len(recent) // 2]

    def _ended(self, rec: RequestRecord, outcome: str, message: str) -> None:
        rec.terminal_count += 1
        rec.outcome, rec.message = outcome, message

    def _cancel(self, call, rec: RequestRecord) -> None:
        if rec.cancel_sent or rec.terminal_count:
            return
        rec.cancel_sent = True
        n = len(rec.tokens)
        observed = self.phase_probe(rec.request_id) if self.phase_probe else None
        rec.cancel_observed = observed or (
            rec.cancel_planned if n == 0 else "transfer" if n == 1 else "decode")
        call.cancel()

    # ---- chaos: kill worker actors ----------------------------------------------------
    async def _chaos(self, actors: list) -> None:
        cfg = self.cfg
        if not actors:
            return
        from cluster.faults import kill_worker, wait_worker_back

        loop = asyncio.get_running_loop()
        rng = random.Random(cfg.seed + 1)
        offset = rng.randrange(len(cfg.kill_roles))
        kills_of: dict[str, int] = {}
        while cfg.max_kills is None or len(self.kills) < cfg.max_kills:
            if cfg.max_kills is None and self._traffic_done.is_set():
                return
            await asyncio.sleep(cfg.kill_every_s)
            roles = [cfg.kill_roles[(len(self.kills) + offset + k) % len(cfg.kill_roles)]
                     for k in range(len(cfg.kill_roles))]
            victim = None
            for role in roles:
                pool = [a for a in actors if a.role == role
                        and kills_of.get(a.name, 0) < cfg.max_restarts]
                if pool:
                    victim = rng.choice(pool)
                    break
            if victim is None:
                log.warning("soak: every worker was killed max_restarts times; no more kills")
                return
            at = time.monotonic() - self._t0
            log.warning("soak: killing %s (%s) at %.1fs", victim.name, victim.role, at)
            await loop.run_in_executor(None, kill_worker, victim)
            kills_of[victim.name] = kills_of.get(victim.name, 0) + 1
            back = await loop.run_in_executor(None, wait_worker_back, victim,
                                              cfg.restart_timeout_s)
            self.kills.append(KillRecord(at, victim.worker_id, victim.role, victim.name, back))
            if back is None:
                return


def find_victims(ray_address: str | None, actor_tag: str | None) -> list:
    """Join the service's Ray cluster (unless this process already is in one) and list
    its worker actors (cluster.faults.find_worker_actors)."""
    import ray

    from cluster.faults import find_worker_actors

    if not ray.is_initialized():
        ray.init(address=ray_address or "auto", namespace="pdserve-soak", log_to_driver=False,
                 configure_logging=False)
    actors = find_worker_actors(actor_tag)
    if not actors:
        raise RuntimeError("no pdserve worker actors (pdserve-<tag>-prefill-N / decode-N) in "
                           f"the Ray cluster at {ray_address!r}")
    return actors


async def run_soak(cfg: SoakConfig, phase_probe: PhaseProbe | None = None) -> SoakReport:
    return await SoakRunner(cfg, phase_probe).run()


def router_phase_probe(router) -> PhaseProbe:
    """In-process runs: a request's phase from the disaggregated router's own state."""

    def probe(request_id: str) -> str | None:
        f = router.flights.get(request_id)
        if f is None:
            return "not-routed"  # still in the gRPC front door (or already gone)
        if f.done:
            return "ending"
        n = len(f.generated)
        on_prefill = f.prefill is not None and f.leg_id in f.prefill.legs
        if f.decode is None:
            return "queued"  # waiting for decode admission (or between legs)
        if n == 0:
            return "prefill" if on_prefill else "queued"
        return "transfer" if n == 1 else "decode"

    return probe
