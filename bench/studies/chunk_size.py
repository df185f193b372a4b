"""chunk-size: prefill chunk (= the prefill step's token budget) -> TTFT, ITL, goodput, step time.

Small chunks let short prompts slip in between the chunks of long ones (short TTFT
falls) and stream KV earlier, at the price of more, less efficient steps (long-prompt
TTFT and per-token overhead rise); large chunks do the opposite. Same seeded mixed
workload (streaming chats + long prompts, Poisson) on a 1P+1D service per chunk size,
over the emulated link.

The four curves: TTFT p99, ITL (or TPOT) p99, SLO goodput, and per step the kernel time
and the scheduling gap. On an emulated accelerator (``--emulate``) those come from the
workers' device accounting (GetStats): the kernel time is the device's busy time per
engine step, the scheduling gap the host's lag per continuing step (how long the device
sat idle waiting for the host to submit a step that needed the one before); a gap above
``bench.emulated.PACE_SHARE`` of the kernel time means this host, not the device, set
the pace, and the findings say so. Without a device the fourth curve is the mean
prefill step time (wall clock).
"""

from __future__ import annotations

import time

from bench.metrics import BenchmarkMetrics
from bench.studies.common import (
    Column,
    ConfigRun,
    StudyContext,
    StudyResult,
    config_detail,
    mixed_workload,
    p,
    step_ms,
    trace_metrics,
)
from bench.studies.report import change, ratio_line
from bench.studies.service import device_timing

NAME = "chunk-size"
CHUNKS_FULL = (64, 128, 256, 512, 1024)
CHUNKS_QUICK = (64, 256)
# an emulated device's steps take H200 time, not this CPU's: --quick sweeps four sizes
CHUNKS_QUICK_EMULATED = (64, 128, 256, 512)
EMULATED_KV_GB = 1.0  # KV cache per worker on an emulated device (see run)
SERIES = "disagg 1P+1D"
COLUMNS = [
    Column("config", "config"), Column("chunk", "chunk"),
    Column("ttft_p50_ms", "TTFT p50 (ms)"), Column("ttft_p99_ms", "TTFT p99 (ms)"),
    Column("short_ttft_p99_ms", "short TTFT p99 (ms)"),
    Column("long_ttft_mean_ms", "long TTFT mean (ms)"),
    Column("itl_p99_ms", "ITL p99 (ms)"), Column("tpot_p99_ms", "TPOT p99 (ms)"),
    Column("goodput_rps", "goodput (req/s)", "{:.2f}"),
    Column("prefill_step_ms", "prefill step (ms)", "{:.2f}"),
    Column("prefill_kernel_ms", "prefill kernel (ms/step)", "{:.2f}"),
    Column("prefill_gap_ms", "prefill gap (ms/step)", "{:.2f}"),
    Column("decode_kernel_ms", "decode kernel (ms/step)", "{:.2f}"),
    Column("decode_gap_ms", "decode gap (ms/step)", "{:.2f}"),
    Column("transfer_overlap", "transfer overlap", "{:.2f}"),
    Column("completed", "ok"), Column("failed", "failed"),
]


def config_name(chunk: int) -> str:
    return f"chunk-{chunk}"


def metrics_row(m: BenchmarkMetrics, run: ConfigRun) -> dict:
    """The columns shared by the latency studies, from one run."""
    long_ttfts = [r.ttft for r in run.records if r.kind == "long" and r.success and r.ttft]
    short = m.short_ttft_with_long
    return {
        "config": run.name, "ttft_p50_ms": p(m, "ttft", 50.0), "ttft_p99_ms": p(m, "ttft"),
        "short_ttft_p99_ms": short.percentiles[99.0] * 1e3 if short else None,
        "long_ttft_mean_ms": sum(long_ttfts) / len(long_ttfts) * 1e3 if long_ttfts else None,
        "itl_p99_ms": p(m, "itl"), "tpot_p99_ms": p(m, "tpot"),
        "goodput_rps": m.request_goodput, "completed": m.completed, "failed": m.failed,
    }


def device_columns(run: ConfigRun) -> dict[str, float | None]:
    """Kernel time and scheduling gap per step (ms) of each role, the busy ratios and the
    gap's share of the kernel time, from an emulated device's accounting (None off one)."""
    out: dict[str, float | None] = {}
    for role in ("prefill", "decode"):
        t = device_timing(run.output.worker_stats, role)
        out |= {f"{role}_kernel_ms": t["kernel_s"] * 1e3 if t else None,
                f"{role}_gap_ms": t["gap_s"] * 1e3 if t else None,
                f"{role}_busy_ratio": t["busy_ratio"] if t else None,
                f"{role}_lag_share": t["lag_share"] if t else None}
    return out


def _step_findings(rows: list[dict]) -> list[str]:
    """What the kernel-time and scheduling-gap curves say: how a step's device time grew
    with the chunk, and at which sizes the host set the pace (its gap above PACE_SHARE
    of the device's busy time)."""
    from bench.emulated import PACE_SHARE

    dev = [r for r in rows if r.get("prefill_kernel_ms")]
    if len(dev) < 2:
        return []
    small, big = dev[0], dev[-1]
    out = [f"A prefill step's kernel took {small['prefill_kernel_ms']:.2f} ms at chunk "
           f"{small['chunk']} and {big['prefill_kernel_ms']:.2f} ms at chunk {big['chunk']} "
           f"({big['prefill_kernel_ms'] / small['prefill_kernel_ms']:.1f}x for "
           f"{big['chunk'] / small['chunk']:.0f}x the tokens); the scheduling gap was "
           f"{small['prefill_gap_ms']:.2f} and {big['prefill_gap_ms']:.2f} ms per step."]
    for role in ("prefill", "decode"):
        paced = [r for r in dev if (r.get(f"{role}_lag_share") or 0.0) > PACE_SHARE]
        if paced:
            worst = max(paced, key=lambda r: r[f"{role}_lag_share"])
            out.append(f"The host set the {role} pace at chunk "
                       f"{', '.join(str(r['chunk']) for r in paced)}: the device waited for "
                       f"it {100 * worst[f'{role}_lag_share']:.0f}% of its busy time at "
                       f"chunk {worst['chunk']}.")
        else:
            lag = max(r.get(f"{role}_lag_share") or 0.0 for r in dev)
            busy = [r.get(f"{role}_busy_ratio") or 0.0 for r in dev]
            out.append(f"The {role} device, not the host, set the pace at every chunk (host "
                       f"lag at most {100 * lag:.0f}% of its busy time; busy "
                       f"{100 * min(busy):.0f}-{100 * max(busy):.0f}% of the run).")
    return out


def findings(result: StudyResult) -> list[str]:
    """The smallest chunk against the largest, where goodput peaked, and what the kernel
    time and the scheduling gap did."""
    rows = sorted((r for r in result.rows if r.get("chunk")), key=lambda r: r["chunk"])
    if len(rows) < 2:
        return []
    small, big = rows[0], rows[-1]
    out = [ratio_line(f"Chunk {small['chunk']} (against {big['chunk']})", [
        change("ITL p99", big.get("itl_p99_ms"), small.get("itl_p99_ms")),
        change("the short prompts' TTFT p99", big.get("short_ttft_p99_ms"),
               small.get("short_ttft_p99_ms")),
        change("the long prompts' mean TTFT", big.get("long_ttft_mean_ms"),
               small.get("long_ttft_mean_ms"))])]
    good = [r for r in rows if r.get("goodput_rps") is not None]
    if good:
        best = max(good, key=lambda r: r["goodput_rps"])
        worst = min(good, key=lambda r: r["goodput_rps"])
        out.append(f"SLO goodput peaked at chunk {best['chunk']} ({best['goodput_rps']:.2f} "
                   f"req/s; lowest {worst['goodput_rps']:.2f} at chunk {worst['chunk']}).")
    out += _step_findings(rows)
    return [s for s in out if s]


def run(ctx: StudyContext) -> StudyResult:
    t0 = time.monotonic()
    # on an emulated device the service runs at H200 step times: four times the load (at
    # 4 req/s its prefill device is idle 90% of the time and no chunk size matters)
    emulated = ctx.opts.emulate is not None
    quick = CHUNKS_QUICK_EMULATED if emulated else CHUNKS_QUICK
    chunks = quick if ctx.opts.quick else CHUNKS_FULL
    names = ctx.selected([config_name(c) for c in chunks])
    requests, workload = mixed_workload(
        ctx, n=ctx.n_requests(48, 96) if emulated else ctx.n_requests(12, 48),
        rate=16.0 if emulated else 4.0, tag="cs")
    base = ctx.base_config()
    # the studies' 0.25 GiB of decode KV holds 2,048 tokens of an 8B model: requests
    # would wait for decode KV, not for a chunk; 1 GiB (8,192 tokens) lets the chunk show
    cache = {"cache.kv_cache_memory_gb": EMULATED_KV_GB} if emulated else {}
    rows, configs = [], {}
    for chunk in chunks:
        name = config_name(chunk)
        if name not in names:
            continue
        cfg = base.with_values({"scheduler.max_prefill_chunk": chunk,
                                "scheduler.max_num_batched_tokens": chunk, **cache})
        r = ctx.run(NAME, name, cfg, requests)
        tm = trace_metrics(r)
        row = {**metrics_row(r.metrics, r), "chunk": chunk,
               "prefill_step_ms": step_ms(r, "prefill") or tm.get("trace_prefill_step_ms"),
               "transfer_overlap": tm.get("transfer_overlap"), **device_columns(r)}
        rows.append(row)
        configs[name] = config_detail(r, base, trace_summary=tm)
    result = StudyResult(
        NAME, "Chunk size study",
        "Prefill chunk size (also the prefill step's token budget) against TTFT p99, "
        "ITL/TPOT p99, SLO goodput and the step time, on a 1P+1D service with the same "
        "seeded mixed workload (streaming chats + long prompts). `short TTFT` counts "
        "prompts <= 512 tokens that waited while a long prompt ran. On an emulated "
        "device, `kernel` is the device's busy time per engine step and `gap` the host's "
        "lag per continuing step (the device idle, waiting for the host: the scheduling "
        "gap), from the workers' GetStats; `prefill step` is the worker's wall time per "
        "step (its KV export included).",
        COLUMNS, rows, configs, extra={"workload": workload}, elapsed_s=0.0)
    if rows:
        from bench.plots import plot_chunk_size_study

        png = plot_chunk_size_study(
            {SERIES: {r["chunk"]: r for r in rows}}, ctx.out / f"{NAME}.png",
            title=f"Chunk size study ({ctx.opts.model}, link ratio "
                  f"{ctx.link.transfer_compute_ratio:.2g})",
            slo_ttft_ms=ctx.opts.slos.get("ttft"), slo_itl_ms=ctx.opts.slos.get("tpot"))
        result.plots.append(png.name)
    result.elapsed_s = time.monotonic() - t0
    return result
