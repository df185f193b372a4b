"""pacing: when KV leaves the prefill worker -> TTFT, running decodes' ITL, overlap, link use.

Policies: ``at_end`` (hold a request's KV until its last chunk: no streaming), ``eager``
(each chunk's KV leaves as soon as it is computed; on the emulated link that is the
link rate), ``paced`` below the link rate (leaves headroom for other traffic), and
credit windows (max unacknowledged bytes per link). Transfer overlap is the share of a
request's (emulated) transfer time hidden behind its own prefill compute, from traces.
"""

from __future__ import annotations

import time
from typing import Any

from bench.studies.chunk_size import metrics_row
from bench.studies.common import (
    Column,
    StudyContext,
    StudyResult,
    config_detail,
    mixed_workload,
    pct_ms,
    trace_metrics,
)

NAME = "pacing"
MIN_CREDIT_WINDOW_MB = 64.0  # cluster.launcher raises smaller windows to 64 MiB
COLUMNS = [
    Column("config", "config"), Column("send_policy", "policy"),
    Column("rate_gbps", "rate (Gbit/s)", "{:.3f}"),
    Column("credit_window_mb", "credit window (MiB)", "{:g}"),
    Column("link_emulated", "link emulated"),
    Column("ttft_p99_ms", "TTFT p99 (ms)"),
    Column("first_itl_p99_ms", "2nd-token gap p99 (ms)"),
    Column("chat_itl_p99_ms", "running decodes ITL p99 (ms)"),
    Column("tpot_p99_ms", "TPOT p99 (ms)"),
    Column("transfer_overlap", "transfer overlap", "{:.2f}"),
    Column("link_utilization", "link utilisation", "{:.3f}"),
    Column("completed", "ok"), Column("failed", "failed"),
]


def credit_can_bind(ctx: StudyContext) -> bool:
    """Whether one request's KV can exceed the smallest window the launcher allows."""
    worst = ctx.reference.kv_bytes_per_token * ctx.max_model_len
    return worst > MIN_CREDIT_WINDOW_MB * (1 << 20)


def configs(ctx: StudyContext) -> dict[str, dict[str, Any]]:
    """Name -> ServeConfig overrides of the base (which already caps the link)."""
    link = ctx.link.link_gbps
    out: dict[str, dict[str, Any]] = {
        "eager": {},
        # cluster.launcher turns any policy into `paced` while link_gbps is set, so at_end
        # can only run on the raw (unemulated) link; eager-raw is its like-for-like peer
        "at_end-raw": {"transfer.send_policy": "at_end", "transfer.link_gbps": None},
        "eager-raw": {"transfer.link_gbps": None},
    }
    if not ctx.opts.quick:
        for x in (0.5, 0.25):
            out[f"paced-{x:g}x"] = {"transfer.send_policy": "paced",
                                    "transfer.rate_gbps": x * link}
    if not ctx.opts.quick and credit_can_bind(ctx):
        out["credit-1024MiB"] = {"transfer.credit_window_mb": 1024.0}  # vs the default 64
    return out


def run(ctx: StudyContext) -> StudyResult:
    t0 = time.monotonic()
    variants = configs(ctx)
    names = ctx.selected(list(variants))
    requests, workload = mixed_workload(ctx, n=ctx.n_requests(12, 48), rate=4.0, tag="pc",
                                        long_fraction=0.3, chat_output=(24, 64))
    base = ctx.base_config()
    rows, details = [], {}
    for name in names:
        cfg = base.with_values(variants[name])
        r = ctx.run(NAME, name, cfg, requests)
        m, tm, t = r.metrics, trace_metrics(r), cfg.transfer
        chat = [r2 for r2 in r.records if r2.kind == "chat" and r2.success]
        first_gaps = [r2.itls[0] for r2 in r.records if r2.success and r2.itls]
        effective_policy = "paced" if t.link_gbps is not None else t.send_policy
        rate = t.rate_gbps if t.rate_gbps is not None else t.link_gbps
        rows.append({
            **metrics_row(m, r), "send_policy": effective_policy, "rate_gbps": rate,
            "credit_window_mb": max(t.credit_window_mb, MIN_CREDIT_WINDOW_MB),
            "link_emulated": t.link_gbps is not None,
            "first_itl_p99_ms": pct_ms(first_gaps),
            "chat_itl_p99_ms": pct_ms([g for c in chat for g in c.itls]),
            "transfer_overlap": tm.get("transfer_overlap"),
            "link_utilization": tm.get("link_utilization"),
        })
        details[name] = config_detail(r, base, trace_summary=tm,
                                      configured_send_policy=t.send_policy)
    result = StudyResult(
        NAME, "KV send pacing study",
        "Send policy and pacing rate against TTFT p99, the gap between the first and "
        "second token (where a late transfer shows: decode starts once all KV arrived), "
        "ITL p99 of the running chat decodes, transfer overlap (share of all emulated "
        "transfer time, summed over requests, that ran while the sending request was still "
        "prefilling) and link utilisation (busy share of the emulated link over the run).",
        COLUMNS, rows, details, extra={"workload": workload})
    result.notes += [
        "`at_end-raw` runs on the raw loopback link (compare it with `eager-raw`): with "
        "`transfer.link_gbps` set the launcher replaces every send policy by `paced`, so "
        "holding KV to the end cannot be combined with the emulated link yet.",
        f"Credit windows below {MIN_CREDIT_WINDOW_MB:g} MiB are raised to "
        f"{MIN_CREDIT_WINDOW_MB:g} MiB by the launcher, so windows are swept (64 MiB vs "
        "1 GiB, full runs) only for models whose requests' KV can exceed 64 MiB; "
        "otherwise no window ever binds.",
    ]
    if rows:
        from bench.plots import plot_grouped_bars

        keys = {"TTFT p99": "ttft_p99_ms", "2nd-token gap p99": "first_itl_p99_ms",
                "decode ITL p99": "chat_itl_p99_ms"}
        png = plot_grouped_bars(
            {r["config"]: {k: r[v] for k, v in keys.items() if r.get(v) is not None}
             for r in rows}, ctx.out / f"{NAME}-latency.png", ylabel="ms",
            title="Pacing: latency by send policy", xlabel="send policy")
        result.plots.append(png.name)
        share = {r["config"]: {k: r[k] for k in ("transfer_overlap", "link_utilization")
                               if r.get(k) is not None} for r in rows}
        if any(share.values()):
            png = plot_grouped_bars({k: v for k, v in share.items() if v},
                                    ctx.out / f"{NAME}-transfer.png", ylabel="share",
                                    title="Pacing: transfer overlap and link utilisation",
                                    xlabel="send policy")
            result.plots.append(png.name)
    result.elapsed_s = time.monotonic() - t0
    return result
