"""`pdserve study ... --simulate` (sim/study.py): a study's own configurations, workload
and table, with each configuration run in the simulator at the pools and load asked for,
labelled with its cost model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.studies.context import StudyOptions
from bench.study import run_study
from cluster.cli import main as pdserve
from sim.study import SimStudy, SimStudyContext


def test_a_study_runs_its_sweep_in_the_simulator_at_cluster_scale(tmp_path: Path) -> None:
    opts = StudyOptions(out=tmp_path, quick=True, trace=False, progress=False)
    ctx = SimStudyContext(opts, SimStudy(analytic="h200", prefill_workers=3, decode_workers=5,
                                         load_scale=3.0))
    base = ctx.base_config()
    assert (base.pools.prefill_workers, base.pools.decode_workers) == (3, 5)
    assert ctx.n_requests(12, 48) == 36  # the study's count times the load scale
    lines: list[str] = []
    result = run_study("pacing", ctx, echo=lines.append)
    data = json.loads((tmp_path / "pacing.json").read_text())
    assert [r["config"] for r in result.rows] == ["eager", "at_end"]
    assert all(r["completed"] == 36 and r["failed"] == 0 for r in data["rows"])
    # the same emulated link under both policies; at_end holds the KV to the last chunk,
    # so the decode of a long prompt starts later
    assert {r["send_policy"] for r in data["rows"]} == {"eager", "at_end"}
    eager, at_end = result.rows
    assert at_end["first_itl_p99_ms"] > eager["first_itl_p99_ms"]
    assert "analytic, not measured" in result.notes[0]
    assert "analytic, not measured" in (tmp_path / "pacing.md").read_text()
    assert ctx.launches == 0 and ctx.simulations == 2


def test_simulate_flags_are_checked_before_anything_runs(tmp_path: Path, capsys) -> None:
    rc = pdserve(["study", "chunk-size", "--analytic", "h200", "--out", str(tmp_path)])
    assert rc == 2 and "--simulate" in capsys.readouterr().err
    rc = pdserve(["study", "chunk-size", "--simulate", "--out", str(tmp_path)])
    assert rc == 2 and "--calibration FILE or --analytic PROFILE" in capsys.readouterr().err
    with pytest.raises(ValueError, match="load-scale"):
        SimStudy(analytic="h200", load_scale=0.0)
