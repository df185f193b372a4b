"""Studies by name, and running them: ``pdserve study NAME`` and ``python -m bench.run_all``.

    ctx = StudyContext(StudyOptions(out=Path("results"), quick=True))
    try:
        result = run_study("chunk-size", ctx)   # writes results/chunk-size.{json,md,png}
    finally:
        ctx.close()

Every study module has ``NAME`` and ``run(ctx) -> StudyResult`` (see bench/studies/).
"""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the studies import torch; `pdserve --help` must not
    from bench.studies.common import StudyContext, StudyOptions, StudyResult

log = logging.getLogger(__name__)

# name -> module (imported on use: matplotlib, transformers and Ray only when needed)
STUDIES: dict[str, str] = {
    "chunk-size": "bench.studies.chunk_size",
    "pacing": "bench.studies.pacing",
    "fairness": "bench.studies.fairness",
    "interference": "bench.studies.interference",
    "baseline": "bench.studies.baseline",
    "teaching": "bench.studies.teaching",
}
# run_all's order: the teaching example reuses chunk-size's chunk-64 service
ORDER = ("chunk-size", "teaching", "pacing", "fairness", "interference", "baseline")


def study_fn(name: str) -> Callable[[StudyContext], StudyResult]:
    if name not in STUDIES:
        raise ValueError(f"unknown study {name!r}; choose from {', '.join(STUDIES)}")
    return importlib.import_module(STUDIES[name]).run


def run_study(name: str, ctx: StudyContext, *, echo: Callable[[str], None] = print,
              ) -> StudyResult:
    """Run one study, write its files and echo its table; returns the result."""
    from bench.studies.common import write_result

    fn = study_fn(name)
    t0 = time.monotonic()
    result = fn(ctx)
    result.elapsed_s = result.elapsed_s or time.monotonic() - t0
    paths = write_result(ctx, result)
    echo(format_result(result, ctx, paths["md"]))
    return result


def format_result(result: StudyResult, ctx: StudyContext, md: Path) -> str:
    lines = [f"== {result.title} ({result.name}, {result.elapsed_s:.0f} s) =="]
    if result.name != "baseline":
        lines.append(f"   {ctx.link.describe()}")
    lines += [result.table()]
    if "side_by_side" in result.extra:
        lines += ["", *result.extra["side_by_side"]]
    lines += [f"   note: {n}" for n in result.notes]
    lines.append(f"   -> {md} (+ {len(result.plots)} plot(s))")
    return "\n".join(lines)


def options_summary(opts: StudyOptions) -> str:
    link = f"link {opts.link_gbps} Gbit/s" if opts.link_gbps else \
        f"transfer/compute ratio {opts.transfer_compute_ratio:g}"
    return (f"model {opts.model}, {'quick' if opts.quick else 'full'}, {link}, "
            f"transport {opts.transport}, seed {opts.seed}, out {opts.out}")
