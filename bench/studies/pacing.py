"""pacing: when KV leaves the prefill worker -> TTFT, running decodes' ITL, overlap, link use.

Policies: ``at_end`` (hold a request's KV until its last chunk: no streaming), ``eager``
(each chunk's KV leaves as soon as it is computed; on the emulated link that is the
link rate), ``paced`` below the link rate (leaves headroom for other traffic), and
credit windows (max unacknowledged bytes per link). All run on the same emulated link:
it is the transport's (kv_transfer/emulated_link.py), beneath the policy and the window. Transfer overlap is the share of a
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
from bench.studies.report import change, ratio_line

NAME = "pacing"
SMALL_WINDOW_BLOCKS = 4  # the small credit window: a few KV blocks in flight per link
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


def small_window_mb(ctx: StudyContext) -> float:
    """A credit window of a few KV blocks (at least the 64 KiB of one frame)."""
    block = ctx.base_config().cache.block_size
    blocks = SMALL_WINDOW_BLOCKS * ctx.reference.kv_bytes_per_token * block
    return max(blocks, 64 << 10) / float(1 << 20)


def configs(ctx: StudyContext) -> dict[str, dict[str, Any]]:
    """Name -> ServeConfig overrides of the base (which already caps the link)."""
    link = ctx.link.link_gbps
    out: dict[str, dict[str, Any]] = {
        "eager": {},
        "at_end": {"transfer.send_policy": "at_end"},
    }
    if not ctx.opts.quick:
        for x in (0.5, 0.25):
            out[f"paced-{x:g}x"] = {"transfer.send_policy": "paced",
                                    "transfer.rate_gbps": x * link}
        small = small_window_mb(ctx)  # the window as configured: no floor of chunks
        out[f"credit-{small * 1024:g}KiB"] = {"transfer.credit_window_mb": small,
                                              "transfer.credit_window_chunks": 0.0}
    return out


def findings(result: StudyResult) -> list[str]:
    """Each send policy against sending at the end of prefill."""
    by = {r["config"]: r for r in result.rows}
    base = by.get("at_end")
    if base is None:
        return []
    out = []
    for name, r in by.items():
        if name == "at_end":
            continue
        out.append(ratio_line(f"{name} (against at_end)", [
            change("TTFT p99", base.get("ttft_p99_ms"), r.get("ttft_p99_ms")),
            change("the running decodes' ITL p99", base.get("chat_itl_p99_ms"),
                   r.get("chat_itl_p99_ms"))]))
        if r.get("transfer_overlap") is not None:
            out.append(f"{name} hid {r['transfer_overlap'] * 100:.0f}% of its transfer time "
                       f"behind prefill (at_end: {(base.get('transfer_overlap') or 0) * 100:.0f}%).")
    return [s for s in out if s]

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
        rate = t.rate_gbps if t.rate_gbps is not None else t.link_gbps
        rows.append({
            **metrics_row(m, r), "send_policy": t.send_policy, "rate_gbps": rate,
            "credit_window_mb": ctx.credit_window_mb(cfg),
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
        "Every configuration runs on the same emulated link (rate "
        "`transfer.link_gbps`, latency `transfer.link_latency_us`), a property of the "
        "transport: the send policy, pacer and credit window above it are as configured.",
        "The credit window column is the window the workers run with "
        "(`transfer.credit_window_mb`, raised to `credit_window_chunks` prefill chunks "
        "of KV unless that is 0).",
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
