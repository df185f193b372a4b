"""baseline: engine.LLM (colocated, in-process) vs transformers ``generate``, same model.

A thin call of ``bench.engine_vs_hf.compare`` (which owns the comparison: same prompts,
same threads, greedy with EOS ignored) on the study's model and a workload sized for it;
here it becomes a table, a bar chart and ratios. Outputs must be greedy-equal.
"""

from __future__ import annotations

import time

from bench.studies.common import Column, StudyContext, StudyResult

NAME = "baseline"
COLUMNS = [
    Column("config", "peer"), Column("output_tok_s", "output tok/s"),
    Column("total_tok_s", "prompt+output tok/s"), Column("wall_s", "wall (s)", "{:.2f}"),
    Column("ratio", "engine / peer", "{:.2f}"), Column("greedy_equal", "greedy-equal prompts"),
]


def engine_vs_hf_args(ctx: StudyContext) -> list[str]:
    quick = ctx.opts.quick
    n, hi, out = (8, 256, 32) if quick else (32, 1024, 64)
    peers = "engine,hf-padded" if quick else "engine,hf-padded,hf-cb"
    return ["--model-dir", str(ctx.model_dir), "--num-prompts", str(n), "--min-len", "32",
            "--max-len", str(min(hi, ctx.max_model_len - out - 1)), "--output-len", str(out),
            "--seed", str(ctx.opts.seed), "--peers", peers,
            "--decode-steps", "0" if quick else "8"]


def findings(result: StudyResult) -> list[str]:
    """The engine's output rate against each transformers peer."""
    return [f"engine.LLM ran at {r['ratio']:.2f}x the output tokens/s of {r['config']} "
            f"(greedy-equal prompts: {r['greedy_equal']})." for r in result.rows
            if r["config"] != "engine" and r.get("ratio") is not None]

def run(ctx: StudyContext) -> StudyResult:
    import torch

    from bench import engine_vs_hf

    t0 = time.monotonic()
    argv = engine_vs_hf_args(ctx)
    threads = torch.get_num_threads()
    log: list[str] = []
    try:
        report = engine_vs_hf.compare(engine_vs_hf.parse_args(argv), echo=log.append)
    finally:
        torch.set_num_threads(threads)
    peers = report["peers"]
    eng = peers["engine"]
    n_prompts = int(argv[argv.index("--num-prompts") + 1])
    rows = []
    for name, res in peers.items():
        rows.append({
            "config": name, "output_tok_s": res["output_tok_s"], "total_tok_s": res["total_tok_s"],
            "wall_s": res["wall_s"], "ratio": eng["output_tok_s"] / res["output_tok_s"],
            "greedy_equal": (f"{res['greedy_equal_to_engine']}/{n_prompts}"
                             if "greedy_equal_to_engine" in res else "reference"),
        })
    result = StudyResult(
        NAME, "Baseline: engine.LLM vs transformers",
        "Output tokens/s of the colocated engine (paged KV, chunked prefill, continuous "
        "batching) against transformers `generate` on left-padded batches (and its "
        "continuous batching in full runs), same model, prompts and threads "
        "(`python -m bench.engine_vs_hf " + " ".join(argv) + "`).",
        COLUMNS, rows, {n: dict(r) for n, r in peers.items()},
        extra={"engine_vs_hf": report, "log": log})
    from bench.plots import plot_grouped_bars

    result.plots.append(plot_grouped_bars(
        {r["config"]: {"output tok/s": r["output_tok_s"]} for r in rows},
        ctx.out / f"{NAME}.png", ylabel="output tokens / s", xlabel="peer",
        title=f"engine.LLM vs transformers ({ctx.opts.model})").name)
    result.elapsed_s = time.monotonic() - t0
    return result
