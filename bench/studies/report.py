"""One page per study run: ``OUT/report.html``, a self-contained file (plots embedded as
data URIs, no network) that a reader takes in at once: what ran (the configuration, the
cost model's or device's label), the sentences the code derives from the numbers, then
every table and plot.

It is rendered from the ``NAME.json`` files of the output directory (what
:func:`bench.studies.results.write_result` wrote), so after `pdserve study all` it holds
every study of the run, and a study rerun into the same directory replaces its section.
The sentences come from each study's ``findings(rows) -> list[str]``; the comparisons they
share are :func:`change` and :func:`ratio_line`.
"""

from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path
from typing import Any

from bench.studies.results import Column

REPORT = "report.html"
ORDER = ("chunk-size", "teaching", "pacing", "fairness", "interference", "baseline")


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return None if math.isnan(v) else float(v)


def change(label: str, before: Any, after: Any) -> str | None:
    """How ``label`` moved from ``before`` to ``after``, in words ("cut ITL p99 by 41%",
    "raised long TTFT mean by 2.3x"); None when either is missing or zero."""
    a, b = _num(before), _num(after)
    if a is None or b is None or a <= 0 or b <= 0:
        return None
    if b < a:
        return f"cut {label} by {(1 - b / a) * 100:.0f}%"
    if b >= 1.5 * a:
        return f"raised {label} by {b / a:.1f}x"
    if b > a:
        return f"raised {label} by {(b / a - 1) * 100:.0f}%"
    return f"left {label} unchanged"


def ratio_line(subject: str, parts: list[str | None]) -> str | None:
    """``subject`` + the comparisons that exist, joined ("chunk 64 cut A and raised B")."""
    said = [p for p in parts if p]
    if not said:
        return None
    body = said[0] if len(said) == 1 else ", ".join(said[:-1]) + " and " + said[-1]
    return f"{subject} {body}."


def _table(data: dict[str, Any]) -> str:
    cols = data.get("columns", [])
    head = "".join(f"<th>{html.escape(c['header'])}</th>" for c in cols)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(Column(**c).cell(r.get(c['key'])))}</td>"
                         for c in cols)
        + "</tr>" for r in data.get("rows", []))
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _phase_table(data: dict[str, Any]) -> str:
    """The TTFT's phases (p50 / p99 ms) of each configuration and tenant, from the metrics
    the configurations recorded (bench.metrics BenchmarkMetrics.ttft_phases), then the
    TTFT p50 split into them (ttft_p50_split: parts that add up to it)."""
    rows, splits = [], []
    for name, detail in (data.get("configs") or {}).items():
        runs = [(name, detail)] if "metrics" in detail else [
            (f"{name} {k}", d) for k, d in detail.items() if isinstance(d, dict) and "metrics" in d]
        for label, d in runs:
            for tenant, phases in (d["metrics"].get("ttft_phases_ms") or {}).items():
                rows.append((label, tenant, phases))
            for tenant, split in (d["metrics"].get("ttft_p50_phases_ms") or {}).items():
                splits.append((label, tenant, split))
    if not rows:
        return ""
    names = list(rows[0][2])
    head = "<th>config</th><th>tenant</th>" + "".join(f"<th>{html.escape(n)}</th>"
                                                         for n in names)
    body = "".join(
        f"<tr><td>{html.escape(label)}</td><td>{html.escape(tenant)}</td>" + "".join(
            f"<td>{p[n]['median']:.1f} / {p[n].get('p99', p[n]['median']):.1f}</td>"
            for n in names) + "</tr>" for label, tenant, p in rows)
    out = ("<h3>TTFT by phase, p50 / p99 (ms)</h3><table><thead><tr>" + head
           + f"</tr></thead><tbody>{body}</tbody></table>")
    if splits:
        body = "".join(
            f"<tr><td>{html.escape(label)}</td><td>{html.escape(tenant)}</td>" + "".join(
                f"<td>{sp.get(n, 0.0):.1f}</td>" for n in names)
            + f"<td>{sum(sp.get(n, 0.0) for n in names):.1f}</td><td>{sp['ttft_p50']:.1f}</td>"
            "</tr>" for label, tenant, sp in splits)
        out += ("<h3>TTFT p50 split into its phases (ms; the requests nearest the p50)</h3>"
                f"<table><thead><tr>{head}<th>sum</th><th>TTFT p50</th></tr></thead>"
                f"<tbody>{body}</tbody></table>")
    return out


def _plot(out: Path, name: str) -> str:
    path = out / name
    if not path.is_file():
        return f"<p class=missing>plot {html.escape(name)} is missing</p>"
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return (f"<figure><img alt=\"{html.escape(name)}\" src=\"data:image/png;base64,{data}\">"
            f"<figcaption>{html.escape(name)}</figcaption></figure>")


def _section(out: Path, data: dict[str, Any]) -> str:
    opts = data.get("options", {})
    ran = data.get("runs") or "real services on this machine"
    facts = [f"ran on: {ran}", f"model {opts.get('model')}",
             f"transport {opts.get('transport')}", f"seed {opts.get('seed')}",
             f"SLOs {opts.get('slos_ms')} ms", "quick run" if opts.get("quick") else "full run",
             f"{data.get('elapsed_s', 0):.0f} s"]
    if data.get("link"):
        facts.append(f"KV link: {data['link'].get('description') or data['link']}")
    parts = [f"<section id=\"{html.escape(data['study'])}\">",
             f"<h2>{html.escape(data.get('title', data['study']))}</h2>"]
    findings = data.get("findings") or []
    if findings:
        parts.append("<div class=answer><ul>" + "".join(
            f"<li>{html.escape(s)}</li>" for s in findings) + "</ul></div>")
    parts += [f"<p>{html.escape(data.get('description', ''))}</p>",
              "<p class=facts>" + html.escape("; ".join(facts)) + "</p>", _table(data),
              _phase_table(data)]
    if data.get("notes"):
        parts.append("<ul class=notes>" + "".join(
            f"<li>{html.escape(str(n))}</li>" for n in data["notes"]) + "</ul>")
    parts += [_plot(out, p) for p in data.get("plots", [])]
    if data.get("workload"):
        parts.append("<details><summary>workload</summary><pre>"
                     + html.escape(json.dumps(data["workload"], indent=1, default=str))
                     + "</pre></details>")
    parts.append("</section>")
    return "\n".join(parts)


_STYLE = """body{font:15px/1.45 system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;
color:#222}h1{font-size:1.5em}h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:2em}
.answer{background:#eef6ee;border-left:4px solid #3a3;padding:.3em 1em;font-size:1.05em}
.facts{color:#555;font-size:.9em}table{border-collapse:collapse;font-size:.85em;margin:.8em 0}
th,td{border:1px solid #ccc;padding:.25em .5em;text-align:right}th{background:#f3f3f3}
td:first-child,th:first-child{text-align:left}img{max-width:100%}figure{margin:1em 0}
figcaption{color:#777;font-size:.8em}.notes{color:#444;font-size:.9em}"""


def study_results(out: Path) -> list[dict[str, Any]]:
    """The study results written into ``out``, in the studies' order."""
    found = []
    for path in sorted(out.glob("*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and "study" in data and "columns" in data:
            found.append(data)
    rank = {n: i for i, n in enumerate(ORDER)}
    return sorted(found, key=lambda d: (rank.get(d["study"], len(rank)), d["study"]))


def write_report(out: Path) -> Path:
    """Write ``out/report.html`` from the study results in ``out``; returns its path."""
    results = study_results(out)
    toc = " · ".join(f"<a href=\"#{html.escape(d['study'])}\">{html.escape(d['title'])}</a>"
                     for d in results)
    answers = [f"<li><b>{html.escape(d['title'])}</b>: {html.escape(' '.join(d['findings']))}"
               "</li>" for d in results if d.get("findings")]
    page = ["<!doctype html><html><head><meta charset=utf-8>",
            "<title>pdserve study report</title>", f"<style>{_STYLE}</style></head><body>",
            "<h1>pdserve study report</h1>", f"<p>{toc}</p>"]
    if len(results) > 1 and answers:
        page.append("<div class=answer><ul>" + "".join(answers) + "</ul></div>")
    page += [_section(out, d) for d in results]
    page.append("</body></html>")
    path = out / REPORT
    path.write_text("\n".join(page), encoding="utf-8")
    return path
