"""Recorded validation rows (tools/sim_validate.py): the real runs kept in order and
answered back in order to a replay, which must ask for the same workloads."""

from __future__ import annotations

from argparse import Namespace
from types import SimpleNamespace

import pytest

from tools import sim_validate as record

ARGS = Namespace(num_requests=2, contention_requests=None, fit_runs=1, repeats=1, seed=0)


def _run(n: int):
    return SimpleNamespace(records=[object()] * n, tag=f"run of {n}")


def test_a_recording_answers_its_runs_back_in_order_for_the_same_workloads(tmp_path) -> None:
    svc = SimpleNamespace(run_workload=lambda work, transport: _run(len(work)))
    rec = record.Recorder(svc)
    for work in (["a"] * 4, ["b"] * 2, ["c"] * 2):
        rec.run_workload(work)
    assert [len(r.records) for r in rec.runs] == [4, 2, 2]
    path = tmp_path / "rec.pkl"
    record.save(path, ARGS, "cal.json", {record.row_key("1P1D", "low"): rec.runs})
    data = record.load(path, ARGS)
    assert data["calibration"] == "cal.json"
    replay = record.Replayer(data["rows"]["1P1D|low"], "1P1D|low")
    assert replay.run_workload(["x"] * 4).tag == "run of 4"
    with pytest.raises(ValueError, match="run of 2 requests where this replay sends 3"):
        replay.run_workload(["x"] * 3)
    replay.run_workload(["x"] * 2)
    with pytest.raises(ValueError, match="no run left"):
        replay.run_workload(["x"] * 2)


def test_a_replay_with_other_workload_flags_is_refused_by_name(tmp_path) -> None:
    path = tmp_path / "rec.pkl"
    record.save(path, ARGS, "cal.json", {})
    with pytest.raises(ValueError, match="--fit-runs 1 != 3"):
        record.load(path, Namespace(**{**vars(ARGS), "fit_runs": 3}))
    path.write_bytes(b"\x80\x04K\x01.")  # a pickle, not a recording
    with pytest.raises(ValueError, match="not a sim_validate recording"):
        record.load(path, ARGS)
