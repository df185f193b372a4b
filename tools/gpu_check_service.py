"""The service step of tools/gpu_check: 1 prefill + 1 decode worker sharing one GPU.

With Ray installed, the real launcher with the defaults (`pools.gpus_per_worker` 1.0 on a
one-GPU machine: the plan gives each worker 0.5 GPU and says so). Without Ray (the GPU
image may lack it), the same two engines in this process, each driven by its own
WorkerLoop thread, their KV over the tcp connector (real sockets), each sized as the plan's
0.5 share of the GPU. The colocated engine.LLM runs the same workload after it on the
same GPU, side by side: output tok/s of both and their ratio.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field
from queue import Empty, SimpleQueue
from typing import Any

import torch

from engine.request import SamplingParams


@dataclass
class Workload:
    prompts: list[list[int]]
    params: SamplingParams

    @property
    def output_tokens(self) -> int:
        return len(self.prompts) * self.params.max_tokens


def workload(vocab: int, n: int, lo: int, hi: int, max_tokens: int, seed: int = 0) -> Workload:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    prompts = [torch.randint(1, vocab, (k,), generator=g).tolist() for k in lengths]
    return Workload(prompts, SamplingParams(temperature=0, max_tokens=max_tokens,
                                            ignore_eos=True))


@dataclass
class _Flight:
    prompt: list[int]
    start: float
    first: float | None = None
    tokens: list[int] = field(default_factory=list)  # the decode worker's, in order
    done: bool = False
    # the prefill worker's: its event may be polled after the decode worker's first
    # tokens (two loops, polled in turn), so it is kept apart and put first
    first_token: list[int] = field(default_factory=list)

    @property
    def output(self) -> list[int]:
        return self.first_token + self.tokens


def _taken(q: SimpleQueue, timeout_s: float) -> list:
    """Everything `q` holds, waiting up to `timeout_s` for the first."""
    try:
        out = [q.get(timeout=timeout_s)]
    except Empty:
        return []
    while True:
        try:
            out.append(q.get_nowait())
        except Empty:
            return out


class InprocPD:
    """1P+1D in this process (see module doc), built once: ``run(wl)`` serves a workload
    and returns tok/s, TTFT and a leak check; ``set_overlap`` switches the decode worker's
    host-ahead loop between runs (the overlap step's on/off pair on one engine: a CUDA
    graph capture per engine is the expensive part of a lease); ``close`` ends it."""

    def __init__(self, model_dir: str, device: str, dtype: str, *, max_num_seqs: int = 128,
                 overlap: bool = True):
        from cluster.config.serve import ServeConfig
        from cluster.launch.placement import plan_pools
        from cluster.launch.worker_specs import decode_config, engine_config, prefill_config
        from decode_worker.engine import DecodeEngine
        from kv_transfer.config import TransferConfig
        from kv_transfer.registry import make_receiver, make_sender
        from prefill_worker.engine import PrefillEngine
        from runtime.loop import WorkerLoop
        from runtime.spec import resolve_engine

        cuda = device.startswith("cuda")
        self.plan = plan_pools(1, 1, device=device, gpus_per_worker=1.0, cpus_per_worker=1.0,
                               available={"GPU": 1.0} if cuda else {"CPU": 2.0})
        tcfg = TransferConfig(connector="tcp", secret=secrets.token_bytes(32),
                              credit_window_bytes=256 << 20)
        self.receiver, self.sender = make_receiver(tcfg), make_sender(tcfg, name="prefill-0")
        cfg = ServeConfig.from_dict({
            "model": {"path": model_dir, "device": device, "dtype": dtype,
                      "max_model_len": 4096},
            "cache": {"num_blocks": None if cuda else 512},
            "scheduler": {"max_num_batched_tokens": 2048, "max_num_seqs": max_num_seqs,
                          "max_prefill_chunk": 512, "overlap": overlap}})
        self.share = {w.role: w.gpu_share for w in self.plan.workers}
        pcfg, self.pblocks = resolve_engine(engine_config(cfg, model_dir, "prefill",
                                                          self.share["prefill"]))
        dcfg, self.dblocks = resolve_engine(engine_config(cfg, model_dir, "decode",
                                                          self.share["decode"]))
        # each engine built (loaded, warmed up, its graphs recorded) on the loop thread that
        # steps it, as a worker actor does (runtime.worker.WorkerBase.start)
        self.events: SimpleQueue = SimpleQueue()  # both loops' events, in order
        self.loops: list = []
        try:
            self.loops.append(WorkerLoop(build=lambda: PrefillEngine(
                "prefill-0", pcfg, prefill_config(cfg), self.sender, self.pblocks),
                on_events=self._publish))
            self.loops.append(WorkerLoop(build=lambda: DecodeEngine(
                "decode-0", dcfg, decode_config(cfg, dcfg.scheduler.max_model_len),
                self.receiver, self.dblocks), on_events=self._publish))
        except BaseException:
            self.close()
            raise
        self.prefill, self.decode = self.loops[0].engine, self.loops[1].engine
        self.eos = pcfg.model.eos_token_ids
        self._runs = 0

    def _publish(self, evs: list) -> None:
        for ev in evs:
            self.events.put(ev)

    def set_overlap(self, on: bool) -> None:
        """Between runs only (no leg, no step in flight), and only where the decode
        worker's KV intake is inline (CUDA): with an intake off the loop (the CPU cache,
        the emulated device) the serial loop would never take its ranges in."""
        from decode_worker.intake import KVIntake

        if KVIntake.for_cache(self.decode.runner.kv) is not None:
            raise RuntimeError("set_overlap needs an inline KV intake (a CUDA cache); build "
                               "an InprocPD per mode here")

        def flip() -> None:
            if self.decode.has_work:
                raise RuntimeError("set_overlap while the decode worker has legs or a step "
                                   "in flight")
            self.decode.overlap = on
        self.loops[1].call(flip)

    def stats(self) -> list:
        return [loop.call(eng.stats) for loop, eng in zip(self.loops, (self.prefill,
                                                                        self.decode),
                                                           strict=True)]

    def run(self, wl: Workload, timeout_s: float = 600.0) -> dict[str, Any]:
        from runtime.messages import DecodeTask, EventKind, PrefillTask

        self._runs += 1
        tag = f"run{self._runs}-"
        loops, prefill, decode, receiver = self.loops, self.prefill, self.decode, self.receiver
        flights: dict[str, _Flight] = {}
        queue = [(f"{tag}r{i}", p) for i, p in enumerate(wl.prompts)]
        failures: list[str] = []
        t0 = time.monotonic()
        def reserve_all(tasks: list) -> int:  # on the decode loop: as many as it takes
            for n, t in enumerate(tasks):
                if not decode.reserve(t):
                    return n
            return len(tasks)

        while queue or any(not f.done for f in flights.values()):
            if queue:  # one command a loop per round, not a round trip per request (a
                # loop takes commands between steps: at 64 requests that staggered the
                # legs' starts over a second and the decode batch ran ~6 rows deep)
                n = loops[1].call(lambda ts=[DecodeTask(rid, len(p), wl.params, self.eos)
                                             for rid, p in queue]: reserve_all(ts))
                admitted, queue = queue[:n], queue[n:]  # the rest: as requests finish
                now = time.monotonic()
                for rid, p in admitted:
                    flights[rid] = _Flight(p, now)
                if admitted:
                    loops[0].call(lambda ts=[PrefillTask(rid, tuple(p), wl.params,
                                                         receiver.endpoint, self.eos)
                                             for rid, p in admitted]: [prefill.add(t)
                                                                       for t in ts])
            for ev in _taken(self.events, 0.01):
                f = flights.get(ev.leg_id)
                if f is None:
                    continue
                if ev.kind in (EventKind.FIRST_TOKEN, EventKind.TOKENS):
                    f.first = f.first or time.monotonic()
                    (f.first_token if ev.kind == EventKind.FIRST_TOKEN else f.tokens).extend(
                        ev.token_ids)
                    if ev.finish_reason is not None:
                        f.done = True
                        if ev.kind == EventKind.FIRST_TOKEN:  # ended at its first token
                            loops[1].call(lambda r=ev.leg_id: decode.abort(r))
                elif ev.kind in (EventKind.FAILED, EventKind.PREEMPTED):
                    failures.append(f"{ev.leg_id}: {ev.kind} {ev.message}")
                    f.done = True
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"in-process P/D did not finish in {timeout_s:.0f} s")
        wall = time.monotonic() - t0
        stats = self.stats()
        ttft = sorted(f.first - f.start for f in flights.values() if f.first is not None)
        n = sum(len(f.output) for f in flights.values())
        return {
            "layout": "in-process 1P+1D (WorkerLoop threads, tcp connector; no Ray)",
            "gpu_share": self.share["decode"], "plan_note": self.plan.note,
            "kv_blocks": {"prefill": self.pblocks, "decode": self.dblocks},
            "output_tokens": n, "wall_s": wall, "output_tok_s": n / wall,
            "ttft_p50_s": ttft[len(ttft) // 2] if ttft else None, "failures": failures[:10],
            "kv_blocks_used_at_end": {"prefill": stats[0].kv_blocks_used,
                                      "decode": stats[1].kv_blocks_used},
            "tokens": [flights[f"{tag}r{i}"].output for i in range(len(wl.prompts))],
        }

    def close(self) -> None:
        for loop in self.loops:
            loop.stop()
        self.sender.close()
        self.receiver.close()


def run_inprocess_pd(model_dir: str, device: str, dtype: str, wl: Workload) -> dict[str, Any]:
    """1P+1D in this process, built for one workload (see InprocPD)."""
    pd = InprocPD(model_dir, device, dtype)
    try:
        return pd.run(wl)
    finally:
        pd.close()


def run_ray_pd(model_dir: str, dtype: str, wl: Workload) -> dict[str, Any]:
    """1P+1D through the real launcher and router with the defaults, on local Ray."""
    import ray

    from cluster.config.serve import ServeConfig
    from cluster.launch.launcher import build_disaggregated_router
    from cluster.router.types import GenerateSpec

    notes: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            notes.append(record.getMessage())

    logging.getLogger("cluster.launch.launcher").addHandler(Grab(logging.WARNING))
    ray.init(num_cpus=8, include_dashboard=False, namespace="pdserve-gpu-check",
             configure_logging=False, log_to_driver=False)
    try:
        cfg = ServeConfig.from_dict({
            "model": {"path": model_dir, "dtype": dtype, "max_model_len": 4096},
            "scheduler": {"max_num_batched_tokens": 2048, "max_num_seqs": 128,
                          "max_prefill_chunk": 512}})
        router = build_disaggregated_router(cfg)
        gpus = {h.worker_id: ray.get(h.actor.ready.remote(), timeout=120)
                for h in router.prefill + router.decode}

        async def go() -> list[list[int]]:
            async def one(i: int, p: list[int]) -> list[int]:
                toks: list[int] = []
                async for d in router.generate(GenerateSpec(f"r{i}", tuple(p), wl.params)):
                    toks += d.token_ids
                return toks

            out = await asyncio.gather(*(one(i, p) for i, p in enumerate(wl.prompts)))
            await router.shutdown(5)
            return list(out)

        t0 = time.monotonic()
        tokens = asyncio.run(go())
        wall = time.monotonic() - t0
    finally:
        ray.shutdown()
    n = sum(len(t) for t in tokens)
    return {"layout": "Ray 1P+1D via cluster.launch.launcher (defaults)", "plan_note": notes,
            "workers": {w: {k: getattr(i, k) for k in ("device", "gpu_ids", "num_blocks")}
                        for w, i in gpus.items()},
            "output_tokens": n, "wall_s": wall, "output_tok_s": n / wall, "tokens": tokens}


def run_colocated(model_dir: str, device: str, dtype: str, wl: Workload) -> dict[str, Any]:
    from engine import LLM

    llm = LLM(model_dir, device=device, dtype=dtype, max_num_batched_tokens=2048,
              max_num_seqs=128, max_prefill_chunk=512, max_model_len=4096,
              num_blocks=None if device.startswith("cuda") else 512)
    llm.generate(wl.prompts[:2], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    t0 = time.monotonic()
    outs = llm.generate(wl.prompts, wl.params)
    wall = time.monotonic() - t0
    n = sum(len(o.token_ids) for o in outs)
    return {"output_tokens": n, "wall_s": wall, "output_tok_s": n / wall,
            "tokens": [o.token_ids for o in outs]}


def service_step(model_dir: str, device: str, dtype: str, wl: Workload) -> dict[str, Any]:
    try:
        import ray  # noqa: F401

        has_ray = device.startswith("cuda")
    except ImportError:
        has_ray = False
    pd = run_ray_pd(model_dir, dtype, wl) if has_ray else run_inprocess_pd(
        model_dir, device, dtype, wl)
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    co = run_colocated(model_dir, device, dtype, wl)
    same = sum(a == b for a, b in zip(pd.pop("tokens"), co.pop("tokens"), strict=True))
    return {"pd": pd, "colocated": co, "pd_over_colocated": pd["output_tok_s"] / co["output_tok_s"],
            "greedy_outputs_equal": f"{same}/{len(wl.prompts)}"}
