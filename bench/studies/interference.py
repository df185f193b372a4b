"""interference: do long prompts hurt running decodes? (the ``bench.interference`` workload)

Layouts, each run twice on the same service (streaming chats alone, then the same
chats while long prompts arrive): 1P+1D disaggregated (over the emulated link), two
colocated engines without chunked prefill (vLLM's disaggregation-benchmark baseline),
and two colocated engines with chunked prefill. ``ratio`` = chat ITL p99 with long
prompts / without; disaggregation should stay near 1 while colocated grows.
"""

from __future__ import annotations

import argparse
import time

from bench import interference as itf
from bench.studies.common import Column, StudyContext, StudyResult, config_detail
from bench.studies.service import DISAGG, Layout
from bench.workload import WorkloadRequest

NAME = "interference"
LAYOUTS = {
    "disagg": DISAGG,
    "colocated": Layout("colocated", engines=2, chunked_prefill=False),
    "colocated-chunked": Layout("colocated", engines=2, chunked_prefill=True),
}
COLUMNS = [
    Column("config", "layout"),
    Column("base_itl_p50_ms", "ITL p50 alone (ms)"),
    Column("base_itl_p99_ms", "ITL p99 alone (ms)"),
    Column("mixed_itl_p50_ms", "ITL p50 w/ long (ms)"),
    Column("mixed_itl_p99_ms", "ITL p99 w/ long (ms)"),
    Column("ratio", "ITL p99 ratio", "{:.2f}"),
    Column("base_itl_max_ms", "ITL max alone (ms)"),
    Column("mixed_itl_max_ms", "ITL max w/ long (ms)"),
    Column("long_ttft_mean_ms", "long TTFT mean (ms)"), Column("failed", "failed"),
]


def workload_args(ctx: StudyContext) -> argparse.Namespace:
    """bench.interference's arguments, sized for the study's model and mode."""
    quick = ctx.opts.quick
    args = itf.parse_args(["--seed", str(ctx.opts.seed)])
    # chats must still be decoding when the long prompts arrive (at 1 s, then every
    # long_every s): a few seconds of decode on a small model
    args.chat, args.chat_prompt = (4, 64) if quick else (8, 128)
    args.chat_output = 256 if quick else 512
    args.long, args.long_every = (2, 0.4) if quick else (4, 0.75)
    args.long_prompt = min(1024, ctx.max_model_len - 16)
    return args


def as_workload(reqs: list) -> list[WorkloadRequest]:
    return [WorkloadRequest(r.request_id, r.arrival_s, list(r.prompt_token_ids), r.max_tokens,
                            tenant=r.tenant, kind=r.kind) for r in reqs]


def itl_max_ms(records: list) -> float | None:
    """The worst chat token gap: a whole-prompt prefill stalls each chat of its engine
    once, which a p99 over thousands of gaps can miss."""
    gaps = [g for r in records if r.kind == "chat" and r.success for g in r.itls]
    return max(gaps) * 1e3 if gaps else None


def layout_config(ctx: StudyContext, layout: Layout, long_prompt: int):
    base = ctx.base_config()
    if layout.kind == "colocated" and not layout.chunked_prefill:
        # whole prompts in one step: the step budget must hold the longest prompt
        return base.with_values({"scheduler.max_num_batched_tokens": max(long_prompt, 256),
                                 "scheduler.enable_chunked_prefill": False})
    return base


def run(ctx: StudyContext) -> StudyResult:
    t0 = time.monotonic()
    args = workload_args(ctx)
    names = ctx.selected(list(LAYOUTS))
    base = ctx.base_config()
    rows, details = [], {}
    for name in names:
        layout = LAYOUTS[name]
        cfg = layout_config(ctx, layout, args.long_prompt)
        alone = ctx.run(NAME, f"{name}-alone", cfg,
                        as_workload(itf.workload(args, False, f"{name}-a")), layout)
        mixed = ctx.run(NAME, f"{name}-with-long", cfg,
                        as_workload(itf.workload(args, True, f"{name}-m")), layout)
        a, m = itf.summarize(alone.records), itf.summarize(mixed.records)
        a["itl_max_ms"], m["itl_max_ms"] = itl_max_ms(alone.records), itl_max_ms(mixed.records)
        ttft = m["long_ttft_mean_s"]
        rows.append({
            "config": name,
            "base_itl_p50_ms": a["itl_p50_ms"], "base_itl_p99_ms": a["itl_p99_ms"],
            "mixed_itl_p50_ms": m["itl_p50_ms"], "mixed_itl_p99_ms": m["itl_p99_ms"],
            "ratio": m["itl_p99_ms"] / a["itl_p99_ms"] if a["itl_p99_ms"] else None,
            "base_itl_max_ms": a["itl_max_ms"], "mixed_itl_max_ms": m["itl_max_ms"],
            "long_ttft_mean_ms": ttft * 1e3 if ttft is not None else None,
            "failed": a["failed"] + m["failed"],
        })
        details[name] = {"alone": config_detail(alone, base),
                         "with_long": config_detail(mixed, base), "files": mixed.files}
    workload = {k: getattr(args, k) for k in ("chat", "chat_prompt", "chat_output", "long",
                                              "long_prompt", "long_every", "seed")}
    result = StudyResult(
        NAME, "Interference study",
        "Chat decode ITL alone vs while long prompts arrive, per layout (same model and "
        "workload, one CPU per worker/engine). ratio = ITL p99 with long prompts / alone; "
        "ITL max shows the single worst stall (one per chat and whole-prompt prefill).",
        COLUMNS, rows, details, extra={"workload": workload})
    if any(LAYOUTS[n].kind == "colocated" for n in names):
        result.notes.append("Colocated engines record no trace events (cluster/colocated_pool.py "
                            "has no tracer), so only the disaggregated layout has a timeline.")
    if rows:
        from bench.plots import plot_grouped_bars

        bars = {r["config"]: {k: v for k, v in (
            ("ITL p99 alone", r["base_itl_p99_ms"]), ("ITL p99 w/ long", r["mixed_itl_p99_ms"]),
            ("ITL max alone", r["base_itl_max_ms"]), ("ITL max w/ long", r["mixed_itl_max_ms"]))
            if v is not None} for r in rows}
        result.plots.append(plot_grouped_bars(
            bars, ctx.out / f"{NAME}.png", ylabel="chat ITL (ms)", xlabel="layout",
            title="Interference: chat ITL without / with long prompts").name)
    result.elapsed_s = time.monotonic() - t0
    return result
