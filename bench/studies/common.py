"""What every study imports: options and context, a configuration's run, result files,
traces, and the seeded mixed workload most studies send.

A study is a function ``run(ctx) -> StudyResult``. It builds configurations as dotted
ServeConfig overrides of ``ctx.base_config()``, runs the same seeded workload on each
through :meth:`StudyContext.run` (which also writes each configuration's Chrome trace
and timeline PNG), and returns rows; ``results.py`` turns them into ``NAME.json`` and
``NAME.md``. This module re-exports the pieces (context.py, config_run.py, results.py,
traces.py) so that a study has one import.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bench.studies.config_run import (  # noqa: F401  (re-exported)
    ConfigRun,
    config_detail,
    p,
    pct_ms,
    step_ms,
)
from bench.studies.context import (  # noqa: F401  (re-exported)
    DEFAULT_SLOS,
    TENANT_WEIGHTS,
    StudyContext,
    StudyOptions,
    resolve_model_dir,
)
from bench.studies.results import (  # noqa: F401  (re-exported)
    Column,
    StudyResult,
    parse_table,
    write_result,
)
from bench.studies.traces import (  # noqa: F401  (re-exported)
    trace_metrics,
    with_emulated_link,
    write_trace_files,
)
from bench.workload import WorkloadRequest


def workload_summary(requests: Sequence[WorkloadRequest], **spec: Any) -> dict[str, Any]:
    from bench.workload import summarize_workload

    return {**spec, **summarize_workload(requests)}


def mixed_workload(ctx: StudyContext, *, n: int, rate: float, tag: str,
                   long_fraction: float = 0.2, tenants: Sequence | None = None,
                   chat_prompt: tuple[int, int] = (32, 128),
                   chat_output: tuple[int, int] = (16, 48),
                   long_prompt: tuple[int, int] = (768, 1024),
                   long_output: tuple[int, int] = (8, 16),
                   ) -> tuple[list[WorkloadRequest], dict[str, Any]]:
    """Streaming chat requests plus a share of long prompts, Poisson arrivals, seeded."""
    from bench.workload import LengthDist, TenantSpec, WorkloadSpec, build_workload

    rate *= ctx.load_scale  # the request count comes scaled from ctx.n_requests
    spec = WorkloadSpec(
        num_requests=n, request_rate=rate, mix="mixed", seed=ctx.opts.seed,
        vocab_range=ctx.vocab_range, prompt_len=LengthDist.uniform(*chat_prompt),
        output_len=LengthDist.uniform(*chat_output),
        long_prompt_len=LengthDist.uniform(*long_prompt),
        long_output_len=LengthDist.uniform(*long_output), long_fraction=long_fraction,
        tenants=tuple(tenants or (TenantSpec("default"),)), max_model_len=ctx.max_model_len,
        id_prefix=f"{tag}-")
    described = {"mix": "mixed", "num_requests": n, "request_rate": rate,
                 "long_fraction": long_fraction, "chat_prompt": chat_prompt,
                 "chat_output": chat_output, "long_prompt": long_prompt,
                 "long_output": long_output, "seed": ctx.opts.seed,
                 "tenants": [t.__dict__ for t in spec.tenants]}
    requests = build_workload(spec)
    return requests, workload_summary(requests, **described)
