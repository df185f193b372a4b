"""Study results: the table columns, the result object and its files (JSON + markdown).

The markdown table is rendered from the same rows that go into the JSON, through the
same :class:`Column` formatting, so the two can be checked against each other
(:func:`parse_table` reads a table back).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.studies.context import StudyContext


@dataclass(frozen=True)
class Column:
    key: str
    header: str
    fmt: str = "{:.1f}"

    def cell(self, value: Any) -> str:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "n/a"
        if isinstance(value, bool):
            return "yes" if value else "no"
        if isinstance(value, int | str):
            return str(value)
        return self.fmt.format(value)


@dataclass
class StudyResult:
    name: str
    title: str
    description: str
    columns: list[Column]
    rows: list[dict[str, Any]]
    configs: dict[str, dict[str, Any]] = field(default_factory=dict)  # full detail by name
    extra: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    plots: list[str] = field(default_factory=list)  # PNG file names in the out dir
    elapsed_s: float = 0.0
    findings: list[str] = field(default_factory=list)  # sentences derived from the rows

    def table(self) -> str:
        """The markdown table of ``rows`` (what ``NAME.md`` and the console show)."""
        head = "| " + " | ".join(c.header for c in self.columns) + " |"
        rule = "|" + "|".join("---" for _ in self.columns) + "|"
        body = ["| " + " | ".join(c.cell(r.get(c.key)) for c in self.columns) + " |"
                for r in self.rows]
        return "\n".join([head, rule, *body])


def write_result(ctx: StudyContext, result: StudyResult) -> dict[str, Path]:
    """Write ``NAME.json`` and ``NAME.md`` into the output directory; returns their paths
    (bench/studies/report.py renders the directory's report.html from them)."""

    out = ctx.out
    header = {
        "study": result.name, "title": result.title, "description": result.description,
        "created_unix_s": time.time(), "elapsed_s": result.elapsed_s,
        "runs": ctx.describe(),
        "options": {"quick": ctx.opts.quick, "model": ctx.opts.model,
                    "model_dir": str(ctx.model_dir), "transport": ctx.opts.transport,
                    "seed": ctx.opts.seed, "slos_ms": dict(ctx.opts.slos)},
    }
    if "link" not in result.extra and _uses_link(result):
        result.extra["link"] = {**ctx.link.to_dict(), "description": ctx.link.describe()}
    data = {**header, "columns": [c.__dict__ for c in result.columns], "rows": result.rows,
            "configs": result.configs, **result.extra, "notes": result.notes,
            "plots": result.plots, "findings": result.findings}
    js = out / f"{result.name}.json"
    js.write_text(json.dumps(data, indent=2, default=_json_default), encoding="utf-8")
    md = out / f"{result.name}.md"
    md.write_text(render_markdown(ctx, result), encoding="utf-8")
    return {"json": js, "md": md}


def _uses_link(result: StudyResult) -> bool:
    return result.name not in ("baseline",)


def _json_default(o: Any) -> Any:
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "to_dict"):
        return o.to_dict()
    if hasattr(o, "__dict__"):
        return dict(o.__dict__)
    raise TypeError(f"cannot serialise {type(o).__name__}")


def render_markdown(ctx: StudyContext, result: StudyResult) -> str:
    lines = [f"# {result.title}", "", result.description, ""]
    if result.findings:
        lines += [f"- {s}" for s in result.findings] + [""]
    if "link" in result.extra:
        lines += [f"Emulated KV link: {ctx.link.describe()}.", ""]
    if "workload" in result.extra:
        lines += [f"Workload: `{json.dumps(result.extra['workload'], default=str)}`", ""]
    lines += [f"Model `{ctx.opts.model}`, transport `{ctx.opts.transport}`, SLOs "
              f"{dict(ctx.opts.slos)} ms, {'quick' if ctx.opts.quick else 'full'} run "
              f"({result.elapsed_s:.0f} s).", "", result.table(), ""]
    if result.notes:
        lines += ["Notes:", ""] + [f"- {n}" for n in result.notes] + [""]
    for png in result.plots:
        lines += [f"![{png}]({png})", ""]
    traces = [(n, d["files"]) for n, d in result.configs.items() if d.get("files")]
    if traces:
        lines += ["Traces (open the JSON in ui.perfetto.dev):", ""]
        lines += [f"- {n}: " + ", ".join(f"[{kind}]({name})" for kind, name in f.items())
                  for n, f in traces]
        lines.append("")
    return "\n".join(lines)


def parse_table(md: str) -> list[list[str]]:
    """Cells of the first markdown table in ``md`` (header first), for tests and tools."""
    rows = [ln for ln in md.splitlines() if ln.startswith("|")]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in rows if "---" not in ln]
