"""pacing: when KV leaves the prefill worker -> TTFT, running decodes' ITL, overlap, link use.

Policies: ``at_end`` (hold a request's KV until its last chunk: no streaming), ``eager``
(each chunk's KV leaves as soon as it is computed; on the emulated link that is the
link rate), ``paced`` below the link rate (leaves headroom for other traffic), and
credit windows (max unacknowledged bytes per link), and the final chunk sent layer by
layer (``transfer.layerwise``), over tcp and, where installed, nixl. All run on the same
emulated link: it is the transport's (kv_transfer/emulated_link.py), beneath the policy
and the window. Transfer overlap is the share of a request's (emulated) transfer time
hidden behind its own prefill compute, from traces; on an emulated device, the final
chunk's hidden share (``final_chunk_overlap``) is that of its own transfer behind its own
step.
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from collections.abc import Iterable
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
    Column("final_hidden", "final chunk hidden", "{:.2f}"),
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
        out["layerwise"] = {"transfer.layerwise": True}
        if importlib.util.find_spec("nixl_cu12") is not None:  # the connector's wheel
            out["nixl-eager"] = {"transfer.connector": "nixl"}
            out["nixl-layerwise"] = {"transfer.connector": "nixl", "transfer.layerwise": True}
    return out


def _merge(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def final_chunk_overlap(events) -> dict[str, dict[str, float]]:
    """Per request, how much of its final chunk's transfer its own step hid (an emulated
    device's trace: ``prefill_chunk`` spans carry the step's ``device_start`` /
    ``device_end``, ``kv_send`` spans the sent chunk's seq as ``chunk_id``). ``U``: the
    union of the final chunk's frames' wire intervals; ``S``: its step.

    - ``busy``: ``|U ∩ S| / |U|``, the share of its wire time spent while it computed;
    - ``span``: ``[first byte on the wire, last byte off it]`` against ``S``, over that
      interval's length (the looser form: waiting for a group counts as hidden);
    - ``tail_s``: its last byte off the wire after ``S`` ended (the exposed part);
    - ``transfer_s`` (``|U|``) and ``step_s`` (``|S|``)."""
    steps: dict[str, tuple[int, float, float]] = {}  # the chunk that ends last: the final
    sends: dict[str, list[tuple[int, float, float]]] = {}
    for e in events:
        if e.phase == "prefill_chunk" and e.device_start is not None:
            if e.token_end >= steps.get(e.request_id, (-1, 0.0, 0.0))[0]:
                steps[e.request_id] = (e.token_end, e.device_start, e.device_end)
        elif e.phase == "kv_send" and not e.is_instant and e.chunk_id is not None:
            sends.setdefault(e.request_id, []).append((e.chunk_id, e.start, e.end))
    out = {}
    for rid, (_, s0, s1) in steps.items():
        frames = sends.get(rid)
        if not frames:
            continue
        final = max(seq for seq, _, _ in frames)
        u = _merge((a, b) for seq, a, b in frames if seq == final)
        busy = sum(b - a for a, b in u)
        first, last = u[0][0], u[-1][1]
        out[rid] = {
            "busy": sum(max(0.0, min(b, s1) - max(a, s0)) for a, b in u) / busy if busy else 0.0,
            "span": max(0.0, min(last, s1) - max(first, s0)) / (last - first)
            if last > first else 0.0,
            "tail_s": max(0.0, last - s1), "transfer_s": busy, "step_s": s1 - s0}
    return out


def final_hidden(events) -> float | None:
    """The mean over requests of ``final_chunk_overlap``'s ``busy`` share."""
    vals = [v["busy"] for v in final_chunk_overlap(events).values()]
    return statistics.mean(vals) if vals else None


def findings(result: StudyResult) -> list[str]:
    """Each send policy against sending at the end of prefill."""
    by = {r["config"]: r for r in result.rows}
    base = by.get("at_end")
    out = []
    for name, r in by.items() if base is not None else ():
        if name == "at_end":
            continue
        out.append(ratio_line(f"{name} (against at_end)", [
            change("TTFT p99", base.get("ttft_p99_ms"), r.get("ttft_p99_ms")),
            change("the running decodes' ITL p99", base.get("chat_itl_p99_ms"),
                   r.get("chat_itl_p99_ms"))]))
        if r.get("transfer_overlap") is not None:
            out.append(f"{name} hid {r['transfer_overlap'] * 100:.0f}% of its transfer time "
                       f"behind prefill (at_end: {(base.get('transfer_overlap') or 0) * 100:.0f}%).")
    for on, off in (("layerwise", "eager"), ("nixl-layerwise", "nixl-eager")):
        a, b = by.get(on, {}).get("final_hidden"), by.get(off, {}).get("final_hidden")
        if a is not None and b is not None:
            out.append(f"{on} hid {a * 100:.0f}% of the final chunk's transfer behind its own "
                       f"step ({off}: {b * 100:.0f}%).")
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
            "final_hidden": final_hidden(r.events),
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
        "prefilling), the final chunk's hidden share (on an emulated device: the mean over "
        "requests of the share of the final chunk's wire time that ran during its own "
        "step) and link utilisation (busy share of the emulated link over the run).",
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
