"""Sweep figures (bench/plots.py): files are written as PNGs."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.plots import plot_chunk_size_study, plot_grouped_bars, plot_metric_vs_knob

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def is_png(path: Path) -> bool:
    data = path.read_bytes()
    return data[:8] == PNG_MAGIC and len(data) > 2000


def test_metric_vs_knob(tmp_path: Path) -> None:
    series = {
        "fcfs": {256: 120.0, 512: 90.0, 1024: 95.0, 2048: 180.0},
        "srpt": [(256, 100.0), (512, 80.0), (1024, None), (2048, 150.0)],
    }
    out = plot_metric_vs_knob(
        series, tmp_path / "a" / "ttft.png", xlabel="chunk size (tokens)",
        ylabel="TTFT p99 (ms)", logx=True, hline=100.0,
    )  # fmt: skip
    assert out == tmp_path / "a" / "ttft.png" and is_png(out)
    with pytest.raises(ValueError, match="series"):
        plot_metric_vs_knob({}, tmp_path / "x.png", xlabel="x", ylabel="y")


def test_grouped_bars(tmp_path: Path) -> None:
    data = {
        "fcfs": {"TTFT p99 (ms)": 300.0, "ITL p99 (ms)": 40.0, "goodput (req/s)": 3.1},
        "fair": {"TTFT p99 (ms)": 180.0, "ITL p99 (ms)": 45.0},
    }
    out = plot_grouped_bars(data, tmp_path / "bars.png", ylabel="value", title="policies")
    assert is_png(out)


def test_chunk_size_study(tmp_path: Path) -> None:
    rows = {
        c: {"ttft_p99_ms": 1000 / c * 50, "itl_p99_ms": c / 20, "goodput_rps": 2.0 + c / 1000,
            "prefill_step_ms": c / 40}
        for c in (128, 256, 512, 1024)
    }  # fmt: skip
    results = {"colocated": rows, "disaggregated": {c: {"ttft_p99_ms": 40.0} for c in rows}}
    out = plot_chunk_size_study(results, tmp_path / "chunks.png", slo_ttft_ms=300.0)
    assert is_png(out)
    tpot_only = {"p/d": {256: {"tpot_p99_ms": 12.0}, 512: {"tpot_p99_ms": 20.0}}}
    assert is_png(plot_chunk_size_study(tpot_only, tmp_path / "tpot.png", slo_itl_ms=15.0))


def test_chunk_size_study_draws_kernel_time_and_gap_on_an_emulated_device(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import bench.plots as plots

    rows = {c: {"ttft_p99_ms": 100.0, "itl_p99_ms": 20.0, "goodput_rps": 10.0,
                "prefill_step_ms": c / 20, **{k: c / 100 + i for i, (k, _) in
                                              enumerate(plots.STEP_PARTS)}} for c in (64, 256)}
    drawn: list = []
    real = plots._draw_step_parts

    def spy(ax, results, logx):
        drawn.append(results)
        real(ax, results, logx)

    monkeypatch.setattr(plots, "_draw_step_parts", spy)
    assert is_png(plot_chunk_size_study({"p/d": rows}, tmp_path / "dev.png"))
    assert is_png(plot_chunk_size_study({"p/d": {64: {"prefill_step_ms": 1.0}}},
                                        tmp_path / "cpu.png"))
    assert len(drawn) == 1 and drawn[0]["p/d"] is rows  # the emulated rows only
