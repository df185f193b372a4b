"""`pdserve study teaching`: bench.teaching's example as a study (table, claims, traces)."""

from __future__ import annotations

import dataclasses
import time

from bench import teaching as t
from bench import teaching_report as tr
from bench.studies.common import (
    Column,
    StudyContext,
    StudyResult,
    config_detail,
    with_emulated_link,
    write_trace_files,
)
from bench.workload import WorkloadRequest
from engine.tracing import TraceEvent

NAME = t.NAME
COLUMNS = [Column("config", "run"), Column("chunk", "max chunk")] + [
    Column(k, label, "{:.1f}") for k, label in tr.ROWS]


def disagg_run(ctx: StudyContext, spec: t.TeachingSpec) -> dict:
    """(c): S and L on the 1P+1D service with chunk ``spec.chunk``; timings from the trace
    (worker events plus the client's token arrivals, on the wall clock)."""
    vocab = ctx.model_config.vocab_size
    arrive_s = 0.3
    reqs = [WorkloadRequest("teach-stream", 0.0, t._prompt(spec.stream_prompt, 7, vocab),
                            spec.stream_tokens * 2, kind="chat"),
            WorkloadRequest("teach-long", arrive_s, t._prompt(spec.long_prompt, 8, vocab),
                            spec.long_tokens, kind="long")]
    cfg = ctx.base_config().with_values({"scheduler.max_prefill_chunk": spec.chunk,
                                         "scheduler.max_num_batched_tokens": spec.chunk})
    run = ctx.run(NAME, "disagg", cfg, reqs)
    wall = time.time() - time.monotonic()  # monotonic -> wall clock offset, this process
    rename = {"teach-stream": t.S_ID, "teach-long": t.L_ID}
    # workers label events by leg id ("<request>#<leg>")
    events = [dataclasses.replace(e, request_id=rename.get(rid := e.request_id.split("#")[0], rid))
              for e in run.events]
    for r in run.records:
        events += [TraceEvent(rename[r.request_id], "token", "client", x + wall, x + wall)
                   for x in r.token_times]
    l_rec = next(r for r in run.records if r.request_id == "teach-long")
    timings = t.timings(events, l_rec.send_time + wall)
    timings["worker_trace_events"] = len(run.events)
    if l_rec.ttft is not None:  # what the client saw, not the worker's sampling time
        timings["l_ttft_ms"] = l_rec.ttft * 1e3
    events = with_emulated_link(events, cfg.transfer.link_gbps)  # for the files only
    files = write_trace_files(ctx.out, NAME, "disagg", events) if run.events else {}
    return {"chunk": spec.chunk, "timings": timings, "files": files, "events": events,
            "l_arrival": l_rec.send_time + wall,
            "detail": config_detail(run, ctx.base_config(), trace_events=len(run.events)),
            "records_ok": all(r.success for r in run.records)}


def zoomed_timeline(ctx: StudyContext, mode: str, events: list[TraceEvent],
                    l_arrival: float) -> str:
    """The timeline around L's prefill: from just before L arrives to just after S's
    first token following L's first token."""
    from bench.plots import plot_timeline

    t0 = min(e.start for e in events)
    ends = [e.start for e in events if e.request_id == t.L_ID and e.phase == "token"] or \
        [e.end for e in events if e.request_id == t.L_ID and e.phase == "prefill_chunk"]
    stop = min(ends, default=l_arrival) + 0.02
    span = max(stop - l_arrival, 0.01)
    png = plot_timeline(events, ctx.out / f"{NAME}-{mode}.zoom.png",
                        title=f"{NAME}: {mode}, around L's prefill",
                        window=(l_arrival - t0 - 0.1 * span, stop - t0 + 0.1 * span))
    return png.name


def findings(result: StudyResult) -> list[str]:
    """How many of the example's claims this run's trace bears out."""
    claims = result.extra.get("claims") or {}
    if not claims:
        return []
    held = sum(1 for v in claims.values() if v)
    return [f"{held} of {len(claims)} of the example's claims held in this run's trace."]

def run(ctx: StudyContext) -> StudyResult:
    t0 = time.monotonic()
    spec = t.TeachingSpec(repeats=3 if ctx.opts.quick else 5)
    result: dict = {"spec": dataclasses.asdict(spec)}
    result.update(t.run_colocated(ctx.model_dir, spec))
    result["disagg"] = disagg_run(ctx, spec)
    result["crossover"] = t.crossover(ctx.model_dir, (spec.long_prompt, 1024), spec.chunk)
    claims, seen = tr.claims(result), tr.observations(result)
    configs, rows = {}, []
    for mode in ("whole", "chunked", "disagg"):
        r = result[mode]
        if mode != "disagg":
            r["files"] = write_trace_files(ctx.out, NAME, mode, r["events"])
        if r.get("events"):
            r["files"]["zoom"] = zoomed_timeline(ctx, mode, r.pop("events"), r["l_arrival"])
        rows.append({"config": mode, "chunk": r["chunk"], **r["timings"]})
        configs[mode] = {k: v for k, v in r.items() if k not in ("l_arrival", "events")}
    table = tr.side_by_side(result)
    res = StudyResult(
        NAME, "Teaching example: chunked prefill and a streaming neighbour",
        f"A streaming request S ({spec.stream_prompt}-token prompt) is decoding when a "
        f"{spec.long_prompt}-token prompt L arrives. (a) whole prefill and (b) chunked "
        f"prefill ({spec.chunk}-token chunks) on an in-process colocated engine (best of "
        f"{spec.repeats} runs), (c) the 1P+1D service. All numbers come from the traces.",
        COLUMNS, rows, configs,
        extra={"spec": result["spec"], "claims": claims, "observations": seen,
               "crossover": result["crossover"], "side_by_side": table.splitlines()})
    mark = lambda ok: "OK " if ok else ("n/a" if ok is None else "NO ")  # noqa: E731
    res.notes += [f"{mark(ok)}  {c}" for c, ok in claims.items()]
    res.notes += [f"{mark(ok)}  this run's clock: {c}" for c, ok in seen.items()]
    if not result["disagg"]["timings"]["worker_trace_events"]:
        res.notes.append("The service's workers recorded no trace events, so the disagg "
                         "claims cannot be checked (its timings use the client's tokens).")
    res.notes += [f"Lone-prompt prefill, whole vs {spec.chunk}-token chunks (on a busy CPU the "
                  "reference attention's full score rectangle can make a whole long prefill "
                  "the slower one; the example's claims need it to be the faster): "
                  + "; ".join(
                      f"{int(x['prompt'])} tokens: whole {x['whole_ms']:.0f} ms, chunked "
                      f"{x['chunked_ms']:.0f} ms" for x in result["crossover"])]
    from bench.plots import plot_grouped_bars

    res.plots.append(plot_grouped_bars(
        {r["config"]: {"S next token": r["s_next_token_ms"], "L first token": r["l_ttft_ms"]}
         for r in rows if r["s_next_token_ms"] is not None and r["l_ttft_ms"] is not None},
        ctx.out / f"{NAME}.png", ylabel="ms after L arrives", xlabel="run",
        title="Chunked prefill: S's next token earlier, L's first token later").name)
    res.elapsed_s = time.monotonic() - t0
    return res
