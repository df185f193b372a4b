"""The GPU check in one command, for a session with a lent GPU (one H200, < 10 minutes):

    python -m tools.gpu_check --out $OUT/gpu.json [--model qwen2-0.5b-shape|small|tiny|DIR]

Writes one JSON document (rewritten after every step, so a cut-off run still leaves the
steps done) and a log beside it. Steps, each in its own process with a time limit inside
a total budget (tools/gpu_check_steps.py): env, pytest (tests/gpu), kernels_bf16,
kv_export, engine (tok/s), compiled_decode (CUDA-graph vs eager decode step at batch
1..256 against HBM, tools/gpu_decode_step.py), service (1P+1D on one GPU with fractional
GPUs), attention_bw (decode attention vs read and copy bandwidth).

`--model`: a tiny_model preset (written once to a temporary directory; the default is
the Qwen2-0.5B shape with random weights) or an HF model directory (e.g. SmolLM2 once the
real model lands). Without CUDA it says so, marks the GPU-only steps skipped, runs the
CPU-safe parts (env and the placement plan, the KV host path, the engine and the
in-process 1P+1D service on the CPU with the tiny model) and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # `python tools/gpu_check.py` from anywhere
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.gpu_check_steps import ROOT, STEPS, Ctx  # noqa: E402

PRESETS = ("tiny", "small", "qwen2-0.5b-shape")
NO_CUDA = ("no CUDA device: the GPU steps are skipped; the CPU-safe parts ran on the CPU "
           "with the tiny model")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, help="JSON result path (a .log is written beside)")
    p.add_argument("--model", default="qwen2-0.5b-shape",
                   help=f"a tiny_model preset {PRESETS} or an HF model directory")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--steps", default=",".join(STEPS), help="comma-separated subset, in order")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="total wall-clock budget; steps that no longer fit are skipped")
    p.add_argument("--limit-scale", type=float, default=1.0,
                   help="multiply the budget and every step's time limit (a loaded machine)")
    p.add_argument("--quick", action="store_true", help="smaller workloads")
    p.add_argument("--step", help=argparse.SUPPRESS)  # internal: run one step, write --part
    p.add_argument("--part", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--device", help=argparse.SUPPRESS)
    p.add_argument("--timeout-s", type=float, default=60.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = [s for s in args.steps.split(",") if s not in STEPS]
    if unknown:
        p.error(f"unknown steps {unknown}; choose from {list(STEPS)}")
    return args


def prepare_model(name: str, cuda: bool) -> str:
    """An HF model directory for `name` (presets are written once per machine)."""
    if not cuda:
        name = "tiny"  # the CPU-safe parts stay quick
    if name not in PRESETS:
        if not (Path(name) / "config.json").exists():
            raise SystemExit(f"gpu_check: --model {name!r} is neither a preset {PRESETS} "
                             "nor a model directory with a config.json")
        return name
    from engine.tiny_model import make_model

    d = Path(tempfile.gettempdir()) / "pdserve-gpu-check" / f"{name}-llama"
    if not (d / "model.safetensors").exists():
        make_model(d, name, "qwen2" if name.startswith("qwen2") else "llama")
    return str(d)


def run_step(args: argparse.Namespace) -> int:
    ctx = Ctx(args.model_dir, args.device, args.dtype if args.device != "cpu" else "float32",
              args.quick, args.timeout_s)
    result = STEPS[args.step][0](ctx)
    Path(args.part).write_text(json.dumps(result, indent=1, default=str))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.step:
        return run_step(args)
    import torch

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.with_suffix(".log")
    cuda = torch.cuda.is_available()
    device = "cuda:0" if cuda else "cpu"
    if not cuda:
        print(f"gpu_check: {NO_CUDA}", file=sys.stderr)
    t_start = time.monotonic()
    model_dir = prepare_model(args.model, cuda)
    doc: dict = {"cuda": cuda, "device": device, "model": args.model, "model_dir": model_dir,
                 "dtype": args.dtype if cuda else "float32", "steps": {}}
    if not cuda:
        doc["skipped_reason"] = NO_CUDA
    deadline = t_start + args.budget_s * args.limit_scale
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    with log.open("w") as logf:
        for name in args.steps.split(","):
            _, limit, needs_cuda = STEPS[name]
            left = deadline - time.monotonic()
            if needs_cuda and not cuda:
                doc["steps"][name] = {"status": "skipped", "reason": "no CUDA device"}
            elif left < 20:
                doc["steps"][name] = {"status": "skipped", "reason": "out of the time budget"}
            else:
                limit = min(limit * args.limit_scale, left)
                doc["steps"][name] = _run_child(args, name, limit, model_dir, device, env, logf)
            out.write_text(json.dumps(doc, indent=1, default=str))
            print(f"gpu_check: {name}: {doc['steps'][name]['status']}", file=sys.stderr)
    doc["wall_s"] = time.monotonic() - t_start
    out.write_text(json.dumps(doc, indent=1, default=str))
    print(f"gpu_check: wrote {out} ({doc['wall_s']:.0f} s)")
    failed = [n for n, s in doc["steps"].items() if s["status"] in ("failed", "timeout")]
    return 1 if failed else 0


def _run_child(args, name: str, timeout: float, model_dir: str, device: str, env: dict,
               logf) -> dict:
    part = Path(tempfile.mkdtemp()) / f"{name}.json"
    cmd = [sys.executable, "-m", "tools.gpu_check", "--out", args.out, "--step", name,
           "--part", str(part), "--model-dir", model_dir, "--device", device,
           "--dtype", args.dtype, "--timeout-s", str(timeout)] + (["--quick"] if args.quick else [])
    logf.write(f"\n===== {name} (limit {timeout:.0f} s)\n")
    logf.flush()
    t0 = time.monotonic()
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=env, stdout=logf, stderr=subprocess.STDOUT,
                           timeout=timeout)
        status = "ok" if r.returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
        status = "timeout"
    entry: dict = {"status": status, "wall_s": round(time.monotonic() - t0, 1)}
    if part.exists():
        entry["result"] = json.loads(part.read_text())
    elif status != "ok":
        entry["reason"] = f"see {Path(args.out).with_suffix('.log').name}"
    return entry


if __name__ == "__main__":
    sys.exit(main())
