"""A stand-in plan for tools/gpu_check (`--plan-module tests.gpu_check_fakes`): steps that
pass, fail, raise, hang with a grandchild, leave a process group of their own behind, and
one that reads the JSON the check has written so far (tests/unit/test_gpu_path_check_plan.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tools.gpu_check_plan import Ctx, Step

OUT_ENV = "GPU_CHECK_FAKE_OUT"  # the check's JSON path, for `reader`


def quick(ctx: Ctx) -> dict:
    return {"value": 42, "limit_seen": ctx.timeout_s}


def boom(ctx: Ctx) -> dict:
    raise ValueError("bad kernel")


def checks(ctx: Ctx) -> dict:
    return {"rel_l2": 0.5, "failed_checks": ["rel L2 0.5 above 8e-3"]}


def _sleeper(*, own_session: bool) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                            start_new_session=own_session)


def hang(ctx: Ctx) -> dict:
    """A grandchild in the step's group, then never returns."""
    child = _sleeper(own_session=False)
    (Path(ctx.work_dir) / "hang.pid").write_text(str(child.pid))
    print("hang: started its grandchild, now waiting forever", flush=True)
    while True:
        time.sleep(1)


def own_session(ctx: Ctx) -> dict:
    """Leaves a process in a session of its own, recorded for the check to end."""
    from tools.gpu_check_steps import record_pgid

    child = _sleeper(own_session=True)
    record_pgid(ctx, child.pid)
    (Path(ctx.work_dir) / "own.pid").write_text(str(child.pid))
    return {"left": child.pid}


def reader(ctx: Ctx) -> dict:
    doc = json.loads(Path(os.environ[OUT_ENV]).read_text())
    return {"saw": {k: v["status"] for k, v in doc["steps"].items()}}


_T = "tests.gpu_check_fakes:"
PLAN = (
    Step("quick", _T + "quick", 30, 1, False, False, "passes"),
    Step("boom", _T + "boom", 30, 1, False, False, "raises"),
    Step("checks", _T + "checks", 30, 1, False, False, "a failed check"),
    Step("hang", _T + "hang", 8, 1, False, False, "hangs, with a grandchild"),
    Step("own_session", _T + "own_session", 30, 1, False, False, "leaves a group behind"),
    Step("gpu_only", _T + "quick", 30, 1, True, False, "needs CUDA"),
    Step("reader", _T + "reader", 30, 1, False, False, "reads the JSON so far"),
    Step("late", _T + "quick", 30, 1000, False, False, "never fits"),
)
CORE = 3
