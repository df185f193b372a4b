"""Every study, one after the other, and an index: ``make bench``.

    python -m bench.run_all --quick --out bench/results     # ~10 min on 2 cores, tiny model

One process, one Ray, one reference measurement and one emulated link for all studies;
the shared default configuration is launched once. Writes each study's files and
``OUT/README.md`` linking every table, plot and trace. A study that fails is reported
in the index and the exit status, and the others still run.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import traceback
from pathlib import Path

from bench.studies.common import StudyContext, StudyOptions, StudyResult
from bench.study import ORDER, options_summary, run_study


def write_index(ctx: StudyContext, done: dict[str, StudyResult], failed: dict[str, str],
                elapsed_s: float) -> Path:
    o = ctx.opts
    lines = ["# pdserve study results", "",
             f"`python -m bench.run_all {'--quick ' if o.quick else ''}--out {o.out}` — "
             f"{options_summary(o)}; {elapsed_s / 60:.1f} min, "
             f"{ctx.pool.launches} service launches.", "",
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


def run_all(opts: StudyOptions, studies: tuple[str, ...] = ORDER) -> int:
    t0 = time.monotonic()
    print(f"bench.run_all: {options_summary(opts)}", flush=True)
    ctx = StudyContext(opts)
    done: dict[str, StudyResult] = {}
    failed: dict[str, str] = {}
    try:
        print(f"reference: {ctx.link.describe()}", flush=True)
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
        {"elapsed_s": elapsed, "launches": ctx.pool.launches, "done": list(done),
         "failed": failed, "link": ctx.link.to_dict()}, indent=2))
    print(f"bench.run_all: {len(done)} studies in {elapsed / 60:.1f} min "
          f"({ctx.pool.launches} service launches), {len(failed)} failed -> {index}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    from bench.cli import add_study_options, study_options

    p = argparse.ArgumentParser(prog="python -m bench.run_all", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_study_options(p)
    p.add_argument("--studies", default=",".join(ORDER),
                   help=f"comma-separated subset of {','.join(ORDER)}")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.configs:
        p.error("--configs picks configurations of one study: use `pdserve study NAME`")
    studies = tuple(s.strip() for s in args.studies.split(",") if s.strip())
    unknown = set(studies) - set(ORDER)
    if unknown:
        p.error(f"--studies: unknown {sorted(unknown)}")
    return run_all(study_options(args), studies)


if __name__ == "__main__":
    sys.exit(main())
