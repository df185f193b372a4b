"""The processes of tools/control_plane.py, each run as `python -m tools.control_plane_roles
ROLE ...` so that its CPU is its own: the in-process engine, the load client, the idle
(concurrency 1) client, and the bare grpc.aio floor's server and client.

A role that measures prints `READY` once warmed up, waits for a line on stdin (the parent
snapshots the server tree's CPU then), runs, and prints one JSON line of results.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

from runtime.event_loop import run as run_loop

FLOOR_METHOD = "/pdserve.bench.Floor/Stream"
FLOOR_MESSAGE = b"x" * 24


def _go() -> None:
    print("READY", flush=True)
    sys.stdin.readline()


def _done(result: dict) -> None:
    print(json.dumps(result), flush=True)


def _prompts(n: int, prompt_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(n)]


# ---- the in-process engine ----------------------------------------------------------
def _llm(model_dir: str, max_num_seqs: int):
    import torch

    from engine.llm import LLM

    torch.set_num_threads(1)  # as a worker with cpus_per_worker=1
    return LLM(model_dir, max_num_seqs=max_num_seqs, device="cpu")


def run_engine(a: argparse.Namespace) -> None:
    from engine.request import SamplingParams

    llm = _llm(a.model, a.max_num_seqs)
    sp = SamplingParams(temperature=0.0, max_tokens=a.output_len, ignore_eos=True)
    vocab = llm.config.model.vocab_size
    llm.generate(_prompts(4, a.prompt_len, vocab, seed=1), sp)  # warm-up
    prompts = _prompts(a.streams, a.prompt_len, vocab)
    _go()
    c0, t0 = time.process_time(), time.perf_counter()
    out = llm.generate(prompts, sp)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    _done({"tokens": sum(len(o.token_ids) for o in out), "wall_s": wall, "cpu_s": cpu})


def run_engine_idle(a: argparse.Namespace) -> None:
    """One request at a time: time to its first token (add + prefill step) and the
    median decode step after it."""
    from engine.request import SamplingParams

    llm = _llm(a.model, 8)
    sp = SamplingParams(temperature=0.0, max_tokens=a.output_len, ignore_eos=True)
    firsts, steps = [], []
    prompts = _prompts(a.requests + 2, a.prompt_len, llm.config.model.vocab_size)
    for i, p in enumerate(prompts):
        t0 = time.perf_counter()
        r = llm.add_request(p, sp)
        while not r.output_token_ids:
            llm.step()
        t1 = time.perf_counter()
        while not r.is_finished:
            s = time.perf_counter()
            llm.step()
            if i >= 2:  # the first two warm up
                steps.append(time.perf_counter() - s)
        if i >= 2:
            firsts.append(t1 - t0)
    _done({"first_token_s": statistics.median(firsts), "decode_step_s": statistics.median(steps)})


# ---- service clients ----------------------------------------------------------------
async def _stream(client, prompt, max_tokens: int, rid: str) -> tuple[int, int, list[float]]:
    """(tokens, messages, arrival times of each message) of one greedy request."""
    tokens = messages = 0
    times = []
    async for chunk in client.generate(prompt, max_tokens=max_tokens, temperature=0.0,
                                       ignore_eos=True, request_id=rid):
        times.append(time.perf_counter())
        tokens += len(chunk.token_ids)
        messages += 1
    return tokens, messages, times


class _Conn:
    """generate() over one TCP connection of its own (no subchannel shared with another
    channel of this process), so --api-servers' front doors each get some."""

    def __init__(self, addr: str):
        import grpc

        from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc

        self.channel = grpc.aio.insecure_channel(
            addr, options=[("grpc.use_local_subchannel_pool", 1)])
        self.stub = pb_grpc.GenerationStub(self.channel)

    async def generate(self, prompt, **kw):
        from cluster.grpc.client import chunk_from_proto
        from cluster.grpc.convert import build_request

        async for r in self.stub.Generate(build_request(prompt, **kw)):
            yield chunk_from_proto(r)


async def _load(a: argparse.Namespace) -> None:
    from cluster.grpc.client import AsyncPdserveClient

    conns = [_Conn(a.addr) for _ in range(a.connections)]
    async with AsyncPdserveClient(a.addr) as client:
        info = await client.model_info()
    await asyncio.gather(*(_stream(conns[i % len(conns)], p, 4, f"warm-{i}") for i, p in
                           enumerate(_prompts(2 * len(conns), a.prompt_len, info.vocab_size,
                                              seed=1))))
    prompts = _prompts(a.streams, a.prompt_len, info.vocab_size)
    await asyncio.get_running_loop().run_in_executor(None, _go)
    t0 = time.perf_counter()
    res = await asyncio.gather(*(_stream(conns[i % len(conns)], p, a.output_len, f"load-{i}")
                                 for i, p in enumerate(prompts)))
    wall = time.perf_counter() - t0
    for c in conns:
        await c.channel.close()
    firsts = sorted(r[2][0] - t0 for r in res if r[2])  # the ramp: when each stream began
    _done({"tokens": sum(r[0] for r in res), "messages": sum(r[1] for r in res),
           "wall_s": wall, "ttft_p50_s": statistics.median(firsts) if firsts else 0.0,
           "ttft_max_s": firsts[-1] if firsts else 0.0})


async def _idle(a: argparse.Namespace) -> None:
    from cluster.grpc.client import AsyncPdserveClient

    ttfts, tpots = [], []
    async with AsyncPdserveClient(a.addr) as client:
        info = await client.model_info()
        for i, p in enumerate(_prompts(a.requests + 2, a.prompt_len, info.vocab_size)):
            t0 = time.perf_counter()
            tokens, _, times = await _stream(client, p, a.output_len, f"idle-{i}")
            if i < 2 or tokens < 2:
                continue  # warm-up
            ttfts.append(times[0] - t0)
            tpots.append((times[-1] - times[0]) / (tokens - 1))
    ttfts.sort()
    _done({"ttft_s": statistics.median(ttfts), "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))],
           "tpot_s": statistics.median(tpots)})


# ---- the bare grpc.aio floor --------------------------------------------------------
async def _floor_server(a: argparse.Namespace) -> None:
    import grpc

    async def stream(request: bytes, context):
        for _ in range(int(request)):
            yield FLOOR_MESSAGE

    handler = grpc.method_handlers_generic_handler("pdserve.bench.Floor", {
        "Stream": grpc.unary_stream_rpc_method_handler(stream)})
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"PORT {port}", flush=True)
    await server.wait_for_termination()


async def _floor_client(a: argparse.Namespace) -> None:
    import grpc

    async with grpc.aio.insecure_channel(a.addr) as ch:
        call = ch.unary_stream(FLOOR_METHOD)

        async def one(n: int) -> int:
            return sum([1 async for _ in call(str(n).encode())])

        await asyncio.gather(*(one(4) for _ in range(4)))
        await asyncio.get_running_loop().run_in_executor(None, _go)
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(a.output_len) for _ in range(a.streams)))
        _done({"messages": sum(counts), "wall_s": time.perf_counter() - t0})


ROLES = {
    "engine": run_engine,
    "engine-idle": run_engine_idle,
    "load": lambda a: asyncio.run(_load(a)),
    "idle": lambda a: asyncio.run(_idle(a)),
    "floor-server": lambda a: run_loop(_floor_server(a), a.event_loop),
    "floor-client": lambda a: asyncio.run(_floor_client(a)),
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tools.control_plane_roles")
    p.add_argument("role", choices=sorted(ROLES))
    p.add_argument("--model", default="")
    p.add_argument("--addr", default="")
    p.add_argument("--streams", type=int, default=1)
    p.add_argument("--requests", type=int, default=10)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--connections", type=int, default=1, help="client TCP connections")
    p.add_argument("--event-loop", default="asyncio", help="the floor server's event loop "
                   "(runtime/event_loop.py: the front door's, for a fair floor)")
    a = p.parse_args(argv)
    ROLES[a.role](a)


if __name__ == "__main__":
    main()
