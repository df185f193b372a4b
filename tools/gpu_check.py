"""The GPU check in one command, sized for a GPU lease (tools/gpu_check_plan.py):

    python -m tools.gpu_check --out $OUT/gpu.json [--model qwen2-0.5b-shape|small|tiny|DIR]
    python -m tools.gpu_check --dry-run     # the plan: steps, limits, total, what it carries

Runs the plan's steps in order, most valuable first, each in its own process group
(`start_new_session`) under its own time limit: over it, the whole group is killed
(test workers and TP ranks too) and the step's output is kept. The run ends within the
budget (`--budget-s`, 450 s): a step starts only with at least its `min_s` left, and then
with its limit cut to what is left; the core steps' limits fit the budget whole. The JSON
is rewritten as each step starts and ends, so a cut-off run still leaves every finished
step's result; each step prints one line: passed, failed with its error, timed out, or
skipped (for the budget, without CUDA, or without the model). A step's output goes to the
log beside the JSON.

`--model`: a tiny_model preset (written once to a temporary directory by the `model`
step; the default is the Qwen2-0.5B shape with random weights) or an HF model directory.
Without CUDA it says so, skips the GPU-only steps, runs the CPU-safe ones on the CPU with
the tiny model and exits 0 (unless one fails).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):  # `python tools/gpu_check.py` from anywhere
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools import gpu_check_plan  # noqa: E402 - (torch-free: the dry run needs no torch)
from tools.gpu_check_plan import BUDGET_S, END_RESERVE_S, Step  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ("tiny", "small", "qwen2-0.5b-shape")
NO_CUDA = ("no CUDA device: the GPU steps are skipped; the CPU-safe parts ran on the CPU "
           "with the tiny model")
TREE_LIMIT = 64 << 20  # what travels to a lent machine
TAIL_CHARS = 3000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", help="JSON result path (a .log is written beside)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (steps, limits, total, what it carries) and exit")
    p.add_argument("--model", default="qwen2-0.5b-shape",
                   help=f"a tiny_model preset {PRESETS} or an HF model directory")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--steps", help="comma-separated subset of the plan's steps (its order)")
    p.add_argument("--budget-s", type=float, default=BUDGET_S,
                   help="the whole run's wall-clock budget; steps that do not fit are skipped")
    p.add_argument("--limit-scale", type=float, default=1.0,
                   help="multiply the budget and every step's limits (a loaded machine)")
    p.add_argument("--quick", action="store_true", help="smaller workloads")
    p.add_argument("--plan-module", default="tools.gpu_check_plan",
                   help=argparse.SUPPRESS)  # tests: a module with PLAN and CORE
    p.add_argument("--step", help=argparse.SUPPRESS)  # internal: run one step, write --part
    p.add_argument("--part", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--device", help=argparse.SUPPRESS)
    p.add_argument("--work-dir", default="", help=argparse.SUPPRESS)
    p.add_argument("--timeout-s", type=float, default=60.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    plan, _ = load_plan(args.plan_module)
    names = [s.name for s in plan]
    unknown = [s for s in (args.steps or "").split(",") if s and s not in names]
    if unknown:
        p.error(f"unknown steps {unknown}; choose from {names}")
    if not args.dry_run and not args.step and not args.out:
        p.error("--out is required (or --dry-run)")
    return args


def load_plan(module: str) -> tuple[tuple[Step, ...], int]:
    m = gpu_check_plan if module == "tools.gpu_check_plan" else importlib.import_module(module)
    return tuple(m.PLAN), int(m.CORE)


# ---------------------------------------------------------------------------- budget
def decide(step: Step, left_s: float, *, cuda: bool, model_ok: bool, scale: float = 1.0
           ) -> tuple[str, float, str]:
    """What to do with `step` with `left_s` of the budget left: ("run", limit, "") or
    ("skipped", 0, why)."""
    if step.needs_cuda and not cuda:
        return "skipped", 0.0, "no CUDA device"
    if step.needs_model and not model_ok:
        return "skipped", 0.0, "no model (the model step did not pass)"
    if left_s < step.min_s * scale:
        return ("skipped", 0.0, f"for budget: needs at least {step.min_s * scale:.0f} s, "
                f"{max(0.0, left_s):.0f} s left")
    return "run", min(step.limit_s * scale, left_s), ""


def plan_lines(plan: tuple[Step, ...], core: int, budget_s: float, scale: float = 1.0
               ) -> list[str]:
    """The plan as the dry run prints it."""
    budget = budget_s * scale
    lines = [f"gpu_check plan: {len(plan)} steps in order, budget {budget:.0f} s "
             f"({budget / 60:.1f} min) for the whole run",
             f"  {'#':>2}  {'step':<16}{'limit':>7}{'min':>6}{'worst end':>11}  "
             f"{'needs':<10}what"]
    end = 0.0
    for i, s in enumerate(plan):
        if i == core:
            lines.append("  -- extras: each runs only with at least its min left --")
        end += s.limit_s * scale
        needs = "+".join(n for n, f in (("gpu", s.needs_cuda), ("model", s.needs_model))
                         if f) or "-"
        worst = f"{end:>10.0f}s" if i < core else f"{'if time':>11}"
        lines.append(f"  {i + 1:>2}  {s.name:<16}{s.limit_s * scale:>6.0f}s"
                     f"{s.min_s * scale:>5.0f}s{worst}  {needs:<10}{s.what}")
    core_sum = sum(s.limit_s for s in plan[:core]) * scale
    extra_sum = sum(s.limit_s for s in plan[core:]) * scale
    fits = core_sum <= budget - END_RESERVE_S
    lines += [
        f"  core: {core} steps, limits {core_sum:.0f} s "
        f"{'<=' if fits else '>'} {budget - END_RESERVE_S:.0f} s (budget less {END_RESERVE_S:.0f} s"
        f" kept for the last write): {'each gets its full limit' if fits else 'DOES NOT FIT'}",
        f"  extras: {len(plan) - core} steps, limits {extra_sum:.0f} s, on the time the core "
        "leaves; the run never passes the budget",
        f"  ends within {budget:.0f} s of its start; with the machine's start-up, run it as "
        f"one command: timeout_s={int(budget + 90)}",
    ]
    return lines


def carry_lines() -> list[str]:
    """What travels to the lent machine: the working tree (and carried wheels: none)."""
    size, files = tree_bytes()
    tree = (f"{size / 2**20:.1f} MiB in {files} files of the {TREE_LIMIT >> 20} MiB allowed"
            if size is not None else "size unknown (no git here)")
    wheels = ", ".join(gpu_check_plan.CARRIED_WHEELS) or "no wheels"
    return [f"  carries: the working tree ({tree}); {wheels}: the image has every module "
            "the steps import (the env step checks them)",
            "  not needed there: " + "; ".join(gpu_check_plan.NOT_NEEDED),
            "  returns: $OUT/gpu.json (rewritten as each step starts and ends) and $OUT/gpu.log"]


def tree_bytes() -> tuple[int | None, int]:
    """Bytes and count of the files git would send (tracked, and untracked not ignored)."""
    try:
        r = subprocess.run(["git", "ls-files", "-z", "-c", "-o", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None, 0
    names = {n for n in r.stdout.decode(errors="replace").split("\0") if n}
    total = 0
    for n in names:
        try:
            total += (ROOT / n).stat().st_size
        except OSError:
            pass
    return total, len(names)


# ---------------------------------------------------------------------------- a step
def resolve(fn: str):
    mod, _, name = fn.partition(":")
    return getattr(importlib.import_module(mod), name)


def write_model(name: str) -> str:
    """An HF model directory for preset or directory `name` (presets are written once)."""
    if name not in PRESETS:
        if not (Path(name) / "config.json").exists():
            raise SystemExit(f"gpu_check: --model {name!r} is neither a preset {PRESETS} "
                             "nor a model directory with a config.json")
        return name
    d = preset_dir(name)
    if not (d / "model.safetensors").exists():
        from engine.tiny_model import make_model

        make_model(d, name, "qwen2" if name.startswith("qwen2") else "llama")
    return str(d)


def preset_dir(name: str) -> Path:
    arch = "qwen2" if name.startswith("qwen2") else "llama"
    return Path(tempfile.gettempdir()) / "pdserve-gpu-check" / f"{name}-{arch}"


def prepare_model(name: str, cuda: bool) -> str:
    """Where the steps find the model (`write_model` writes it, in the model step)."""
    if not cuda:
        name = "tiny"  # the CPU-safe parts stay quick
    if name in PRESETS:
        return name  # the model step writes it; steps get preset_dir(name)
    if not (Path(name) / "config.json").exists():
        raise SystemExit(f"gpu_check: --model {name!r} is neither a preset {PRESETS} "
                         "nor a model directory with a config.json")
    return name


def run_step(args: argparse.Namespace) -> int:
    """In the child: run one step, write its result (or its error) to --part."""
    from tools.gpu_check_plan import Ctx

    plan, _ = load_plan(args.plan_module)
    step = next(s for s in plan if s.name == args.step)
    model_dir = args.model_dir
    if step.needs_model and model_dir in PRESETS:
        model_dir = str(preset_dir(model_dir))
    ctx = Ctx(model_dir, args.device, args.dtype if args.device != "cpu" else "float32",
              args.quick, args.timeout_s, args.work_dir)
    try:
        result = resolve(step.fn)(ctx)
    except BaseException as e:  # noqa: BLE001 - the parent reports it as the step's error
        Path(args.part).write_text(json.dumps(
            {"error": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()}))
        traceback.print_exc()
        return 1
    Path(args.part).write_text(json.dumps(result, indent=1, default=str))
    return 0


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def end_group(proc: subprocess.Popen, grace_s: float = 5.0) -> bool:
    """End the process group `proc` leads (it was started with `start_new_session`):
    SIGTERM, up to `grace_s` for it to go, SIGKILL to what is left; reaps `proc`. True if
    any process of the group was still there."""
    proc.poll()
    if proc.returncode is not None and not _group_alive(proc.pid):
        return False
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        proc.wait()
        return False
    end = time.monotonic() + grace_s
    while time.monotonic() < end:
        proc.poll()  # reaps the leader once it exits: then the group is its descendants
        if proc.returncode is not None and not _group_alive(proc.pid):
            break
        time.sleep(0.05)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    return True


def kill_group(pgid: int, grace_s: float = 5.0) -> None:
    """End a process group this process does not lead the parent of (a step's own)."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    end = time.monotonic() + grace_s
    while time.monotonic() < end and _group_alive(pgid):
        time.sleep(0.05)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_child(args: argparse.Namespace, step: Step, limit: float, model_dir: str,
              device: str, work: Path, logf) -> dict:
    """Run `step` in its own session under `limit`; returns its JSON entry."""
    part = work / f"{step.name}.json"
    out = work / f"{step.name}.out"
    cmd = [sys.executable, "-m", "tools.gpu_check", "--step", step.name, "--part", str(part),
           "--model-dir", model_dir, "--device", device, "--dtype", args.dtype,
           "--timeout-s", str(limit), "--work-dir", str(work),
           "--plan-module", args.plan_module] + (["--quick"] if args.quick else [])
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.monotonic()
    with out.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            rc = None
        stragglers = end_group(proc)  # its whole group, on a timeout or not
        for line in (work / "pgids").read_text().split() if (work / "pgids").exists() else []:
            kill_group(int(line))  # groups the step started in sessions of their own
        (work / "pgids").unlink(missing_ok=True)
    wall = round(time.monotonic() - t0, 1)
    text = out.read_text(errors="replace")
    logf.write(f"\n===== {step.name} (limit {limit:.0f} s, {wall} s)\n{text}")
    logf.flush()
    entry: dict = {"wall_s": wall, "limit_s": round(limit, 1)}
    result = json.loads(part.read_text()) if part.exists() else None
    if rc is None:
        entry.update(status="timeout", error=f"over its {limit:.0f} s limit: process group "
                     "killed", tail=text[-TAIL_CHARS:])
        if result is not None:
            entry["result"] = result
    elif result is not None and "error" in result and rc != 0:
        entry.update(status="failed", error=result["error"], tail=text[-TAIL_CHARS:])
    elif rc != 0 or result is None:
        entry.update(status="failed", error=f"exit code {rc}, no result",
                     tail=text[-TAIL_CHARS:])
    elif result.get("failed_checks"):
        entry.update(status="failed", error="; ".join(map(str, result["failed_checks"])),
                     result=result)
    else:
        entry.update(status="passed", result=result)
    if stragglers and rc is not None:
        entry["note"] = "processes of its group outlived it: killed"
    return entry


def line(i: int, n: int, name: str, entry: dict) -> str:
    """The one line a step prints."""
    head = f"gpu_check: [{i}/{n}] {name}:"
    st = entry["status"]
    if st == "passed":
        return f"{head} passed ({entry['wall_s']} s of {entry['limit_s']:.0f} s)"
    if st == "failed":
        return f"{head} FAILED ({entry['wall_s']} s): {entry['error'][:300]}"
    if st == "timeout":
        return f"{head} TIMED OUT at its {entry['limit_s']:.0f} s limit (process group killed)"
    return f"{head} skipped {entry['reason']}" if entry["reason"].startswith("for budget") \
        else f"{head} skipped: {entry['reason']}"


# ---------------------------------------------------------------------------- the run
def _cuda(env_entry: dict) -> bool:
    result = env_entry.get("result") or {}
    if "cuda_available" in result:
        return bool(result["cuda_available"])
    import torch  # the env step failed: ask here

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.step:
        return run_step(args)
    plan, core = load_plan(args.plan_module)
    if args.dry_run:
        print("\n".join(plan_lines(plan, core, args.budget_s, args.limit_scale)
                        + carry_lines()))
        return 0
    wanted = set(args.steps.split(",")) if args.steps else None
    steps = [s for s in plan if wanted is None or s.name in wanted]
    t_start = time.monotonic()
    deadline = t_start + args.budget_s * args.limit_scale
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    doc: dict = {"model": args.model, "dtype": args.dtype, "budget_s": args.budget_s,
                 "limit_scale": args.limit_scale,
                 "plan": [s.name for s in steps], "work_dir": str(work), "steps": {}}
    cuda, device, model_dir, model_ok = False, "cpu", args.model, True
    names = {s.name for s in steps}
    if "env" not in names:  # a subset: ask here what env would have told
        cuda = _cuda({})
        device = "cuda:0" if cuda else "cpu"
        model_dir = prepare_model(args.model, cuda)
        doc.update(cuda=cuda, device=device, model_dir=model_dir)
    # a subset without the model step whose steps need the model: written here (unlimited)
    write_here = "model" not in names and any(s.needs_model for s in steps)
    if write_here and "env" not in names:
        write_model(model_dir)

    def save() -> None:
        doc["wall_s"] = round(time.monotonic() - t_start, 1)
        tmp = out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(doc, indent=1, default=str))
        tmp.replace(out)  # never a half-written document

    counts = {"passed": 0, "failed": 0, "timeout": 0, "skipped": 0, "budget": 0}
    with out.with_suffix(".log").open("w") as logf:
        for i, step in enumerate(steps, start=1):
            left = deadline - END_RESERVE_S - time.monotonic()
            action, limit, why = decide(step, left, cuda=cuda, model_ok=model_ok,
                                        scale=args.limit_scale)
            if action == "run":
                doc["steps"][step.name] = {"status": "running", "limit_s": round(limit, 1)}
                save()
                entry = run_child(args, step, limit, model_dir, device, work, logf)
            else:
                entry = {"status": "skipped", "reason": why}
                counts["budget"] += why.startswith("for budget")
            doc["steps"][step.name] = entry
            if step.name == "env":
                cuda = _cuda(entry)
                device = "cuda:0" if cuda else "cpu"
                doc.update(cuda=cuda, device=device)
                if not cuda:
                    doc["skipped_reason"] = NO_CUDA
                    print(f"gpu_check: {NO_CUDA}", file=sys.stderr)
                model_dir = prepare_model(args.model, cuda)
                doc["model_dir"] = model_dir
                if write_here:
                    write_model(model_dir)
            if step.name == "model":
                model_ok = entry["status"] == "passed"
                if model_ok:
                    doc["model_dir"] = entry["result"]["model_dir"]
            counts[entry["status"]] += 1
            save()
            print(line(i, len(steps), step.name, entry), file=sys.stderr, flush=True)
    summary = (f"{counts['passed']} passed, {counts['failed']} failed, {counts['timeout']} "
               f"timed out, {counts['skipped']} skipped ({counts['budget']} for budget) in "
               f"{time.monotonic() - t_start:.0f} s of {args.budget_s * args.limit_scale:.0f}")
    doc["summary"] = summary
    save()
    print(f"gpu_check: {summary}; wrote {out}")
    return 1 if counts["failed"] or counts["timeout"] else 0


if __name__ == "__main__":
    sys.exit(main())
