"""The front door alone: a real Router over scripted fake workers (tests/scripted_workers.py)
with the tiny model's tokenizer, its decode steps fed to the event pump as a control
channel delivers them (one encoded step message per step: encode_batch -> decode_batch ->
on_batch), and its streams read through the real gRPC front door by the load client of
tools/control_plane.py in another process. No engine runs, so the front door's CPU per
streamed message is steady on a busy machine: a figure to compare changes with, next to
the bare grpc.aio floor measured in the same run (tools/control_plane.py's).

    python -m tools.control_plane_micro [--streams 256] [--output-len 128] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

STEP_S = 0.004  # a decode step's period: the front door idles between steps, as it does


async def _fake_cluster(interval: int):
    """A router whose workers are scripted: every leg gets its first token at the next
    step and one token per step after it, until its max_tokens."""
    from cluster.config.serve import ServeConfig
    from cluster.serve.server import GenerationServer
    from engine.loader import load_tokenizer
    from engine.request import FinishReason
    from engine.tiny_model import ensure_model
    from runtime.batch_codec import decode_batch, encode_batch
    from runtime.messages import EventKind, WorkerEvent
    from tests.scripted_workers import make_router

    router, prefill, [decode] = make_router(stream_interval=interval, max_queue_len=4096)
    router.tokenizer = load_tokenizer(str(ensure_model("tiny", "llama")))
    new: list[tuple[str, int]] = []
    left: dict[str, int] = {}

    async def on_add(task):
        new.append((task.leg_id, task.sampling.max_tokens))

    prefill.actor.on_add = on_add

    def step(worker, events) -> None:
        if events:
            router.pump.on_batch(worker, *decode_batch(
                encode_batch(worker.worker_id, events, None))[1:])

    async def run_steps() -> None:
        k = 0
        while True:
            await asyncio.sleep(STEP_S)
            k += 1
            toks, done = [], []
            for leg, n in list(left.items()):
                n -= 1
                fin = FinishReason.LENGTH if n == 0 else None
                toks.append(WorkerEvent(EventKind.TOKENS, leg, "decode-0",
                                        (40 + (k + len(leg)) % 300,), finish_reason=fin))
                left[leg] = n
                if fin:
                    done.append(leg)
            for leg in done:
                del left[leg]
            step(decode, toks)
            firsts, new[:] = list(new), []
            step(prefill, [WorkerEvent(EventKind.FIRST_TOKEN, leg, "prefill-0", (300,),
                                       finish_reason=FinishReason.LENGTH if n <= 1 else None)
                           for leg, n in firsts])
            left.update((leg, n - 1) for leg, n in firsts if n > 1)

    cfg = ServeConfig.from_dict({"server": {"port": 0, "host": "127.0.0.1"}})
    server = GenerationServer(router, cfg)
    addr = await server.start()
    return server, addr, asyncio.ensure_future(run_steps())


async def _serve(a: argparse.Namespace) -> None:
    from runtime.gc_pauses import settle

    server, addr, stepper = await _fake_cluster(a.stream_interval)
    settle()  # as cluster.serve.server.serve: what startup built stays off the collector
    results = []
    loop = asyncio.get_running_loop()
    for _ in range(a.repeat):
        res = await loop.run_in_executor(None, _load, addr, a)
        results.append(res)
    stepper.cancel()
    await server.stop(drain_timeout_s=0)
    per_msg = [r["cpu_s"] / r["messages"] * 1e6 for r in results]
    per_tok = [r["cpu_s"] / r["tokens"] * 1e6 for r in results]
    tpm = statistics.median(r["tokens"] / r["messages"] for r in results)
    from runtime.event_loop import running_loop_name
    from tools.control_plane import measure_floor

    floor = statistics.median(
        measure_floor(a, a.streams, running_loop_name())["us_per_message"]
        for _ in range(a.repeat))
    print(f"front door alone ({a.streams} streams x {a.output_len} tokens, stream_interval "
          f"{a.stream_interval}, gRPC to a client process): {statistics.median(per_msg):.1f} "
          f"us CPU per message ({', '.join(f'{x:.1f}' for x in per_msg)}), "
          f"{statistics.median(per_tok):.1f} us per token, {tpm:.2f} tokens per message "
          f"(load {os.getloadavg()[0]:.2f})")
    print(f"grpc floor ({running_loop_name()} loop, median of {a.repeat}): {floor:.1f} us per "
          f"message; front door alone / floor: {statistics.median(per_msg) / floor:.2f}x",
          flush=True)


def _load(addr: str, a: argparse.Namespace) -> dict:
    """One load window from bench/control_plane_roles' client; this process's CPU over it."""
    p = subprocess.Popen([sys.executable, "-m", "tools.control_plane_roles", "load", "--addr",
                          addr, "--streams", str(a.streams), "--prompt-len", "8",
                          "--output-len", str(a.output_len)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        if p.stdout.readline().strip() != "READY":
            raise RuntimeError("the load client did not start")
        c0 = time.process_time()
        p.stdin.write("go\n")
        p.stdin.flush()
        line = p.stdout.readline()
        cpu = time.process_time() - c0
        p.wait(60)
    finally:
        if p.poll() is None:
            p.kill()
    return {**json.loads(line), "cpu_s": cpu}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.control_plane_micro", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--stream-interval", type=int, default=1)
    p.add_argument("--event-loop", default="auto")
    a = p.parse_args(argv)
    from runtime.event_loop import run

    run(_serve(a), a.event_loop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
