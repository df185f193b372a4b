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
from collections.abc import Iterable, Mapping, Sequence

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
DEADLINES_MS = {"gold": 1000.0, "free": 4000.0}  # (another tenant: free's)
RESOURCES = ("prefill", "link", "decode", "e2e")  # e2e: end to end
RESOURCE_WORDS = {"prefill": "prefill compute", "link": "link bytes",
                  "decode": "decode admission", "e2e": "end to end"}
# the path configurations: the resource made to contend -> what makes it so
SCENARIOS: dict[str, dict] = {
    "prefill": {"workload": {"chat_prompt": (384, 512), "chat_output": (4, 8)},
                "config": {"cache.kv_cache_memory_gb": 2.0}},
    "link": {"workload": {"chat_prompt": (384, 512), "chat_output": (4, 8)},
             "config": {"cache.kv_cache_memory_gb": 2.0, "transfer.link_gbps": 10.0}},
    "decode": {"workload": {"chat_prompt": (128, 256), "chat_output": (64, 128)},
               "config": {"cache.kv_cache_memory_gb": 0.25}},
}
MODES = {"fcfs": ("fcfs", "fcfs", "fcfs"), "wfq": ("wfq", "wfq", "wfq")}
FAIR_WITHIN = 0.10  # the bar: each tenant's share within 10% of its weight's
COLUMNS = [
    Column("config", "config"), Column("prefill_policy", "prefill policy"),
    Column("send_queue", "send queue"), Column("decode_admission", "decode admission"),
    Column("short_ttft_p99_ms", "short TTFT p99 (ms)"),
    Column("long_ttft_mean_ms", "long TTFT mean (ms)"),
    Column("gold_ttft_p99_ms", "gold TTFT p99 (ms)"),
    Column("free_ttft_p99_ms", "free TTFT p99 (ms)"),
    Column("jain_slowdown", "Jain (slowdown)", "{:.3f}"),
    *(Column(f"gold_{r}_share", f"gold share: {RESOURCE_WORDS[r]}", "{:.2f}")
      for r in RESOURCES),
    *(Column(f"jain_{r}", f"Jain: {RESOURCE_WORDS[r]}", "{:.3f}") for r in RESOURCES),
    Column("worst_dev", "worst |share / weight share - 1| (judged)", "{:.0%}"),
    Column("completed", "ok"), Column("failed", "failed"),
]


def path_names() -> list[str]:
    """The path configurations: ``<resource>-bound/<mode>``."""
    return [f"{r}-bound/{m}" for r in SCENARIOS for m in MODES]


def config_names(quick: bool, emulated: bool = False) -> list[str]:
    """The policy grid on the mixed workload (``fcfs+wfq``...), then the path
    configurations; --quick: three of the grid on this CPU, the path ones on an emulated
    device (whose steps take a GPU's time: there the resources contend in turn)."""
    if quick:
        return path_names() if emulated else list(QUICK)
    return [f"{p}+{q}" for p, q in itertools.product(POLICIES, QUEUES)] + path_names()


def ttft_p99(records: list[RequestRecord], **match: str) -> float | None:
    ok = [r for r in records if r.success and r.ttft is not None
          and all(getattr(r, k) == v for k, v in match.items())]
    return pct_ms([r.ttft for r in ok])


Span = tuple[float, float]


def contended_split(spans: Mapping[str, Sequence[Span]],
                    items: Iterable[tuple[str, float, float]]) -> dict[str, float] | None:
    """Each tenant's share of ``items`` (tenant, time, amount) that fell while *every*
    tenant of ``spans`` had one of its spans open (both ends included): the service a
    policy could give one tenant or another. None without two tenants or any such item."""
    if len(spans) < 2:
        return None
    got = dict.fromkeys(spans, 0.0)
    for tenant, t, amount in items:
        if tenant in got and amount and all(any(a <= t <= b for a, b in s)
                                            for s in spans.values()):
            got[tenant] += amount
    total = sum(got.values())
    return {k: v / total for k, v in got.items()} if total > 0 else None


def contended_shares(run: ConfigRun) -> dict[str, float] | None:
    """Each tenant's share of the prefill tokens computed while *every* tenant had a
    prompt dispatched to prefill and not yet answered (the only time a prefill policy
    can favour one; over a whole run that completes, shares are fixed by the workload).
    From the records (dispatch: arrival + the router's admission time) and the trace."""
    off = run.output.wall_offset
    spans: dict[str, list[Span]] = {}
    for r in run.records:
        if r.success and r.ttft is not None:
            spans.setdefault(r.tenant, []).append((r.send_time + (r.admission_s or 0.0) + off,
                                                   r.send_time + r.ttft + off))
    return contended_split(spans, ((e.tenant, (e.start + e.end) / 2, e.scheduled_tokens or 0)
                                   for e in run.events if e.phase == "prefill_chunk"))


def link_shares(run: ConfigRun) -> dict[str, float] | None:
    """Each tenant's share of the KV bytes sent while every tenant had KV computed and not
    yet sent: a request's span runs from the end of its first prefill chunk to the end of
    its last KV frame on the link (from the trace, whose spans name the request's legs,
    ``<request id>#<dispatch>#<leg>``)."""
    tenant_of = {r.request_id: r.tenant for r in run.records}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    sends = []
    for e in run.events:
        rid = e.request_id.split("#")[0]
        if rid not in tenant_of:
            continue
        if e.phase == "prefill_chunk":
            first[rid] = min(first.get(rid, e.end), e.end)
        elif e.phase == "kv_send" and e.bytes:
            last[rid] = max(last.get(rid, e.end), e.end)
            sends.append((tenant_of[rid], (e.start + e.end) / 2, e.bytes))
    spans: dict[str, list[Span]] = {}
    for rid, end in last.items():
        if rid in first:
            spans.setdefault(tenant_of[rid], []).append((first[rid], end))
    return contended_split(spans, sends)


def e2e_shares(run: ConfigRun) -> dict[str, float] | None:
    """End to end, for two tenants whose backlogs start together (the path
    configurations): each tenant's share of the work the whole path delivered while both
    were backlogged, at the grain the path delivers it: a prompt's tokens as its KV left
    the link for its decode worker (each frame of the trace's ``kv_send`` spans carries
    its part of the prompt, by bytes), each output token as it reached the client. The
    window runs from the moment both tenants had KV delivered (before it the path was
    filling, in arrival order) to the last KV delivered of the first tenant done (from
    then on it only drains its decodes and the path serves the other alone). Both
    tenants' work comes the path's delay late, so the delay cancels; counting requests
    as they complete would instead charge a tenant's work in flight at the window's end
    against it, and the wfq send queue, which shares a tenant's bytes among its requests,
    completes the lower-weight tenant's late, all together. None without two tenants or
    a window."""
    off = run.output.wall_offset
    recs = {r.request_id: r for r in run.records if r.success}
    sends: list[tuple[str, float, int]] = []  # (request id, end on the trace's clock, bytes)
    sent: dict[str, int] = {}
    for e in run.events:
        rid = e.request_id.split("#")[0]
        if e.phase == "kv_send" and e.bytes and rid in recs:
            sends.append((rid, e.end, e.bytes))
            sent[rid] = sent.get(rid, 0) + e.bytes
    spans: dict[str, list[float]] = {}
    for rid, t, _ in sends:
        span = spans.setdefault(recs[rid].tenant, [t, t])
        span[0], span[1] = min(span[0], t), max(span[1], t)
    if len(spans) != 2:
        return None
    start, end = max(a for a, _ in spans.values()), min(b for _, b in spans.values())
    if end <= start:
        return None
    got = dict.fromkeys(spans, 0.0)
    for rid, t, nbytes in sends:
        if start <= t <= end:
            r = recs[rid]
            got[r.tenant] += r.prompt_len * nbytes / sent[rid]
    for r in recs.values():
        if r.tenant in got:
            got[r.tenant] += sum(1 for t in r.token_times if start <= t + off <= end)
    total = sum(got.values())
    return {k: v / total for k, v in got.items()} if total > 0 else None


def path_shares(run: ConfigRun, backlogged: bool = False
                ) -> dict[str, dict[str, float] | None]:
    """resource (RESOURCES) -> each tenant's share of its contended service (None: not
    contended in this run; end to end: only for ``backlogged`` runs, e2e_shares)."""
    return {"prefill": contended_shares(run), "link": link_shares(run),
            "decode": admission_shares(run), "e2e": e2e_shares(run) if backlogged else None}


def share_columns(shares: Mapping[str, Mapping[str, float] | None],
                  weights: Mapping[str, float], lead: str = "gold",
                  judged: Sequence[str] = RESOURCES) -> dict[str, float | None]:
    """A row's share columns: ``lead``'s share and Jain over share / weight at each
    resource, and the worst relative gap between a tenant's share and its weight's
    share over the ``judged`` resources that were contended (a path configuration
    judges the resource it contends at, and end to end)."""
    out: dict[str, float | None] = {}
    worst = None
    for res in RESOURCES:
        s = shares.get(res)
        out[f"gold_{res}_share"] = s.get(lead) if s else None
        out[f"jain_{res}"] = jain_index([v / weights.get(k, 1.0) for k, v in s.items()]) \
            if s else None
        if s and res in judged:
            total = sum(weights.get(k, 1.0) for k in s)
            dev = max(abs(v / (weights.get(k, 1.0) / total) - 1) for k, v in s.items())
            worst = dev if worst is None else max(worst, dev)
    out["worst_dev"] = worst
    return out


def admission_shares(run: ConfigRun) -> dict[str, float] | None:
    """Each tenant's share of the prompt tokens admitted to decode while another tenant's
    request waited for decode KV (the router's count, ClusterStats)."""
    tokens = run.output.admission_tokens
    total = sum(tokens.values())
    return {k: v / total for k, v in tokens.items()} if total and len(tokens) > 1 else None


def findings(result: StudyResult) -> list[str]:
    """Per configuration: each contended resource's split against the weights, and
    whether every share came within FAIR_WITHIN of its weight's (the path ones), or how
    close the grid's configurations came."""
    weights = result.extra.get("tenant_weights") or TENANT_WEIGHTS
    lead = next(iter(weights))
    want = weights[lead] / sum(weights.values())
    ratio = ":".join(f"{w:g}" for w in weights.values())
    rows = [r for r in result.rows
            if any(r.get(f"jain_{res}") is not None for res in RESOURCES)]
    if not rows:
        return []
    out = []
    grid = [r for r in rows if "-bound/" not in r["config"] and r.get("jain_prefill")]
    if grid:
        best = max(grid, key=lambda r: r["jain_prefill"])
        out.append(f"{best['config']} came closest to the weights {ratio}: Jain index of "
                   f"the contended prefill shares over weights {best['jain_prefill']:.3f}.")
    for r in rows:
        said = [f"{r[f'gold_{res}_share']:.2f} of the {RESOURCE_WORDS[res]}"
                if res != "e2e" else f"{r['gold_e2e_share']:.2f} end to end"
                for res in RESOURCES if r.get(f"gold_{res}_share") is not None]
        if not said:
            continue
        body = said[0] if len(said) == 1 else ", ".join(said[:-1]) + " and " + said[-1]
        line = f"{r['config']}: {lead} got {body} (its weight's share: {want:.2f})"
        if "-bound/" in r["config"] and r.get("worst_dev") is not None:
            judged = judged_resources(r["config"])
            jains = [r[f"jain_{res}"] for res in judged if r.get(f"jain_{res}") is not None]
            ok = "within" if r["worst_dev"] <= FAIR_WITHIN else "not within"
            line += (f"; at the {' and '.join(RESOURCE_WORDS[j] for j in judged)} every "
                     f"share {ok} {FAIR_WITHIN:.0%} of its weight's (worst "
                     f"{r['worst_dev']:.0%}), Jain {min(jains):.3f}-{max(jains):.3f}")
        out.append(line + ".")
    return out


def judged_resources(name: str) -> tuple[str, ...]:
    """What a configuration's fairness verdict reads: a path configuration's resource
    and end to end (the others are contended in passing there); the grid: all."""
    if "-bound/" in name:
        return (name.split("-bound/")[0], "e2e")
    return RESOURCES


def scenario_config(base, name: str):
    """``<resource>-bound/<mode>``'s configuration."""
    scenario, mode = name.split("-bound/")
    policy, queue, admission = MODES[mode]
    return base.with_values({"scheduler.fairness_policy": policy,
                             "transfer.send_queue": queue,
                             "scheduler.decode_admission": admission,
                             **SCENARIOS[scenario]["config"]})


def study_weights(ctx: StudyContext) -> dict[str, float]:
    """The tenants' weights (``--tenant-weights``; every configuration runs with them)."""
    weights = dict(ctx.opts.tenant_weights)
    if set(weights) != set(TENANT_WEIGHTS):
        raise ValueError(f"the fairness study's tenants are {', '.join(TENANT_WEIGHTS)}: "
                         f"--tenant-weights named {', '.join(weights)}")
    return {t: weights[t] for t in TENANT_WEIGHTS}


def run(ctx: StudyContext) -> StudyResult:
    from bench.workload import TenantSpec

    t0 = time.monotonic()
    weights = study_weights(ctx)
    emulated = ctx.opts.emulate is not None
    names = ctx.selected(config_names(ctx.opts.quick, emulated) if not ctx.opts.configs
                         else config_names(False))
    tenants = [TenantSpec(t, share=0.5, weight=w, ttft_deadline_ms=DEADLINES_MS[t])
               for t, w in weights.items()]
    requests, workload = mixed_workload(ctx, n=ctx.n_requests(16, 64), rate=5.0, tag="fr",
                                        long_fraction=0.3, tenants=tenants)
    backlogs = {}  # scenario -> (requests, its workload): every request at t=0
    ref = ctx.reference

    def alone(r: RequestRecord) -> float:
        return ref.prefill_estimate_s(r.prompt_len) + max(0, r.n_out - 1) * ref.decode_step_s

    base = ctx.base_config()
    rows, details = [], {}
    for name in names:
        if "-bound/" in name:
            scenario = name.split("-bound/")[0]
            if scenario not in backlogs:
                # 96 requests: with 32 the first admissions (uncontended, in arrival
                # order) and the drain weigh on every share
                backlogs[scenario] = mixed_workload(
                    ctx, n=ctx.n_requests(96, 192), rate=float("inf"), tag=f"fb{scenario[0]}",
                    long_fraction=0.0, tenants=tenants, **SCENARIOS[scenario]["workload"])
            work = backlogs[scenario][0]
            cfg = scenario_config(base, name)
        else:
            policy, queue = name.split("+")
            # a wfq configuration shares decode admission by the same weights too (one
            # scheduler.tenant_weights drives the three policies)
            cfg = base.with_values({"scheduler.fairness_policy": policy,
                                    "transfer.send_queue": queue,
                                    "scheduler.decode_admission": "wfq" if policy == "wfq"
                                    else "fcfs"})
            work = requests
        r = ctx.run(NAME, name, cfg, work, latency_alone=alone)
        m, recs = r.metrics, r.records
        longs = [x.ttft for x in recs if x.kind == "long" and x.success and x.ttft]
        shares = path_shares(r, backlogged="-bound/" in name)
        rows.append({
            "config": name, "prefill_policy": cfg.scheduler.fairness_policy,
            "send_queue": cfg.transfer.send_queue,
            "decode_admission": cfg.scheduler.decode_admission,
            "short_ttft_p99_ms": ttft_p99(recs, kind="chat"),
            "long_ttft_mean_ms": sum(longs) / len(longs) * 1e3 if longs else None,
            "long_ttft_p99_ms": pct_ms(longs),
            "gold_ttft_p99_ms": ttft_p99(recs, tenant="gold"),
            "free_ttft_p99_ms": ttft_p99(recs, tenant="free"),
            "jain_slowdown": m.jain_slowdown, **share_columns(
                shares, weights, judged=judged_resources(name)),
            "completed": m.completed, "failed": m.failed,
        })
        details[name] = config_detail(r, base, contended_shares=shares)
    result = StudyResult(
        NAME, "Fairness study",
        "Prefill policy x KV send queue on a two-tenant mixed workload (gold: weight "
        f"{weights['gold']:g}, TTFT deadline {DEADLINES_MS['gold']:g} ms; free: "
        f"weight {weights['free']:g}, deadline {DEADLINES_MS['free']:g} ms), and the "
        "path configurations (`R-bound/fcfs|wfq`: both tenants' backlog at t=0 on a "
        "service that contends at R; wfq at the three resources or fcfs at the three). "
        "Shares: each tenant's part of the contended service at each resource (prefill "
        "tokens while every tenant had a prompt at prefill; KV bytes on the link while "
        "every tenant had KV waiting; prompt tokens admitted to decode while another "
        "tenant waited for decode KV; end to end, on the backlogs, the share of the work "
        "the path delivered while both had KV to deliver: a prompt's tokens as its KV "
        "left the link, by bytes, output tokens as they streamed), and Jain's index over share / weight (1.0: "
        "weighted-fair).",
        COLUMNS, rows, details,
        extra={"workload": workload, "tenant_weights": weights,
               "path_workloads": {k: v[1] for k, v in backlogs.items()},
               "scenarios": {k: v["config"] for k, v in SCENARIOS.items()}})
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
        idx = {r["config"]: {f"gold: {RESOURCE_WORDS[res]}": r[f"gold_{res}_share"]
                             for res in RESOURCES if r.get(f"gold_{res}_share") is not None}
               for r in rows}
        result.plots.append(plot_grouped_bars(
            idx, ctx.out / f"{NAME}-jain.png", ylabel="index / share",
            xlabel="configuration", title="Fairness: gold's share of contended service by "
            f"resource (its weight's share {weights['gold'] / sum(weights.values()):.2f})"
        ).name)
    result.elapsed_s = time.monotonic() - t0
    return result
