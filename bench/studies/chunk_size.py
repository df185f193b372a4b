"""chunk-size: prefill chunk (= the prefill step's token budget) -> TTFT, ITL, goodput, step time.

Small chunks let short prompts slip in between the chunks of long ones (short TTFT
falls) and stream KV earlier, at the price of more, less efficient steps (long-prompt
TTFT and per-token overhead rise); large chunks do the opposite. Same seeded mixed
workload (streaming chats + long prompts, Poisson) on a 1P+1D service per chunk size,
over the emulated link.
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

NAME = "chunk-size"
CHUNKS_FULL = (64, 128, 256, 512, 1024)
CHUNKS_QUICK = (64, 256)
SERIES = "disagg 1P+1D"
COLUMNS = [
    Column("config", "config"), Column("chunk", "chunk"),
    Column("ttft_p50_ms", "TTFT p50 (ms)"), Column("ttft_p99_ms", "TTFT p99 (ms)"),
    Column("short_ttft_p99_ms", "short TTFT p99 (ms)"),
    Column("long_ttft_mean_ms", "long TTFT mean (ms)"),
    Column("itl_p99_ms", "ITL p99 (ms)"), Column("tpot_p99_ms", "TPOT p99 (ms)"),
    Column("goodput_rps", "goodput (req/s)", "{:.2f}"),
    Column("prefill_step_ms", "prefill step (ms)", "{:.2f}"),
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


def findings(result: StudyResult) -> list[str]:
    """The smallest chunk against the largest, and where goodput peaked."""
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
    return [s for s in out if s]

def run(ctx: StudyContext) -> StudyResult:
    t0 = time.monotonic()
    chunks = CHUNKS_QUICK if ctx.opts.quick else CHUNKS_FULL
    names = ctx.selected([config_name(c) for c in chunks])
    requests, workload = mixed_workload(ctx, n=ctx.n_requests(12, 48), rate=4.0, tag="cs")
    base = ctx.base_config()
    rows, configs = [], {}
    for chunk in chunks:
        name = config_name(chunk)
        if name not in names:
            continue
        cfg = base.with_values({"scheduler.max_prefill_chunk": chunk,
                                "scheduler.max_num_batched_tokens": chunk})
        r = ctx.run(NAME, name, cfg, requests)
        tm = trace_metrics(r)
        row = {**metrics_row(r.metrics, r), "chunk": chunk,
               "prefill_step_ms": step_ms(r, "prefill") or tm.get("trace_prefill_step_ms"),
               "transfer_overlap": tm.get("transfer_overlap")}
        rows.append(row)
        configs[name] = config_detail(r, base, trace_summary=tm)
    result = StudyResult(
        NAME, "Chunk size study",
        "Prefill chunk size (also the prefill step's token budget) against TTFT p99, "
        "ITL/TPOT p99, SLO goodput and the mean prefill step time, on a 1P+1D service "
        "with the same seeded mixed workload (streaming chats + long prompts). "
        "`short TTFT` counts prompts <= 512 tokens that waited while a long prompt ran.",
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
