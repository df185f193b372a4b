"""Control-plane benchmark (issue 15): what the service spends per generated token beyond
the engine itself, measured side by side with the in-process engine and bare gRPC.

    python -m bench.control_plane                 # 64 and 256 streams, 32-token prompts,
                                                  # 128 output tokens, the tiny model
    python -m bench.control_plane --quick         # a short run (the smoke test)
    python -m bench.control_plane --profile out/  # + a profile of the front door

Every figure comes from its own processes: `engine.LLM` in a child process (its own CPU
time), `pdserve serve` with 1 prefill + 1 decode worker in its own process tree (psutil
sums each process group's CPU over the load window: front door(s), decode worker,
prefill worker, Ray daemons), load from a client in another process, and a bare
`grpc.aio` server streaming 24-byte messages to a client process (server CPU per
message: the floor any gRPC front door pays per streamed message). Each figure line
carries the 1-minute load average (other work on the machine inflates CPU and latency).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

GROUPS = ("front door", "decode", "prefill", "ray daemons")
ROLES = [sys.executable, "-m", "bench.control_plane_roles"]


def load_avg() -> str:
    return f"load {os.getloadavg()[0]:.2f}"


# ---- process trees ------------------------------------------------------------------
def group_of(proc) -> str:
    try:
        cmd = " ".join(proc.cmdline())
    except Exception:  # gone or not ours to read
        return "ray daemons"
    if "DecodeWorker" in cmd:
        return "decode"
    if "PrefillWorker" in cmd:
        return "prefill"
    if "cluster.front_door" in cmd:  # the extra front doors of --api-servers
        return "front door"
    return "ray daemons"


def tree_cpu(root_pid: int) -> dict[int, tuple[str, float]]:
    """pid -> (group, user + system CPU seconds) of `root_pid` and its descendants."""
    import psutil

    out = {}
    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return out
    for p in procs:
        try:
            t = p.cpu_times()
            out[p.pid] = ("front door" if p.pid == root_pid else group_of(p), t.user + t.system)
        except psutil.Error:
            continue
    return out


def cpu_delta(before: dict, after: dict) -> dict[str, float]:
    groups = dict.fromkeys(GROUPS, 0.0)
    for pid, (group, cpu) in after.items():
        groups[group] += cpu - before.get(pid, (group, 0.0))[1]
    return groups


# ---- child processes ----------------------------------------------------------------
def run_role(args: list[str], between=None, timeout: float = 900.0) -> dict:
    """Run a measuring role; `between()` runs after it is warm, right before it starts
    (e.g. a CPU snapshot), and once more right after; returns (result, snapshots)."""
    p = subprocess.Popen(ROLES + args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        if line.strip() != "READY":
            raise RuntimeError(f"role {args[0]} did not start: {line!r}")
        marks = [between() if between else None]
        p.stdin.write("go\n")
        p.stdin.flush()
        line = p.stdout.readline()
        marks.append(between() if between else None)
        p.wait(timeout)
    finally:
        if p.poll() is None:
            p.kill()
    if not line.strip():
        raise RuntimeError(f"role {args[0]} exited {p.returncode} without a result")
    return {**json.loads(line), "_marks": marks}


def run_plain(args: list[str], timeout: float = 900.0) -> dict:
    out = subprocess.run(ROLES + args, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"role {args[0]} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


@dataclass
class Service:
    """`pdserve serve` (1P + 1D, tiny model) in its own session (process group)."""

    extra: list[str] = field(default_factory=list)
    profile: Path | None = None
    proc: subprocess.Popen | None = None
    addr: str = ""

    def start(self, max_num_seqs: int) -> None:
        serve = ["-m", "cluster.cli", "serve", "--port", "0", "--model", "tiny",
                 "--prefill-workers", "1", "--decode-workers", "1",
                 "--max-num-seqs", str(max_num_seqs), "--log-level", "warning", *self.extra]
        pre = ["-m", "cProfile", "-o", str(self.profile)] if self.profile else []
        self.proc = subprocess.Popen([sys.executable, *pre, *serve], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        deadline = time.monotonic() + 300
        for line in self.proc.stdout:
            if "serving pdserve.v1.Generation on" in line:
                self.addr = line.split(" on ", 1)[1].split()[0]
                return
            if time.monotonic() > deadline:
                break
        self.stop()
        raise RuntimeError("pdserve serve did not start")

    def stop(self) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        p.send_signal(signal.SIGINT)  # drains, then shuts Ray down
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # the session this bench started
            p.wait(10)


# ---- the measurements ---------------------------------------------------------------
def measure_engine(model: str, a, streams: int) -> dict:
    return run_role(["engine", "--model", model, "--streams", str(streams),
                     "--prompt-len", str(a.prompt_len), "--output-len", str(a.output_len),
                     "--max-num-seqs", str(a.max_num_seqs)])


def measure_service(svc: Service, a, streams: int) -> dict:
    res = run_role(["load", "--addr", svc.addr, "--streams", str(streams),
                    "--connections", str(a.connections),
                    "--prompt-len", str(a.prompt_len), "--output-len", str(a.output_len)],
                   between=lambda: tree_cpu(svc.proc.pid))
    res["cpu"] = cpu_delta(*res.pop("_marks"))
    return res


def measure_floor(a, streams: int) -> dict:
    import psutil

    server = subprocess.Popen(ROLES + ["floor-server"], stdout=subprocess.PIPE, text=True)
    try:
        addr = f"127.0.0.1:{server.stdout.readline().split()[1]}"
        proc = psutil.Process(server.pid)
        snap = lambda: sum(proc.cpu_times()[:2])  # noqa: E731
        res = run_role(["floor-client", "--addr", addr, "--streams", str(streams),
                        "--output-len", str(a.output_len)], between=snap)
    finally:
        server.kill()
        server.wait()
    t0, t1 = res.pop("_marks")
    res["us_per_message"] = (t1 - t0) / res["messages"] * 1e6
    return res


def report_throughput(streams: int, eng: dict, svc: dict, floor: dict) -> None:
    tag = f"[{streams} streams]"
    eng_us = eng["cpu_s"] / eng["tokens"] * 1e6
    eng_tps = eng["tokens"] / eng["wall_s"]
    print(f"{tag} engine.LLM in-process: {eng_tps:,.0f} tok/s, {eng_us:.1f} us CPU per token "
          f"({eng['tokens']} tokens) ({eng['load']})")
    n = svc["tokens"]
    per = {g: svc["cpu"][g] / n * 1e6 for g in GROUPS}
    total = sum(per.values())
    tps = n / svc["wall_s"]
    print(f"{tag} service: {tps:,.0f} tok/s; CPU per token: " +
          ", ".join(f"{g} {per[g]:.1f} us" for g in GROUPS) +
          f"; tree {total:.1f} us ({n} tokens, {svc['messages']} messages, "
          f"{n / max(1, svc['messages']):.2f} tokens per message) ({svc['load']})")
    print(f"{tag} ratio cpu per token: {total / eng_us:.2f}")
    print(f"{tag} ratio tokens/s: {tps / eng_tps:.2f}")
    fd_msg = svc["cpu"]["front door"] / max(1, svc["messages"]) * 1e6
    print(f"{tag} grpc floor: {floor['us_per_message']:.1f} us server CPU per 24-byte message "
          f"({floor['messages']} messages) ({floor['load']})")
    print(f"{tag} front door per streamed message: {fd_msg:.1f} us = "
          f"{fd_msg / floor['us_per_message']:.2f}x the grpc floor; per token "
          f"{per['front door']:.1f} us = {per['front door'] / floor['us_per_message']:.2f}x")


def report_idle(eng: dict, svc: dict) -> None:
    ms = 1e3
    print(f"idle: engine.LLM first token {eng['first_token_s'] * ms:.2f} ms, decode step "
          f"{eng['decode_step_s'] * ms:.2f} ms ({eng['load']})")
    print(f"idle: service TTFT {svc['ttft_s'] * ms:.2f} ms (p90 {svc['ttft_p90_s'] * ms:.2f}), "
          f"TPOT {svc['tpot_s'] * ms:.2f} ms ({svc['load']})")
    print(f"idle: TTFT over the engine's first token +{(svc['ttft_s'] - eng['first_token_s']) * ms:.2f}"
          f" ms, TPOT over the engine's decode step "
          f"+{(svc['tpot_s'] - eng['decode_step_s']) * ms:.2f} ms")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.control_plane", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", default="64,256", help="concurrent streams, comma-separated")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=256, help="both engines' batch cap")
    p.add_argument("--idle-requests", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="16 streams x 16 tokens, 4 idle requests")
    p.add_argument("--profile", type=Path, help="directory for a cProfile summary of the front door")
    p.add_argument("--connections", type=int, default=1,
                   help="client connections the streams spread over (with --api-servers)")
    p.add_argument("--serve-args", default="", help="extra `pdserve serve` flags, e.g. "
                   "'--stream-interval 4 --api-servers 2'")
    a = p.parse_args(argv)
    streams = [int(s) for s in a.streams.split(",") if s]
    if a.quick:
        streams, a.output_len, a.idle_requests = [16], 16, 4
    from engine.tiny_model import ensure_model

    model = str(ensure_model("tiny", "llama"))
    print(f"control plane bench: tiny model, prompts {a.prompt_len} tokens, {a.output_len} "
          f"output tokens, streams {streams}, serve {a.serve_args or '(defaults)'} ({load_avg()})",
          flush=True)
    prof = None
    if a.profile is not None:
        a.profile.mkdir(parents=True, exist_ok=True)
        prof = a.profile / "front_door.prof"
    svc = Service(extra=a.serve_args.split(), profile=prof)
    results = []
    svc.start(a.max_num_seqs)
    try:
        for s in streams:
            eng = measure_engine(model, a, s)
            eng["load"] = load_avg()
            srv = measure_service(svc, a, s)
            srv["load"] = load_avg()
            floor = measure_floor(a, s)
            floor["load"] = load_avg()
            report_throughput(s, eng, srv, floor)
            results.append((s, eng, srv, floor))
            sys.stdout.flush()
        idle_args = ["--prompt-len", "16", "--output-len", "8", "--requests", str(a.idle_requests)]
        ieng = run_plain(["engine-idle", "--model", model, *idle_args])
        ieng["load"] = load_avg()
        isvc = run_plain(["idle", "--addr", svc.addr, *idle_args])
        isvc["load"] = load_avg()
        report_idle(ieng, isvc)
    finally:
        svc.stop()
    if prof is not None and prof.exists():
        import pstats

        out = a.profile / "front_door.txt"
        with out.open("w") as f:
            pstats.Stats(str(prof), stream=f).sort_stats("tottime").print_stats(40)
        print(f"front door profile (cProfile of its event-loop thread): {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
