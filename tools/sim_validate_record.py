"""Recorded validation rows: every real run of a row kept, so the fits and simulations of
tools/sim_validate.py can be replayed offline on the very same runs.

A validation takes ~22 min here and its real side moves with the host, so two variants of
the model compared on two validations differ by the host as much as by the model. With
``--record FILE`` each row's real runs (records, traces, worker stats) are pickled as the
row ends; ``--replay FILE`` runs ``validate_row`` on them instead of a service: the same
runs in the same order, fitted and simulated by the code of the moment, in ~30 s a row.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

FORMAT = 1
SHAPE = ("num_requests", "contention_requests", "fit_runs", "repeats", "seed")


class Recorder:
    """A service whose runs are kept in the order they ran."""

    def __init__(self, svc: Any):
        self.svc, self.runs = svc, []

    def run_workload(self, work, transport: str = "inproc"):
        out = self.svc.run_workload(work, transport=transport)
        self.runs.append(out)
        return out


class Replayer:
    """Stands for the service of a recorded row: each call answers the next recorded run,
    which must be a run of the workload asked for."""

    def __init__(self, runs: list, row: str):
        self.runs, self.row = list(runs), row

    def run_workload(self, work, transport: str = "inproc"):
        if not self.runs:
            raise ValueError(f"the recording of {self.row} has no run left: it was recorded "
                             "with other --fit-runs / --repeats")
        out = self.runs.pop(0)
        if len(out.records) != len(work):
            raise ValueError(f"the recording of {self.row} has a run of {len(out.records)} "
                             f"requests where this replay sends {len(work)}: it was recorded "
                             "with other --num-requests / --contention-requests")
        return out


def row_key(config: str, load: str) -> str:
    return f"{config}|{load}"


def save(path: str | Path, args, calibration: str, rows: dict[str, list]) -> None:
    """Write the rows recorded so far (after each row: a stopped validation keeps them)."""
    data = {"format": FORMAT, "calibration": calibration,
            "shape": {k: getattr(args, k) for k in SHAPE}, "rows": rows}
    tmp = Path(f"{path}.tmp")
    tmp.write_bytes(pickle.dumps(data))
    tmp.replace(path)


def load(path: str | Path, args) -> dict:
    """A recording, checked against this replay's workload flags."""
    data = pickle.loads(Path(path).read_bytes())
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a sim_validate recording of format {FORMAT}")
    moved = {k: (v, getattr(args, k)) for k, v in data["shape"].items()
             if getattr(args, k) != v}
    if moved:
        raise ValueError(f"{path} was recorded with other workload flags (recorded, now): "
                         + ", ".join(f"--{k.replace('_', '-')} {a} != {b}"
                                     for k, (a, b) in moved.items()))
    return data
