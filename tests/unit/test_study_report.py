"""A study's one page: report.html is self-contained (plots inlined, nothing fetched), holds
every study written into its directory, and opens with sentences derived from the rows."""

from __future__ import annotations

import base64
import re
from pathlib import Path

from bench.studies import chunk_size, fairness, interference, pacing
from bench.studies.common import Column, StudyResult, write_result
from bench.studies.report import change, ratio_line, study_results, write_report
from tests.unit.test_study_results import fake_ctx

# a 1x1 PNG: the report must inline the bytes it finds, whatever they show
PNG = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQ"
                       "DwAEhQGAhKmMIQAAAABJRU5ErkJggg==")


def report(ctx, res: StudyResult) -> str:
    """What run_study writes: the study's files, then the directory's page."""
    write_result(ctx, res)
    return write_report(ctx.out).read_text()


def chunk_rows() -> list[dict]:
    return [
        {"config": "chunk-512", "chunk": 512, "itl_p99_ms": 50.0, "short_ttft_p99_ms": 400.0,
         "long_ttft_mean_ms": 100.0, "goodput_rps": 1.5},
        {"config": "chunk-64", "chunk": 64, "itl_p99_ms": 29.5, "short_ttft_p99_ms": 100.0,
         "long_ttft_mean_ms": 230.0, "goodput_rps": 2.0},
        {"config": "chunk-128", "chunk": 128, "itl_p99_ms": 35.0, "short_ttft_p99_ms": 150.0,
         "long_ttft_mean_ms": 160.0, "goodput_rps": 2.5},
    ]


def test_change_says_which_way_and_how_much() -> None:
    assert change("ITL p99", 50.0, 29.5) == "cut ITL p99 by 41%"
    assert change("TTFT", 100.0, 230.0) == "raised TTFT by 2.3x"
    assert change("TTFT", 100.0, 120.0) == "raised TTFT by 20%"
    assert change("TTFT", 100.0, 100.0) == "left TTFT unchanged"
    assert change("TTFT", None, 1.0) is None and change("TTFT", 0.0, 1.0) is None
    assert change("TTFT", float("nan"), 1.0) is None
    assert ratio_line("X", [None, "cut a by 1%", "raised b by 2%", "raised c by 3x"]) == \
        "X cut a by 1%, raised b by 2% and raised c by 3x."
    assert ratio_line("X", [None]) is None


def test_the_chunk_size_findings_compare_the_extremes_and_name_the_best_goodput() -> None:
    res = StudyResult("chunk-size", "Chunk", "d", chunk_size.COLUMNS, chunk_rows())
    assert chunk_size.findings(res) == [
        "Chunk 64 (against 512) cut ITL p99 by 41%, cut the short prompts' TTFT p99 by 75% "
        "and raised the long prompts' mean TTFT by 2.3x.",
        "SLO goodput peaked at chunk 128 (2.50 req/s; lowest 1.50 at chunk 512).",
    ]
    assert chunk_size.findings(StudyResult("chunk-size", "C", "d", [], chunk_rows()[:1])) == []


def test_the_other_studies_findings_read_their_own_rows() -> None:
    rows = [{"config": "at_end", "ttft_p99_ms": 200.0, "chat_itl_p99_ms": 40.0,
             "transfer_overlap": 0.0},
            {"config": "eager", "ttft_p99_ms": 150.0, "chat_itl_p99_ms": 44.0,
             "transfer_overlap": 0.8}]
    said = pacing.findings(StudyResult("pacing", "P", "d", [], rows))
    assert said == ["eager (against at_end) cut TTFT p99 by 25% and raised the running "
                    "decodes' ITL p99 by 10%.",
                    "eager hid 80% of its transfer time behind prefill (at_end: 0%)."]
    rows = [{"config": "fcfs+fcfs", "jain_prefill": 0.8, "gold_prefill_share": 0.5},
            {"config": "wfq+wfq", "jain_prefill": 0.99, "gold_prefill_share": 0.65}]
    said = fairness.findings(StudyResult("fairness", "F", "d", [], rows))
    assert said[0].startswith("wfq+wfq came closest to the weights 2:1")
    assert said[2] == "wfq+wfq: gold got 0.65 of the prefill compute (its weight's share: 0.67)."
    rows = [{"config": "disagg", "ratio": 1.1}, {"config": "colocated", "ratio": 1.6}]
    assert interference.findings(StudyResult("interference", "I", "d", [], rows)) == [
        "Long prompts arriving multiplied the chats' ITL p99 by: disagg 1.10x, "
        "colocated 1.60x."]


def test_report_html_is_one_self_contained_page_of_every_study_in_the_directory(
        tmp_path: Path) -> None:
    (tmp_path / "chunk-size.png").write_bytes(PNG)
    res = StudyResult("chunk-size", "Chunk-size study", "chunk -> latency",
                      chunk_size.COLUMNS, chunk_rows(), plots=["chunk-size.png"])
    res.findings = chunk_size.findings(res)
    ctx = fake_ctx(tmp_path)
    page = report(ctx, res)
    assert page.startswith("<!doctype html>") and page.rstrip().endswith("</html>")
    assert "data:image/png;base64," + base64.b64encode(PNG).decode() in page
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page)  # nothing fetched
    assert "Chunk 64 (against 512) cut ITL p99 by 41%" in page
    assert "real services on this machine (test)" in page  # what ran it
    assert "transfer/compute ratio 0.15" in page  # the link it ran over
    assert "<td>chunk-64</td>" in page and "<td>2.50</td>" in page  # goodput column format
    # a second study joins the same page; a rerun replaces its own section
    other = StudyResult("baseline", "Baseline", "engine vs peers",
                        [Column("config", "peer"), Column("ratio", "ratio", "{:.2f}")],
                        [{"config": "hf-padded", "ratio": 3.0, "greedy_equal": "8/8"}])
    write_result(ctx, other)
    res.rows = res.rows[:2]
    res.findings = chunk_size.findings(res)
    page = report(ctx, res)
    assert page.count("<section id=") == 2 and page.count('<section id="chunk-size">') == 1
    assert "<td>chunk-128</td>" not in page and "Baseline" in page
    assert [d["study"] for d in study_results(tmp_path)] == ["chunk-size", "baseline"]


def test_the_page_has_each_configurations_ttft_phases(tmp_path: Path) -> None:
    phases = {"all": {"admission": {"median": 1.0, "p99": 2.0},
                      "prefill_queue": {"median": 3.0, "p99": 4.5}}}
    res = StudyResult("pacing", "Pacing", "d", [Column("config", "config")],
                      [{"config": "eager"}],
                      {"eager": {"metrics": {"ttft_phases_ms": phases}},
                       "disagg": {"alone": {"metrics": {"ttft_phases_ms": phases}}}})
    page = report(fake_ctx(tmp_path), res)
    assert "TTFT by phase, p50 / p99 (ms)" in page and "<th>prefill_queue</th>" in page
    assert "<td>eager</td><td>all</td><td>1.0 / 2.0</td><td>3.0 / 4.5</td>" in page
    assert "<td>disagg alone</td>" in page
    assert "TTFT p50 split" not in page  # (recorded before the split was)
    split = {"all": {"ttft_p50": 4.2, "admission": 1.0, "prefill_queue": 3.0}}
    res.configs["eager"]["metrics"]["ttft_p50_phases_ms"] = split
    page = report(fake_ctx(tmp_path), res)
    assert "<td>eager</td><td>all</td><td>1.0</td><td>3.0</td><td>4.0</td><td>4.2</td>" in page


def test_a_missing_plot_is_named_not_fatal(tmp_path: Path) -> None:
    res = StudyResult("pacing", "Pacing", "d", [Column("config", "config")],
                      [{"config": "eager"}], plots=["gone.png"])
    page = report(fake_ctx(tmp_path), res)
    assert "plot gone.png is missing" in page


def test_the_chunk_size_findings_read_the_kernel_time_and_the_scheduling_gap() -> None:
    dev = {64: (4.0, 1.2, 0.30, 0.30, 4.0, 0.2, 0.05, 0.3),
           512: (8.0, 0.4, 0.05, 0.50, 4.0, 0.2, 0.05, 0.4)}
    rows = [{"config": f"chunk-{c}", "chunk": c, "prefill_kernel_ms": pk, "prefill_gap_ms": pg,
             "prefill_lag_share": pl, "prefill_busy_ratio": pb, "decode_kernel_ms": dk,
             "decode_gap_ms": dg, "decode_lag_share": dl, "decode_busy_ratio": db}
            for c, (pk, pg, pl, pb, dk, dg, dl, db) in dev.items()]
    out = chunk_size.findings(StudyResult("chunk-size", "C", "d", chunk_size.COLUMNS, rows))
    assert out == [
        "A prefill step's kernel took 4.00 ms at chunk 64 and 8.00 ms at chunk 512 (2.0x for "
        "8x the tokens); the scheduling gap was 1.20 and 0.40 ms per step.",
        "The host set the prefill pace at chunk 64: the device waited for it 30% of its busy "
        "time at chunk 64.",
        "The decode device, not the host, set the pace at every chunk (host lag at most 5% of "
        "its busy time; busy 30-40% of the run).",
    ]
