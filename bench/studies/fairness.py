"""fairness: prefill policy x KV send queue -> short/long TTFT, Jain's indices, tenant shares.

Two tenants share the service: ``gold`` (weight 2, TTFT deadline 1 s) and ``free``
(weight 1, deadline 4 s), each sending the same mix of streaming chats and long
prompts. The prefill policy decides which prompt gets the step's token budget
(fcfs, srpt, round-robin, wfq by tenant weight, edf by TTFT deadline); the send queue
decides whose KV goes first on the link (fcfs, wfq). Jain's index over slowdowns uses
an idle-latency estimate from the reference measurement (prefill scaled linearly with
prompt length + one decode step per further token). Tenant shares are each tenant's
part of the prefill tokens computed while both tenants had prompts waiting (from the
trace); the tenant index is Jain over share / weight (1.0 = weighted-fair).
"""

from __future__ import annotations

import itertools
import time

from bench.metrics import jain_index
from bench.records import RequestRecord
from bench.studies.common import (
    TENANT_WEIGHTS,
    Column,
    ConfigRun,
    StudyContext,
    StudyResult,
    config_detail,
    mixed_workload,
    pct_ms,
)

NAME = "fairness"
POLICIES = ("fcfs", "srpt", "round-robin", "wfq", "edf")
QUEUES = ("fcfs", "wfq")
QUICK = ("fcfs+fcfs", "srpt+fcfs", "wfq+wfq")
DEADLINES_MS = {"gold": 1000.0, "free": 4000.0}
COLUMNS = [
    Column("config", "config"), Column("prefill_policy", "prefill policy"),
    Column("send_queue", "send queue"), Column("decode_admission", "decode admission"),
    Column("short_ttft_p99_ms", "short TTFT p99 (ms)"),
    Column("long_ttft_mean_ms", "long TTFT mean (ms)"),
    Column("long_ttft_p99_ms", "long TTFT p99 (ms)"),
    Column("gold_ttft_p99_ms", "gold TTFT p99 (ms)"),
    Column("free_ttft_p99_ms", "free TTFT p99 (ms)"),
    Column("jain_slowdown", "Jain (slowdown)", "{:.3f}"),
    Column("jain_contended", "Jain (contended share/weight)", "{:.3f}"),
    Column("gold_share", "gold share (contended)", "{:.2f}"),
    Column("free_share", "free share (contended)", "{:.2f}"),
    Column("gold_decode_share", "gold share of contended decode admission", "{:.2f}"),
    Column("completed", "ok"), Column("failed", "failed"),
]


def config_names(quick: bool) -> list[str]:
    if quick:
        return list(QUICK)
    return [f"{p}+{q}" for p, q in itertools.product(POLICIES, QUEUES)]


def ttft_p99(records: list[RequestRecord], **match: str) -> float | None:
    ok = [r for r in records if r.success and r.ttft is not None
          and all(getattr(r, k) == v for k, v in match.items())]
    return pct_ms([r.ttft for r in ok])


def contended_shares(run: ConfigRun) -> dict[str, float] | None:
    """Each tenant's share of the prefill tokens computed while *every* tenant had a
    prompt waiting for its first token (the only time a policy can favour one; over a
    whole run that completes, shares are fixed by the workload). From the trace."""
    off = run.output.wall_offset
    pending: dict[str, list[tuple[float, float]]] = {}
    for r in run.records:
        if r.success and r.ttft is not None:
            pending.setdefault(r.tenant, []).append((r.send_time + off,
                                                     r.send_time + r.ttft + off))
    tokens = dict.fromkeys(pending, 0)
    for e in run.events:
        if e.phase != "prefill_chunk" or e.tenant not in tokens or not e.scheduled_tokens:
            continue
        mid = (e.start + e.end) / 2
        if all(any(a <= mid <= b for a, b in spans) for spans in pending.values()):
            tokens[e.tenant] += e.scheduled_tokens
    total = sum(tokens.values())
    return {k: v / total for k, v in tokens.items()} if total and len(tokens) > 1 else None


def admission_shares(run: ConfigRun) -> dict[str, float] | None:
    """Each tenant's share of the prompt tokens admitted to decode while another tenant's
    request waited for decode KV (the router's count, ClusterStats)."""
    tokens = run.output.admission_tokens
    total = sum(tokens.values())
    return {k: v / total for k, v in tokens.items()} if total and len(tokens) > 1 else None


def findings(result: StudyResult) -> list[str]:
    """The fairest configuration, and each one's contended split against the weights."""
    rows = [r for r in result.rows if r.get("jain_contended") is not None]
    if not rows:
        return []
    want = TENANT_WEIGHTS["gold"] / (TENANT_WEIGHTS["gold"] + TENANT_WEIGHTS["free"])
    best = max(rows, key=lambda r: r["jain_contended"])
    out = [f"{best['config']} came closest to the weights "
           f"{TENANT_WEIGHTS['gold']:g}:{TENANT_WEIGHTS['free']:g}: Jain index of the contended "
           f"shares over weights {best['jain_contended']:.3f}."]
    for r in rows:
        if r.get("gold_share") is not None:
            line = f"{r['config']}: gold got {r['gold_share']:.2f} of the contended prefill"
            if r.get("gold_decode_share") is not None:
                line += f" and {r['gold_decode_share']:.2f} of the contended decode admission"
            out.append(f"{line} (its weight's share: {want:.2f}).")
    return out

def run(ctx: StudyContext) -> StudyResult:
    from bench.workload import TenantSpec

    t0 = time.monotonic()
    names = ctx.selected(config_names(ctx.opts.quick) if not ctx.opts.configs
                         else config_names(False))
    tenants = [TenantSpec(t, share=0.5, weight=w, ttft_deadline_ms=DEADLINES_MS[t])
               for t, w in TENANT_WEIGHTS.items()]
    requests, workload = mixed_workload(ctx, n=ctx.n_requests(16, 64), rate=5.0, tag="fr",
                                        long_fraction=0.3, tenants=tenants)
    ref = ctx.reference

    def alone(r: RequestRecord) -> float:
        return ref.prefill_estimate_s(r.prompt_len) + max(0, r.n_out - 1) * ref.decode_step_s

    base = ctx.base_config()
    rows, details = [], {}
    for name in names:
        policy, queue = name.split("+")
        # a wfq configuration shares decode admission by the same weights too (one
        # scheduler.tenant_weights drives the three policies)
        cfg = base.with_values({"scheduler.fairness_policy": policy,
                                "transfer.send_queue": queue,
                                "scheduler.decode_admission": "wfq" if policy == "wfq"
                                else "fcfs"})
        r = ctx.run(NAME, name, cfg, requests, latency_alone=alone)
        m, recs = r.metrics, r.records
        longs = [x.ttft for x in recs if x.kind == "long" and x.success and x.ttft]
        shares, admitted = contended_shares(r), admission_shares(r)
        rows.append({
            "config": name, "prefill_policy": policy, "send_queue": queue,
            "decode_admission": cfg.scheduler.decode_admission,
            "short_ttft_p99_ms": ttft_p99(recs, kind="chat"),
            "long_ttft_mean_ms": sum(longs) / len(longs) * 1e3 if longs else None,
            "long_ttft_p99_ms": pct_ms(longs),
            "gold_ttft_p99_ms": ttft_p99(recs, tenant="gold"),
            "free_ttft_p99_ms": ttft_p99(recs, tenant="free"),
            "jain_slowdown": m.jain_slowdown,
            "jain_contended": jain_index(
                [v / TENANT_WEIGHTS.get(k, 1.0) for k, v in shares.items()]) if shares else None,
            "gold_share": shares.get("gold") if shares else None,
            "free_share": shares.get("free") if shares else None,
            "gold_decode_share": admitted.get("gold") if admitted else None,
            "completed": m.completed, "failed": m.failed,
        })
        details[name] = config_detail(r, base, contended_shares=shares,
                                      decode_admission_shares=admitted)
    result = StudyResult(
        NAME, "Fairness study",
        "Prefill policy x KV send queue on a two-tenant mixed workload (gold: weight "
        f"{TENANT_WEIGHTS['gold']:g}, TTFT deadline {DEADLINES_MS['gold']:g} ms; free: "
        f"weight {TENANT_WEIGHTS['free']:g}, deadline {DEADLINES_MS['free']:g} ms). "
        "Shares: each tenant's part of the prefill tokens computed while both tenants had "
        "prompts waiting (contended; from the trace).",
        COLUMNS, rows, details, extra={"workload": workload})
    result.notes.append("Jain (slowdown) divides each E2EL by an estimated idle latency "
                        f"(reference prefill {ref.prefill_s * 1e3:.1f} ms per "
                        f"{ref.prompt_tokens} tokens, decode step "
                        f"{ref.decode_step_s * 1e3:.2f} ms); compare configs, not absolutes.")
    if rows:
        from bench.plots import plot_grouped_bars

        ttft = {r["config"]: {k: r[v] for k, v in (
            ("short TTFT p99", "short_ttft_p99_ms"), ("long TTFT mean", "long_ttft_mean_ms"),
            ("gold TTFT p99", "gold_ttft_p99_ms"), ("free TTFT p99", "free_ttft_p99_ms"))
            if r.get(v) is not None} for r in rows}
        result.plots.append(plot_grouped_bars(
            ttft, ctx.out / f"{NAME}-ttft.png", ylabel="ms", xlabel="prefill + send queue",
            title="Fairness: TTFT by policy").name)
        idx = {r["config"]: {k: r[k] for k in ("jain_slowdown", "jain_contended", "gold_share")
                             if r.get(k) is not None} for r in rows}
        result.plots.append(plot_grouped_bars(
            idx, ctx.out / f"{NAME}-jain.png", ylabel="index / share",
            xlabel="prefill + send queue", title="Fairness: Jain's indices and gold share").name)
    result.elapsed_s = time.monotonic() - t0
    return result
