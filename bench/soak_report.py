"""The soak's end checks (quiescence, metrics endpoint, exact greedy tokens) and its
summary: a printed table and a JSON file. `SoakReport.ok` decides the exit code."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cluster.grpc.convert import stats_from_proto
from cluster.router.types import ClusterStats
from engine.quantiles import percentile
from proto.pdserve.v1 import pdserve_pb2 as pb

if TYPE_CHECKING:
    from bench.soak_plan import SoakRequest, SoakRun

# per worker: counters that must be zero once the service is idle
IDLE_FIELDS = ("kv_blocks_used", "num_running", "num_waiting", "queue_depth", "send_queue_depth")
IDLE_EXTRA = ("jobs", "kv_inflight_bytes", "kv_queued_bytes", "kv_rx_active_requests")
METRIC_GAUGES = ("pdserve:kv_cache_usage_perc", "pdserve:num_requests_running",
                 "pdserve:num_requests_waiting", "pdserve:kv_inflight_bytes")


@dataclass
class RequestRecord:
    request_id: str
    kind: str
    key: str = ""
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
    cancel_observed: str | None = None  # phase at the moment of the cancel (or abort)
    abort_planned: str | None = None
    abort_sent: bool = False
    abort_found: bool | None = None  # the Abort RPC's answer
    max_leg: int | None = None  # highest leg seen (in-process): > 1 means redispatched
    client_deadline_s: float | None = None
    reuses: str | None = None  # key of the request whose (ended) id this one sent again
    after_drain: bool = False


@dataclass
class SoakReport:
    config: dict[str, Any]
    summary: dict[str, Any]
    leaks: list[str] = field(default_factory=list)
    hangs: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)  # bad / missing terminal statuses
    kills: list[dict] = field(default_factory=list)
    requests: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        survived = all(k["back_after_s"] is not None for k in self.kills)
        return survived and not (self.leaks or self.hangs or self.mismatches or self.violations)

    def to_json(self) -> str:
        return json.dumps({"ok": self.ok, **asdict(self)}, indent=1, default=str)

    def write(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    def table(self) -> str:
        s = self.summary
        lines = [f"pdserve soak: {s['requests']} requests in {s['traffic_s']:.1f} s "
                 f"(seed {self.config['seed']}, target {self.config['rate']:g} req/s, "
                 f"cancel rate {self.config['cancel_rate']:g})", "",
                 f"{'outcome':<28}{'count':>7}"]
        if self.config.get("emulate"):  # every output of an emulated service says so
            from engine.config import EmulateConfig

            label = EmulateConfig(self.config["emulate"], self.config["model_shape"]).label
            lines.insert(1, f"service on the {label}")
        lines += [f"{k:<28}{v:>7}" for k, v in s["outcomes"].items()]
        lines += ["", f"{'cancel phase':<14}{'planned':>9}{'cancelled':>11}{'missed':>8}"]
        for ph, row in s["cancel_phases"].items():
            lines.append(f"{ph:<14}{row['planned']:>9}{row['cancelled']:>11}{row['missed']:>8}")
        lines.append(f"(cancelled = phase {s['phase_source']} at the moment of the cancel; "
                     "missed = the request ended first)")
        if s["phase_source"] == "seen by the client":
            lines.append("(client view: queued/prefill = cancelled before the first token, at "
                         "the planned moment; transfer = after exactly one token)")
        if "pressure" in s:
            from bench.soak_pressure import pressure_lines

            lines += [""] + pressure_lines(s["pressure"])
        lines += ["", f"kills: {len(self.kills)}, survived {s['kills_survived']}"]
        lines += [f"  {k['at_s']:7.1f}s  {k['role']:<8}{k['worker_id']:<12}" + (
            f"back after {k['back_after_s']:.1f}s" if k["back_after_s"] is not None
            else "DID NOT COME BACK") for k in self.kills]
        idle = (f"service idle {s['quiesce_s']:.1f} s after the last request ended"
                if not s.get("idle_problems") else "service NOT idle at the end")
        lines += ["", idle, f"exact-token check: {s['tokens_checked']} greedy requests compared "
                  f"({s['tokens_skipped']})",
                  f"leaks found: {len(self.leaks)}   hangs found: {len(self.hangs)}   "
                  f"token mismatches: {len(self.mismatches)}   "
                  f"status violations: {len(self.violations)}"]
        for title, items in (("LEAK", self.leaks), ("HANG", self.hangs),
                             ("MISMATCH", self.mismatches), ("VIOLATION", self.violations)):
            lines += [f"  {title}: {x}" for x in items[:10]]
            if len(items) > 10:
                lines.append(f"  ... {len(items) - 10} more {title.lower()}s in the JSON")
        lines += ["", "RESULT: " + ("PASS" if self.ok else "FAIL")]
        return "\n".join(lines)


def idle_problems(st: ClusterStats) -> list[str]:
    """What keeps the service from being idle (empty list: quiescent, nothing leaked)."""
    out = []
    if st.num_inflight or st.router_queue_depth:
        out.append(f"router: {st.num_inflight} in flight, {st.router_queue_depth} queued")
    for w in st.workers:
        if not w.alive:
            out.append(f"{w.worker_id}: not alive")
            continue
        bad = {f: getattr(w, f) for f in IDLE_FIELDS if getattr(w, f)}
        bad |= {f: w.extra[f] for f in IDLE_EXTRA if w.extra.get(f)}
        if bad:
            out.append(f"{w.worker_id}: " + ", ".join(f"{k}={v:g}" for k, v in bad.items()))
    return out


async def wait_quiescent(stub, md, timeout_s: float,
                         stats_fn=None) -> tuple[ClusterStats | None, list[str]]:
    """Poll GetStats (or ``stats_fn()``, e.g. the router itself once a drain stopped the
    gRPC server) until the service is idle (or `timeout_s`); (last stats, problems)."""
    end = time.monotonic() + timeout_s
    st, problems = None, ["GetStats never answered"]
    while True:
        try:
            st = await stats_fn() if stats_fn is not None else stats_from_proto(
                await stub.GetStats(pb.GetStatsRequest(), metadata=md, timeout=30))
            problems = idle_problems(st)
        except Exception as e:  # noqa: BLE001 - reported as a problem, retried
            problems = [f"GetStats failed: {e}"]
        if not problems or time.monotonic() > end:
            return st, problems
        await asyncio.sleep(0.5)


def metrics_problems(url: str, timeout_s: float = 15.0) -> list[str]:
    """Non-zero pool gauges (or dead workers) on the Prometheus endpoint, after retries
    (the server refreshes its gauges every second)."""
    from prometheus_client.parser import text_string_to_metric_families

    end = time.monotonic() + timeout_s
    while True:
        problems = []
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                text = r.read().decode()
            for fam in text_string_to_metric_families(text):
                for s in fam.samples:
                    if s.name in METRIC_GAUGES and s.value != 0:
                        problems.append(f"metrics: {s.name}{s.labels} = {s.value:g}")
                    if s.name == "pdserve:worker_alive" and s.value != 1:
                        problems.append(f"metrics: worker {s.labels} not alive")
        except Exception as e:  # noqa: BLE001 - an unreachable endpoint is a finding
            problems = [f"metrics endpoint {url}: {e}"]
        if not problems or time.monotonic() > end:
            return problems
        time.sleep(1.0)


def reference_tokens(model: str | None, reqs: list[SoakRequest],
                     emulate: tuple[str, str] | None = None) -> dict[str, list[int]]:
    """engine.LLM's greedy tokens for these requests (one batched offline run); with
    ``emulate`` (profile, shape), on the emulated device (engine/emulate/offline.py)."""
    from engine import LLM, SamplingParams

    if emulate is not None:
        from engine.emulate.offline import emulated_engine_config

        llm = LLM.from_config(emulated_engine_config(*emulate))
    elif model == "tiny":
        from engine.tiny_model import ensure_model

        llm = LLM(str(ensure_model("tiny", "llama")))
    else:
        llm = LLM(model)
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=r.ignore_eos)
              for r in reqs]
    outs = llm.generate([list(r.prompt) for r in reqs], params)
    return {r.key: list(o.token_ids) for r, o in zip(reqs, outs, strict=True)}


async def finish_report(runner: SoakRun, plan: list[SoakRequest], stub, md,
                        traffic_s: float, pools: dict[str, int] | None = None,
                        drained: str | None = None) -> SoakReport:
    cfg, records = runner.cfg, runner.records
    config = asdict(cfg)
    config["token"] = "***" if cfg.token else None  # never the secret itself
    report = SoakReport(config=config, summary={})
    for rec in records.values():
        if rec.outcome == "hang" or rec.e2e_s > cfg.deadline_s:
            report.hangs.append(f"{rec.key}: {rec.outcome} after {rec.e2e_s:.1f}s")
        if rec.terminal_count != 1:
            report.violations.append(f"{rec.key}: {rec.terminal_count} terminal statuses")
        if rec.outcome.startswith("unexpected") or rec.outcome == "pending":
            report.violations.append(f"{rec.key}: {rec.outcome} {rec.message}")
        report.violations += [f"{rec.key}: {v}" for v in rec.violations]
    t0 = time.monotonic()
    _, problems = await wait_quiescent(stub, md, cfg.quiesce_timeout_s, runner.hooks.stats)
    quiesce_s = time.monotonic() - t0
    for p in problems:
        (report.hangs if "in flight" in p or "num_running" in p else report.leaks).append(p)
    if cfg.metrics_url and not drained:  # a drained service's endpoint may be gone
        loop = asyncio.get_running_loop()
        report.leaks += await loop.run_in_executor(None, metrics_problems, cfg.metrics_url)
    checked, skipped = 0, "no --model given"
    if cfg.model or cfg.emulate:
        greedy = [r for r in plan if r.greedy and records[r.key].tokens]
        loop = asyncio.get_running_loop()
        emulate = (cfg.emulate, str(cfg.model_shape)) if cfg.emulate else None
        ref = await loop.run_in_executor(None, reference_tokens, cfg.model, greedy, emulate)
        for r in greedy:
            rec, want = records[r.key], ref[r.key]
            complete = rec.outcome == "finished"
            if (rec.tokens != want) if complete else (rec.tokens != want[: len(rec.tokens)]):
                report.mismatches.append(
                    f"{r.key} ({rec.outcome}, {len(rec.tokens)} tokens): got "
                    f"{rec.tokens[:12]}..., engine.LLM gives {want[:12]}...")
            checked += 1
        skipped = "complete outputs equal, cancelled/failed ones a prefix"
    report.kills = [asdict(k) for k in runner.kills]
    report.requests = [asdict(r) for r in records.values()]
    report.summary = _summary(runner, plan, traffic_s, checked, skipped)
    report.summary["quiesce_s"] = quiesce_s
    report.summary["idle_problems"] = problems
    if cfg.pressure:
        from bench.soak_pressure import pressure_summary

        report.summary["pressure"] = pressure_summary(runner, plan, pools or {}, drained)
    return report


def _summary(runner: SoakRun, plan: list[SoakRequest], traffic_s: float, checked: int,
             skipped: str) -> dict[str, Any]:
    from bench.soak_plan import PHASES, TERMINAL

    recs = runner.records.values()
    outcomes = Counter(r.outcome for r in recs)
    ordered = {k: outcomes.pop(k, 0) for k in TERMINAL} | dict(sorted(outcomes.items()))
    phases = {}
    for ph in PHASES:
        planned = [r for r in recs if r.cancel_planned == ph]
        phases[ph] = {"planned": len(planned),
                      "cancelled": sum(r.cancel_observed == ph and r.outcome == "CANCELLED"
                                       for r in recs),
                      "missed": sum(not r.cancel_sent for r in planned)}
    other = Counter(r.cancel_observed for r in recs if r.cancel_sent
                    and r.cancel_observed not in PHASES)
    for ph, n in other.items():
        phases[str(ph)] = {"planned": 0, "cancelled": n, "missed": 0}
    return {
        "requests": len(plan), "traffic_s": traffic_s, "outcomes": ordered,
        "kinds": dict(Counter(r.kind for r in plan)), "cancel_phases": phases,
        "phase_source": "seen by the router" if runner.phase_probe else "seen by the client",
        "kills": len(runner.kills),
        "kills_survived": sum(k.back_after_s is not None for k in runner.kills),
        "tokens_checked": checked, "tokens_skipped": skipped,
        "ttft_p50_s": _pct([r.ttft_s for r in recs if r.ttft_s is not None], 0.5),
        "e2e_max_s": max((r.e2e_s for r in recs), default=0.0),
    }


def _pct(xs: list[float], q: float) -> float | None:
    return percentile(xs, 100 * q) if xs else None
