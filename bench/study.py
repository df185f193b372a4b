"""Studies by name, and running them: one (``pdserve study NAME``) or all with an index
(``pdserve study all``, ``make bench``).

    ctx = StudyContext(StudyOptions(out=Path("results"), quick=True))
    try:
        result = run_study("chunk-size", ctx)   # writes results/chunk-size.{json,md,png}
    finally:
        ctx.close()

Every study module has ``NAME`` and ``run(ctx) -> StudyResult`` (see bench/studies/).
``run_all`` uses one process, one Ray, one reference measurement and one emulated link
for all studies, so the shared default configuration is launched once; a study that
fails is reported in the index and the exit status, and the others still run.
"""

from __future__ import annotations

import importlib
import json
import logging
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the studies import torch; `pdserve --help` must not
    from bench.studies.context import StudyContext, StudyOptions
    from bench.studies.results import StudyResult

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
    from bench.studies.report import write_report
    from bench.studies.results import write_result

    module = importlib.import_module(STUDIES[name]) if name in STUDIES else None
    fn = study_fn(name)
    t0 = time.monotonic()
    result = fn(ctx)
    result.elapsed_s = result.elapsed_s or time.monotonic() - t0
    if derive := getattr(module, "findings", None):
        result.findings = derive(result)
    if ctx.simulated:  # every output says what ran it (an analytic model says so)
        result.notes.insert(0, ctx.describe())
    paths = write_result(ctx, result)
    write_report(ctx.out)  # the directory's one page, this study's section renewed
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
    lines += [f"   finding: {f}" for f in result.findings]
    lines.append(f"   -> {md} (+ {len(result.plots)} plot(s); all on one page: "
                 f"{md.with_name('report.html')})")
    return "\n".join(lines)


def run_all(opts: StudyOptions, studies: tuple[str, ...] = ORDER,
            ctx_factory: Callable[[StudyOptions], StudyContext] | None = None) -> int:
    """Every study in ``studies``, then ``OUT/README.md`` linking every table, plot and
    trace, and ``OUT/run_all.json``; the exit status is 1 when any study failed."""
    from bench.studies.context import StudyContext

    t0 = time.monotonic()
    print(f"pdserve study all: {opts.summary()}", flush=True)
    ctx = ctx_factory(opts) if ctx_factory else StudyContext(opts)
    done: dict[str, StudyResult] = {}
    failed: dict[str, str] = {}
    try:
        print(f"reference: {ctx.link.describe()}", flush=True)
        print(f"runs: {ctx.describe()}", flush=True)
        for name in studies:
            try:
                done[name] = run_study(name, ctx)
            except Exception:  # one broken study must not hide the others' results
                failed[name] = traceback.format_exc()
                print(f"== {name} FAILED ==\n{failed[name]}", file=sys.stderr, flush=True)
            print(flush=True)
    finally:
        ctx.close()
    elapsed = time.monotonic() - t0
    index = write_index(ctx, done, failed, elapsed)
    (ctx.out / "run_all.json").write_text(json.dumps(
        {"elapsed_s": elapsed, "launches": ctx.launches, "done": list(done),
         "failed": failed, "link": ctx.link.to_dict()}, indent=2))
    print(f"pdserve study all: {len(done)} studies in {elapsed / 60:.1f} min "
          f"({ctx.launches} service launches), {len(failed)} failed -> {index}")
    return 1 if failed else 0


def write_index(ctx: StudyContext, done: dict[str, StudyResult], failed: dict[str, str],
                elapsed_s: float) -> Path:
    o = ctx.opts
    lines = ["# pdserve study results", "",
             f"`pdserve study all {'--quick ' if o.quick else ''}--out {o.out}` — "
             f"{o.summary()}; {elapsed_s / 60:.1f} min, "
             f"{ctx.launches} service launches.", "",
             f"Emulated KV link: {ctx.link.describe()}.", "",
             "| study | configurations | time (s) | table | plots |", "|---|---|---|---|---|"]
    for name in ORDER:
        if name in done:
            r = done[name]
            plots = ", ".join(f"[{p}]({p})" for p in r.plots)
            lines.append(f"| {r.title} | {len(r.rows)} | {r.elapsed_s:.0f} | "
                         f"[{name}.md]({name}.md) ([json]({name}.json)) | {plots} |")
        elif name in failed:
            lines.append(f"| {name} | failed: {failed[name].splitlines()[-1][:120]} | | | |")
    for name in ORDER:
        if name in done:
            r = done[name]
            lines += ["", f"## {r.title}", "", r.table()]
            if "claims" in r.extra:
                lines += [""] + [f"- {'OK' if v else ('n/a' if v is None else 'NO')}: {k}"
                                 for k, v in r.extra["claims"].items()]
    path = ctx.out / "README.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
