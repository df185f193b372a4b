"""interference: do long prompts hurt running decodes? (``pdserve study interference`` and,
with its own flags and printout, ``python -m tools.interference``)

Each layout serves the same streaming chats twice: alone, then while long prompts arrive
(``long`` of them, or with ``long=0`` one after the other until the chats end, those
still running then cancelled: they only interfere). Layouts: 1P+1D disaggregated, two
colocated engines without chunked prefill (vLLM's disaggregation-benchmark baseline) and,
in the study, two colocated engines with chunked prefill. ``ratio`` = chat ITL p99 with
long prompts / alone; disaggregation should stay near 1 while colocated grows.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import asdict, dataclass

import numpy as np

from bench.records import RequestRecord
from bench.studies.common import Column, StudyContext, StudyResult, config_detail
from bench.studies.service import DISAGG, Drive, Layout, OnDone, Sender
from bench.workload import WorkloadRequest
from cluster.config.serve import ServeConfig
from engine.quantiles import percentile

NAME = "interference"
LAYOUTS = {
    "disagg": DISAGG,
    "colocated": Layout("colocated", engines=2, chunked_prefill=False),
    "colocated-chunked": Layout("colocated", engines=2, chunked_prefill=True),
}


LONG_OUTPUT = 8  # tokens a long prompt generates: it is there to interfere


@dataclass(frozen=True)
class InterferenceSpec:
    """The workload: ``chat`` streaming chats, and long prompts from 0.2 s on."""

    chat: int = 8
    chat_prompt: int = 128
    chat_output: int = 256
    long: int = 6  # long prompts, one every long_every s; 0: until the chats end
    long_prompt: int = 2048
    long_every: float = 4.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("chat", "chat_prompt", "chat_output", "long_prompt"):
            if getattr(self, name) < 1:
                raise ValueError(f"InterferenceSpec.{name} must be >= 1, got {getattr(self, name)}")
        if self.long < 0 or not self.long_every > 0:
            raise ValueError(f"InterferenceSpec: long must be >= 0 and long_every > 0, got "
                             f"{self.long} and {self.long_every}")

    @property
    def kv_tokens(self) -> int:
        """Every chat and every long prompt at once, each to its last token."""
        return self.chat * (self.chat_prompt + self.chat_output) + self.long * (
            self.long_prompt + LONG_OUTPUT)

    def chats(self, tag: str) -> list[WorkloadRequest]:
        rng = random.Random(self.seed)
        return [WorkloadRequest(f"{tag}-chat-{i}", 0.05 * i,
                                [rng.randrange(1, 2000) for _ in range(self.chat_prompt)],
                                self.chat_output, kind="chat") for i in range(self.chat)]

    def long_request(self, tag: str, i: int) -> WorkloadRequest:
        rng = random.Random(self.seed * 1000 + i + 1)
        return WorkloadRequest(f"{tag}-long-{i}", 0.2 + self.long_every * i,
                               [rng.randrange(1, 2000) for _ in range(self.long_prompt)],
                               LONG_OUTPUT, kind="long")


async def run_phase(send: Sender, spec: InterferenceSpec, tag: str, with_long: bool,
                    on_done: OnDone | None = None) -> list[RequestRecord]:
    """The chats, plus (``with_long``) long prompts arriving until the chats end."""
    t0 = time.monotonic()
    chats = asyncio.ensure_future(send(spec.chats(tag), on_done))
    longs: list[asyncio.Task] = []

    async def feed() -> None:
        i = 0
        while not spec.long or i < spec.long:
            req = spec.long_request(tag, i)
            await asyncio.sleep(max(0.0, t0 + req.arrival_s - time.monotonic()))
            # send() waits arrival_s again from its own start: long prompt i reaches the
            # service 2 * arrival_s after the phase starts (the README's figures' schedule)
            longs.append(asyncio.ensure_future(send([req])))
            i += 1

    feeder = asyncio.ensure_future(feed()) if with_long else None
    records = list(await chats)
    if feeder is not None:
        feeder.cancel()
        if spec.long:  # a fixed number: they all finish
            await asyncio.gather(*longs)
        for t in longs:
            if not t.done():
                t.cancel()  # the client hangs up: the router aborts it on both pools
        for t in longs:
            with contextlib.suppress(asyncio.CancelledError):
                records += await t
    return records


def phase(spec: InterferenceSpec, tag: str, with_long: bool) -> Drive:
    """One phase as a Drive (its progress counts the chats)."""
    return Drive(spec.chat, lambda send, on_done: run_phase(send, spec, tag, with_long, on_done))


def summarize(records: list[RequestRecord]) -> dict:
    """Chat ITL p50/p99/max (NaN without gaps), long-prompt TTFT, failed chats."""
    chat = [r for r in records if r.kind == "chat" and r.success]
    itl = [g for r in chat for g in r.itls] or [float("nan")]
    longs = [r.ttft for r in records if r.kind == "long" and r.success and r.ttft]
    return {"itl_p50_ms": percentile(itl, 50) * 1e3,
            "itl_p99_ms": percentile(itl, 99) * 1e3,
            "itl_max_ms": float(np.max(itl) * 1e3),
            "long_ttft_mean_s": float(np.mean(longs)) if longs else None,
            "long_completed": len(longs),
            "failed": sum(not r.success for r in records if r.kind == "chat")}


def kv_values(ctx: StudyContext, spec: InterferenceSpec) -> dict[str, float]:
    """On an emulated device, each engine's KV sized to hold the whole workload (a quarter
    to spare): the studies' 0.25 GiB holds 2,048 tokens of an 8B model, and the full
    workload's 8 chats alone need 5,120, so chats were preempted and re-dispatched (a
    ~2 s token gap) and the study measured that, not interference. Off it: {}."""
    if not ctx.opts.emulate:
        return {}
    import torch

    from engine.kv_cache import KVCache

    per_token = KVCache.bytes_per_token(ctx.model_config, torch.bfloat16)
    need = 1.25 * spec.kv_tokens * per_token / (1 << 30)
    base = ctx.base_config().cache.kv_cache_memory_gb
    return {"cache.kv_cache_memory_gb": round(max(base, need), 3)}


def layout_config(base: ServeConfig, layout: Layout, long_prompt: int) -> ServeConfig:
    if layout.kind == "colocated" and not layout.chunked_prefill:
        # whole prompts in one step: the step budget must hold the longest prompt
        return base.with_values({"scheduler.max_num_batched_tokens": max(long_prompt, 256),
                                 "scheduler.enable_chunked_prefill": False})
    return base


# ---- the study ------------------------------------------------------------------------
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


def workload_spec(ctx: StudyContext) -> InterferenceSpec:
    """The workload sized for the study's model and mode: the chats must still be
    decoding while the long prompts arrive (a few seconds of decode on a small model)."""
    quick = ctx.opts.quick
    return InterferenceSpec(
        chat=4 if quick else 8, chat_prompt=64 if quick else 128,
        chat_output=256 if quick else 512, long=2 if quick else 4,
        long_prompt=min(1024, ctx.max_model_len - 16), long_every=0.4 if quick else 0.75,
        seed=ctx.opts.seed)


def _defined(v: float | None) -> float | None:
    return None if v is None or v != v else v  # NaN (no gaps) -> n/a


def findings(result: StudyResult) -> list[str]:
    """How much long prompts stretched chat ITL p99, per layout."""
    parts = [f"{r['config']} {r['ratio']:.2f}x" for r in result.rows
             if r.get("ratio") is not None]
    if not parts:
        return []
    return ["Long prompts arriving multiplied the chats' ITL p99 by: " + ", ".join(parts) + "."]

def run(ctx: StudyContext) -> StudyResult:
    t0 = time.monotonic()
    spec = workload_spec(ctx)
    names = ctx.selected(list(LAYOUTS))
    base = ctx.base_config().with_values(kv_values(ctx, spec))
    rows, details = [], {}
    for name in names:
        layout = LAYOUTS[name]
        cfg = layout_config(base, layout, spec.long_prompt)
        alone = ctx.run(NAME, f"{name}-alone", cfg, phase(spec, f"{name}-a", False), layout)
        mixed = ctx.run(NAME, f"{name}-with-long", cfg, phase(spec, f"{name}-m", True), layout)
        a, m = summarize(alone.records), summarize(mixed.records)
        ttft = m["long_ttft_mean_s"]
        rows.append({
            "config": name,
            **{f"{side}_itl_{k}_ms": _defined(s[f"itl_{k}_ms"])
               for side, s in (("base", a), ("mixed", m)) for k in ("p50", "p99", "max")},
            "ratio": _defined(m["itl_p99_ms"] / a["itl_p99_ms"]) if a["itl_p99_ms"] else None,
            "long_ttft_mean_ms": ttft * 1e3 if ttft is not None else None,
            "failed": a["failed"] + m["failed"],
        })
        details[name] = {"alone": config_detail(alone, base),
                         "with_long": config_detail(mixed, base), "files": mixed.files}
    result = StudyResult(
        NAME, "Interference study",
        "Chat decode ITL alone vs while long prompts arrive, per layout (same model and "
        "workload, one CPU per worker/engine). ratio = ITL p99 with long prompts / alone; "
        "ITL max shows the single worst stall (one per chat and whole-prompt prefill).",
        COLUMNS, rows, details, extra={"workload": asdict(spec)})
    if any(LAYOUTS[n].kind == "colocated" for n in names):
        result.notes.append("Colocated engines record no trace events (cluster/launch/colocated_pool.py "
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
