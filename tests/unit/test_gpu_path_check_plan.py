"""Issue 37, item 9: the one-command GPU check fits its lease. Its plan (tools/
gpu_check_plan.py) puts the most valuable steps first and its core's limits inside the
budget, under 8 minutes; `--dry-run` prints it without a GPU (and without torch); and
the run keeps to the budget rules: a step that does not fit is skipped for the budget, a
step over its limit has its whole process group killed and its output kept, a step that
raises fails with its error, each result is in the JSON as soon as its step ends, and
each step prints one line. The runs use a stand-in plan (tests/gpu_check_fakes.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools import gpu_check
from tools.gpu_check_plan import BUDGET_S, CORE, END_RESERVE_S, PLAN, Step

ROOT = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_the_plan_fits_the_lease_most_valuable_first():
    names = [s.name for s in PLAN]
    assert len(set(names)) == len(names)
    assert names[:CORE] == ["env", "model", "kernels_bf16", "engine_compiled", "overlap"]
    assert sum(s.limit_s for s in PLAN[:CORE]) <= BUDGET_S - END_RESERVE_S
    assert BUDGET_S + 30 <= 8 * 60  # the whole run, with room for the parent's start
    assert all(0 < s.min_s <= s.limit_s <= 600 for s in PLAN)
    for s in PLAN:  # every step's function exists
        assert callable(gpu_check.resolve(s.fn)), s.fn


def test_decide_runs_what_fits_and_says_why_it_skips():
    step = Step("x", "m:f", limit_s=60, min_s=20, needs_cuda=True, needs_model=True, what="")
    kw = dict(cuda=True, model_ok=True)
    assert gpu_check.decide(step, 300, **kw) == ("run", 60, "")
    assert gpu_check.decide(step, 45, **kw) == ("run", 45, "")  # cut to what is left
    assert gpu_check.decide(step, 19, **kw) == (
        "skipped", 0.0, "for budget: needs at least 20 s, 19 s left")
    assert gpu_check.decide(step, 300, cuda=False, model_ok=True)[2] == "no CUDA device"
    assert "model step" in gpu_check.decide(step, 300, cuda=True, model_ok=False)[2]
    assert gpu_check.decide(step, 100, scale=2.0, **kw) == ("run", 100, "")  # 2 x 60 > 100
    assert gpu_check.decide(step, 39, scale=2.0, **kw)[0] == "skipped"


def test_the_dry_run_prints_the_plan_without_torch_or_a_gpu():
    code = ("import sys\nfrom tools.gpu_check import main\nrc = main(['--dry-run'])\n"
            "assert 'torch' not in sys.modules, 'torch loaded'\nsys.exit(rc)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    for s in PLAN:
        assert f" {s.name} " in out and f"{s.limit_s:.0f}s" in out
    core = sum(s.limit_s for s in PLAN[:CORE])
    assert f"core: {CORE} steps, limits {core:.0f} s <= {BUDGET_S - END_RESERVE_S:.0f} s" in out
    assert "each gets its full limit" in out and "DOES NOT FIT" not in out
    assert f"budget {BUDGET_S:.0f} s" in out and "timeout_s=" in out
    assert "carries: the working tree (" in out and "MiB" in out and "no wheels" in out
    assert "ray" in out  # what is not there and not needed


def test_a_plan_that_does_not_fit_says_so():
    big = tuple(Step(f"s{i}", "m:f", 200, 10, False, False, "") for i in range(3))
    lines = "\n".join(gpu_check.plan_lines(big, 3, 450))
    assert "limits 600 s > 445 s" in lines and "DOES NOT FIT" in lines


@pytest.fixture(scope="module")
def fake_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("check") / "gpu.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GPU_CHECK_FAKE_OUT": str(out)}
    r = subprocess.run([sys.executable, "-m", "tools.gpu_check", "--out", str(out),
                        "--plan-module", "tests.gpu_check_fakes", "--budget-s", "120"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return r, json.loads(out.read_text()), out


def test_a_run_keeps_to_its_budget_and_reports_every_step(fake_run):
    r, doc, out = fake_run
    assert r.returncode == 1  # a step failed
    steps = doc["steps"]
    assert steps["quick"]["status"] == "passed" and steps["quick"]["result"]["value"] == 42
    assert steps["boom"]["status"] == "failed"
    assert steps["boom"]["error"] == "ValueError: bad kernel"
    assert "Traceback" in steps["boom"]["tail"]
    assert steps["checks"]["status"] == "failed"
    assert steps["checks"]["error"] == "rel L2 0.5 above 8e-3"
    hang = steps["hang"]
    assert hang["status"] == "timeout" and hang["limit_s"] == 8
    assert "process group killed" in hang["error"]
    assert "started its grandchild" in hang["tail"]  # its output, kept
    assert steps["gpu_only"] == {"status": "skipped", "reason": "no CUDA device"}
    assert steps["late"]["status"] == "skipped"
    assert steps["late"]["reason"].startswith("for budget: needs at least 1000 s")
    # the JSON held every earlier step's result when `reader` ran
    assert steps["reader"]["result"]["saw"] == {
        "quick": "passed", "boom": "failed", "checks": "failed", "hang": "timeout",
        "own_session": "passed", "gpu_only": "skipped", "reader": "running"}
    err = r.stderr
    for want in ("[1/8] quick: passed (", "[2/8] boom: FAILED (", "ValueError: bad kernel",
                 "[4/8] hang: TIMED OUT at its 8 s limit (process group killed)",
                 "[6/8] gpu_only: skipped: no CUDA device",
                 "[8/8] late: skipped for budget: needs at least 1000 s"):
        assert want in err, (want, err[-3000:])
    assert "3 passed, 2 failed, 1 timed out, 2 skipped (1 for budget)" in r.stdout
    assert doc["summary"].startswith("3 passed, 2 failed, 1 timed out, 2 skipped")
    assert doc["wall_s"] < 120
    log = out.with_suffix(".log").read_text()
    assert "===== hang (limit 8 s" in log and "bad kernel" in log


def test_no_process_of_a_step_outlives_it(fake_run):
    _, doc, _ = fake_run
    work = Path(doc["work_dir"])
    hang_pid, own_pid = (int((work / f).read_text()) for f in ("hang.pid", "own.pid"))
    assert not _alive(hang_pid)  # the grandchild of the step that timed out
    assert not _alive(own_pid)  # the group a step left in a session of its own


def test_a_pytest_step_over_its_deadline_keeps_pytests_output(tmp_path, monkeypatch):
    """The pytest step ends pytest (its whole process group) before the step's own limit
    and returns what pytest printed, with the counts so far."""
    from tools import gpu_check_steps as steps
    from tools.gpu_check_plan import Ctx

    tests = tmp_path / "test_slow.py"
    tests.write_text("import time\n\ndef test_quick():\n    pass\n\n"
                     "def test_hangs():\n    time.sleep(600)\n")
    monkeypatch.setattr(steps, "PYTEST_TARGET", str(tests))
    monkeypatch.setattr(steps, "PYTEST_WORKERS", 0)
    work = tmp_path / "work"
    work.mkdir()
    out = steps.step_pytest(Ctx("x", "cpu", "float32", True, timeout_s=25,
                                work_dir=str(work)))
    assert out["timed_out"] and out["returncode"] is None
    assert out["failed_checks"] == ["pytest did not finish in 10 s (killed; output kept)"]
    assert out.get("passed") == 1  # from its progress line
    assert (work / "pgids").read_text().split()  # the group the check would end as well
    pgid = int((work / "pgids").read_text().split()[0])
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)  # and it is gone already


def test_pytests_counts_from_its_summary_or_its_progress():
    from tools.gpu_check_steps import _count_progress

    assert _count_progress("..F.\n== 3 passed, 1 failed, 2 skipped in 4.1s ==") == {
        "passed": 3, "failed": 1, "skipped": 2}
    assert _count_progress("collecting\n..F.s [ 40%]\n..E\n") == {
        "passed": 5, "failed": 1, "error": 1, "skipped": 1}
