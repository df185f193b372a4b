"""Control-plane benchmark (issue 15): what the service spends per generated token beyond
the engine itself, measured side by side with the in-process engine and bare gRPC.

    python -m tools.control_plane                 # 64 and 256 streams, 32-token prompts,
                                                  # 128 output tokens, the tiny model
    python -m tools.control_plane --quick         # a short run (the smoke test)
    python -m tools.control_plane --profile out/  # + profiles of the front door and the
                                                  # workers (py-spy --native if
                                                  # installed, else cProfile of the front
                                                  # door) and their CPU per thread
    python -m tools.control_plane --profile out/ --threads-only   # CPU per thread alone

Every figure comes from its own processes: `engine.LLM` in a child process (its own CPU
time), `pdserve serve` with 1 prefill + 1 decode worker in its own process tree (psutil
sums each process group's CPU over the load window: front door(s), decode worker,
prefill worker, Ray daemons), load from a client in another process, and a bare
`grpc.aio` server streaming 24-byte messages to a client process (server CPU per
message: the floor any gRPC front door pays per streamed message), on the front door's
event loop (server.event_loop: uvloop where installed) and, for reference, on asyncio's.
Each figure line carries the 1-minute load average (other work on the machine inflates
CPU and latency) and the machine canary (tools/machine_canary.py: a fixed CPU job's time
and two threads' wake-up round trip, which show a shared host running slower than in an
earlier run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from tools.service_tree import GROUPS, Service, cpu_delta, tree_cpu
from tools.thread_cpu import table, thread_times

ROLES = [sys.executable, "-m", "tools.control_plane_roles"]


def load_avg() -> str:
    """The 1-minute load average and the machine canary (a fixed CPU job's time: a shared
    host's speed moves by tens of percent within minutes, unseen by the load average)."""
    from tools.machine_canary import canary_s, wake_s

    return (f"load {os.getloadavg()[0]:.2f}, canary {canary_s() * 1e3:.1f} ms, "
            f"thread wake round trip {wake_s() * 1e6:.0f} us")


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


# ---- the measurements ---------------------------------------------------------------
def measure_engine(model: str, a, streams: int) -> dict:
    return run_role(["engine", "--model", model, "--streams", str(streams),
                     "--prompt-len", str(a.prompt_len), "--output-len", str(a.output_len),
                     "--max-num-seqs", str(a.max_num_seqs)])


def measure_service(svc: Service, a, streams: int) -> dict:
    """The load window; with --profile, the CPU per thread of the front door and the
    workers over it (and their py-spy profiles where py-spy runs)."""
    profiles = []  # (tag, pid, NativeProfile | None, thread snapshots)
    if svc.threads_dir is not None:
        from tools.front_door_profile import NativeProfile, py_spy

        pids = {"front_door": svc.proc.pid}
        for pid, (group, _) in tree_cpu(svc.proc.pid).items():
            if group in ("decode", "prefill"):  # (the actor: its class in its command)
                pids[group] = pid
        for tag, pid in pids.items():
            native = None if svc.native_dir is None else NativeProfile(
                py_spy(), pid, svc.native_dir, f"{tag}_{streams}")
            profiles.append((tag, pid, native, []))

    def mark() -> dict:  # the CPU snapshot; the profiles sample the window between them
        snap = tree_cpu(svc.proc.pid)
        for _, pid, native, threads in profiles:
            threads.append(thread_times(pid))
            if native is not None:
                native.stop() if native.proc else native.start()
        return snap

    res = run_role(["load", "--addr", svc.addr, "--streams", str(streams),
                    "--connections", str(a.connections),
                    "--prompt-len", str(a.prompt_len), "--output-len", str(a.output_len)],
                   between=mark)
    res["cpu"] = cpu_delta(*res.pop("_marks"))
    for tag, _, native, threads in profiles:
        out = svc.threads_dir / f"{tag}_{streams}_threads.txt"
        out.write_text(table(*threads, res["tokens"]))
        print(f"{tag}: CPU per thread: {out}" +
              (f"; native profile (py-spy): {native.summary}" if native else ""))
    return res


def measure_floor(a, streams: int, loop: str, native_dir: Path | None = None) -> dict:
    """A bare grpc.aio server on `loop` (the front door's, for a fair floor)."""
    import psutil

    server = subprocess.Popen(ROLES + ["floor-server", "--event-loop", loop],
                              stdout=subprocess.PIPE, text=True)
    native = None
    try:
        addr = f"127.0.0.1:{server.stdout.readline().split()[1]}"
        proc = psutil.Process(server.pid)
        if native_dir is not None:  # the floor's profile, to hold the front door's against
            from tools.front_door_profile import NativeProfile, py_spy

            native = NativeProfile(py_spy(), server.pid, native_dir, f"grpc_floor_{streams}")

        def snap() -> float:
            cpu = sum(proc.cpu_times()[:2])
            if native is not None:
                native.stop() if native.proc else native.start()
            return cpu

        res = run_role(["floor-client", "--addr", addr, "--streams", str(streams),
                        "--output-len", str(a.output_len)], between=snap)
    finally:
        server.kill()
        server.wait()
    t0, t1 = res.pop("_marks")
    res["us_per_message"] = (t1 - t0) / res["messages"] * 1e6
    res["loop"], res["load"] = loop, load_avg()
    return res


def report_throughput(streams: int, eng: dict, svc: dict, floor: dict,
                      ref: dict | None) -> None:
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
    if "ttft_max_s" in svc:  # the burst's ramp: all streams start at once, as in the engine
        print(f"{tag} service ramp: first token p50 {svc['ttft_p50_s'] * 1e3:,.0f} ms, last "
              f"{svc['ttft_max_s'] * 1e3:,.0f} ms, of a {svc['wall_s'] * 1e3:,.0f} ms run")
    # per request (each stream is one): what the tree spends beyond the engine here
    # grows with requests, not tokens, at stream_interval > 1 or short outputs
    floor_call = floor["us_per_message"] * floor["messages"] / streams
    print(f"{tag} CPU per request: " +
          ", ".join(f"{g} {svc['cpu'][g] / streams * 1e6:,.0f} us" for g in GROUPS) +
          f"; engine.LLM {eng['cpu_s'] / streams * 1e6:,.0f} us; grpc floor per call "
          f"({floor['messages'] // streams} messages) {floor_call:,.0f} us")
    print(f"{tag} ratio cpu per token: {total / eng_us:.2f}")
    print(f"{tag} ratio tokens/s: {tps / eng_tps:.2f}")
    fd_msg = svc["cpu"]["front door"] / max(1, svc["messages"]) * 1e6
    for f in (floor, ref) if ref else (floor,):
        print(f"{tag} grpc floor ({f['loop']} loop): {f['us_per_message']:.1f} us server CPU per "
              f"24-byte message ({f['messages']} messages) ({f['load']})")
    base = floor["us_per_message"]
    if base <= 0:  # the floor server's CPU stayed under one clock tick (a --quick run)
        print(f"{tag} front door ({floor['loop']} loop) per streamed message: {fd_msg:.1f} us; per token "
              f"{per['front door']:.1f} us (no ratio: too few messages to time the floor)")
        return
    print(f"{tag} front door ({floor['loop']} loop) per streamed message: {fd_msg:.1f} us = "
          f"{fd_msg / base:.2f}x the grpc floor; per token "
          f"{per['front door']:.1f} us = {per['front door'] / base:.2f}x" +
          (f"; {fd_msg / ref['us_per_message']:.2f}x the {ref['loop']} loop's floor per "
           "message" if ref and ref["us_per_message"] > 0 else ""))


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
    p = argparse.ArgumentParser(prog="python -m tools.control_plane", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", default="64,256", help="concurrent streams, comma-separated")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=256, help="both engines' batch cap")
    p.add_argument("--idle-requests", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="16 streams x 16 tokens, 4 idle requests")
    p.add_argument("--profile", type=Path, help="directory for profiles of the front door "
                   "and the workers (py-spy --native per load window when installed, "
                   "else cProfile of the front door) and their CPU per thread")
    p.add_argument("--threads-only", action="store_true", help="with --profile: only "
                   "the CPU per thread of the front door and the workers (no py-spy, "
                   "which stops the process at every sample)")
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
    prof = native = None
    if a.profile is not None:
        from tools.front_door_profile import py_spy

        a.profile.mkdir(parents=True, exist_ok=True)
        if py_spy() and not a.threads_only:
            native = a.profile
        elif not a.threads_only:
            prof = a.profile / "front_door.prof"
    svc = Service(extra=a.serve_args.split(), profile=prof, native_dir=native,
                  threads_dir=a.profile)
    results = []
    svc.start(a.max_num_seqs)
    try:
        for s in streams:
            eng = measure_engine(model, a, s)
            eng["load"] = load_avg()
            srv = measure_service(svc, a, s)
            srv["load"] = load_avg()
            floor = measure_floor(a, s, svc.loop, svc.native_dir)
            ref = measure_floor(a, s, "asyncio") if svc.loop != "asyncio" else None
            report_throughput(s, eng, srv, floor, ref)
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
        from tools.front_door_profile import cprofile_summary

        print(f"front door profile (cProfile of its event-loop thread): "
              f"{cprofile_summary(prof)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
