"""A workload whose mix shifts (chat, then long documents, then chat), served by every
static P:D split of N workers and by `--planner` from a deliberately wrong split (issue
43's test): each phase's SLO goodput per configuration, the planner's decisions and its
switches' durations.

    python -m tools.planner_shift --out /tmp/planner_shift [--workers 4] [--phase-s 90]

Every configuration is a real `pdserve serve` (Ray actors, sockets, KV bytes) on the
emulated accelerator of `--emulate` / `--model-shape`; each phase is one `pdserve bench`
run against it, back to back, so the planner sees the mix change. Every figure is the
emulated device's: analytic, not measured (and with `--emulate-kv-fraction` F < 1 only
that share of each chunk's KV bytes moves, the link charged in full).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

PHASES = (("chat", "chat"), ("docs", "long-doc"), ("chat-again", "chat"))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.planner_shift", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for logs, JSON and the table")
    p.add_argument("--workers", type=int, default=4, help="workers in all (default 4)")
    p.add_argument("--start", default="", help="the planner's starting split, e.g. 1P3D "
                   "(default: the most decode workers: wrong for long documents)")
    p.add_argument("--splits", default="", help="static splits to run, e.g. 1P3D,2P2D "
                   "(default: every split of --workers)")
    p.add_argument("--no-static", action="store_true", help="run the planner alone")
    p.add_argument("--phase-s", type=float, default=90.0, help="seconds per phase")
    p.add_argument("--chat-rate", type=float, default=8.0, help="chat requests/s")
    p.add_argument("--chat-len", default="256", help="chat prompt lengths (bench's forms)")
    p.add_argument("--chat-out", default="64", help="chat output lengths")
    p.add_argument("--doc-rate", type=float, default=4.0, help="long-document requests/s")
    p.add_argument("--doc-len", default="4096", help="long-document prompt lengths")
    p.add_argument("--doc-out", default="16", help="long-document output lengths")
    p.add_argument("--slo", default="ttft:1000,tpot:50", help="SLOs (ms) of the goodput")
    p.add_argument("--window-s", type=float, default=20.0, help="the planner's window")
    p.add_argument("--dwell-s", type=float, default=20.0, help="the planner's dwell")
    p.add_argument("--emulate", default="h200")
    p.add_argument("--model-shape", default="llama-3-8b")
    p.add_argument("--emulate-kv-fraction", type=float, default=0.05)
    p.add_argument("--kv-cache-memory-gb", type=float, default=2.0, help="per worker")
    p.add_argument("--cpus-per-worker", type=float, default=0.5)
    p.add_argument("--port", type=int, default=50561)
    return p.parse_args(argv)


def split_of(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)P(\d+)D", text.strip())
    if not m:
        raise SystemExit(f"planner_shift: a split is like 2P2D, got {text!r}")
    return int(m[1]), int(m[2])


def serve_cmd(a: argparse.Namespace, prefill: int, decode: int, planner: bool) -> list[str]:
    cmd = ["pdserve", "serve", "--emulate", a.emulate, "--model-shape", a.model_shape,
           "--dtype", "bfloat16", "--device", "cpu", "--port", str(a.port),
           "--prefill-workers", str(prefill), "--decode-workers", str(decode),
           "--cpus-per-worker", str(a.cpus_per_worker),
           "--kv-cache-memory-gb", str(a.kv_cache_memory_gb),
           "--emulate-kv-fraction", str(a.emulate_kv_fraction), "--max-num-seqs", "128"]
    if planner:
        cmd += ["--planner", "--planner-window-s", str(a.window_s), "--planner-dwell-s",
                str(a.dwell_s), "--planner-slo", a.slo,
                "--planner-min-requests", "10"]
    return cmd


def bench_cmd(a: argparse.Namespace, mix: str, out: Path, seed: int) -> list[str]:
    chat = mix == "chat"
    rate = a.chat_rate if chat else a.doc_rate
    n = max(1, int(rate * a.phase_s))
    return ["pdserve", "bench", "--addr", f"127.0.0.1:{a.port}", "--mix", mix,
            "--num-prompts", str(n), "--request-rate", str(rate), "--seed", str(seed),
            "--prompt-len", a.chat_len if chat else a.doc_len,
            "--output-len", a.chat_out if chat else a.doc_out, "--slo", a.slo,
            "--emulate", a.emulate, "--model-shape", a.model_shape,
            "--emulate-kv-fraction", str(a.emulate_kv_fraction), "--no-progress",
            "--json", str(out)]


def wait_serving(proc: subprocess.Popen, log: Path, timeout_s: float = 600) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"planner_shift: the server exited ({proc.returncode}); see {log}")
        if "pdserve: serving" in log.read_text(errors="replace"):
            return
        time.sleep(1)
    raise SystemExit(f"planner_shift: the server did not start in {timeout_s:.0f}s; see {log}")


def run_config(a: argparse.Namespace, name: str, prefill: int, decode: int, planner: bool,
               out: Path) -> dict:
    log = out / f"{name}.serve.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as f:
        proc = subprocess.Popen(serve_cmd(a, prefill, decode, planner), stdout=f,
                                stderr=subprocess.STDOUT, env=env)
    phases = []
    try:
        wait_serving(proc, log)
        t0 = time.monotonic()
        for i, (phase, mix) in enumerate(PHASES):
            js = out / f"{name}.{phase}.json"
            print(f"[{name}] {phase} ({mix}) ...", flush=True)
            r = subprocess.run(bench_cmd(a, mix, js, seed=i), capture_output=True, text=True)
            if r.returncode != 0:
                raise SystemExit(f"planner_shift: bench failed in {name}/{phase}:\n"
                                 f"{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
            m = json.loads(js.read_text())["metrics"]
            phases.append({"phase": phase, "mix": mix, "goodput_rps": m.get("request_goodput"),
                           "completed": m.get("completed"), "failed": m.get("failed"),
                           "ttft_p99_ms": m.get("p99_ttft_ms"), "tpot_p99_ms": m.get("p99_tpot_ms"),
                           "t_end_s": time.monotonic() - t0})
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
    text = log.read_text(errors="replace")
    decisions = [line.split("planner: ", 1)[1] for line in text.splitlines()
                 if "planner: " in line and "hold: " not in line]
    return {"name": name, "split": f"{prefill}P{decode}D", "planner": planner,
            "phases": phases, "planner_log": decisions}


def table(results: list[dict]) -> str:
    lines = ["| configuration | " + " | ".join(
        f"{p} goodput (req/s) / TTFT p99 (ms)" for p, _ in PHASES) + " | failed |",
        "|---|" + "---|" * (len(PHASES) + 1)]
    for r in results:
        cells = []
        for ph in r["phases"]:
            g, t = ph["goodput_rps"], ph["ttft_p99_ms"]
            cells.append(f"{g:.2f} / {t:.0f}" if g is not None and t is not None else "n/a")
        failed = sum(ph.get("failed") or 0 for ph in r["phases"])
        lines.append(f"| {r['name']} | " + " | ".join(cells) + f" | {failed} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    n = a.workers
    static = [split_of(s) for s in a.splits.split(",") if s.strip()] or \
        [(x, n - x) for x in range(1, n)]
    start = split_of(a.start) if a.start else (1, n - 1)
    results = []
    if not a.no_static:
        for x, y in static:
            results.append(run_config(a, f"static-{x}P{y}D", x, y, False, out))
            print(table(results), flush=True)
    results.append(run_config(a, f"planner-from-{start[0]}P{start[1]}D", *start, True, out))
    label = (f"emulated {a.emulate}, {a.model_shape}: analytic, not measured; KV sent: "
             f"{a.emulate_kv_fraction:g} of each chunk's bytes, the link charged in full")
    print(label)
    print(table(results))
    for r in results:
        if r["planner"]:
            print(f"{r['name']}: planner decisions (holds left out):")
            for line in r["planner_log"]:
                print("   ", line)
    (out / "planner_shift.json").write_text(json.dumps(
        {"label": label, "args": vars(a), "results": results}, indent=2, default=str))
    (out / "planner_shift.md").write_text(label + "\n\n" + table(results) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
