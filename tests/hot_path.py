"""Which source files a request's hot path runs, from cluster/servicer.py's Generate to
its first streamed token, over the real P/D parts in one process (issue 12's measure): the router's thread, the actor
calls and the prefill worker's loop; the decode loop and the KV link threads run beside
the path (the first token waits for neither) and are left out.

The router, a PrefillWorker and a DecodeWorker (the actor classes themselves, their
WorkerLoop threads, the tcp connector) run here; each actor call goes to a thread, as
Ray's threaded actors do. Every Python call of every thread is recorded from the moment
Generate is called until its first response is yielded, after one warm-up request (so
imports and first-use setup are not counted). Run: `python -m tests.hot_path`.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "kv_transfer", "runtime", "prefill_worker", "decode_worker", "cluster",
            "proto")


class _Remote:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return asyncio.get_running_loop().run_in_executor(None, self.fn, *args)


class ThreadActor:
    """A worker object called like a Ray actor handle (each call on a pool thread)."""

    def __init__(self, obj):
        self.obj = obj

    def __getattr__(self, name):
        return _Remote(getattr(self.obj, name))


class _Context:
    def cancelled(self) -> bool:
        return False

    def invocation_metadata(self):
        return ()

    async def abort(self, code, details):
        raise RuntimeError(f"{code}: {details}")


def _beside(thread: str) -> bool:
    return thread.startswith(("worker-loop:decode", "kv-", "prefill-0->"))


def _files(model_dir: str) -> list[str]:
    from cluster.config import ServeConfig
    from cluster.placement import plan_pools
    from cluster.pool import WorkerHandle
    from cluster.router import Router, RouterConfig
    from cluster.servicer import GenerationServicer, ServingState
    from cluster.worker_specs import worker_specs
    from decode_worker.worker import DecodeWorker
    from engine.loader import load_tokenizer
    from prefill_worker.worker import PrefillWorker
    from proto.pdserve.v1 import pdserve_pb2 as pb

    seen: set[str] = set()
    recording = threading.Event()

    def profile(frame, event, arg):
        # off the path: the decode loop's steps and the KV links run beside it (the first
        # token waits for neither)
        if event == "call" and recording.is_set() and not _beside(
                threading.current_thread().name):
            seen.add(frame.f_code.co_filename)

    # every thread from here on (the worker loops, the actor-call pool) is profiled
    threading.setprofile(profile)
    sys.setprofile(profile)
    cfg = ServeConfig.from_dict({"model": {"path": model_dir}, "cache": {"num_blocks": 256}})
    plan = plan_pools(1, 1, device="cpu", gpus_per_worker=0, cpus_per_worker=1,
                      available={"CPU": 2})
    with mock.patch("ray.get_gpu_ids", lambda: []):
        specs = worker_specs(cfg, plan, model_dir, "pdserve-hot")
        workers = [PrefillWorker(specs[0]), DecodeWorker(specs[1])]
    handles = []
    for w, spec in zip(workers, specs, strict=True):
        h = WorkerHandle(spec.worker_id, spec.role, ThreadActor(w))
        h.endpoint, h.num_blocks, h.block_size = w.endpoint(), w.num_blocks, 16
        handles.append(h)
    model = workers[0].cfg.model
    router = Router([handles[0]], [handles[1]], RouterConfig(), load_tokenizer(model_dir),
                    model.vocab_size, 1024, model.eos_token_ids)
    servicer = GenerationServicer(router, ServingState())

    async def first_token(rid: str, record: bool) -> None:
        req = pb.GenerateRequest(request_id=rid, token_ids=pb.TokenIds(ids=list(range(1, 40))),
                                 max_tokens=4, temperature=0.0)
        stream = servicer.Generate(req, _Context())
        if record:
            recording.set()
        try:
            await stream.__anext__()
        finally:
            recording.clear()
        async for _ in stream:
            pass

    async def run() -> None:
        await first_token("warm-up", record=False)
        await first_token("measured", record=True)
        await router.shutdown(5)

    try:
        asyncio.run(run())
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        for w in workers:
            w.shutdown()
    ours = {str(Path(f).resolve().relative_to(ROOT)) for f in seen
            if Path(f).resolve().is_relative_to(ROOT)}
    return sorted(f for f in ours if f.split("/")[0] in PACKAGES)


def main() -> None:
    from engine.tiny_model import ensure_model

    files = _files(str(ensure_model("tiny", "llama")))
    for f in files:
        print(f)
    print(f"{len(files)} files from cluster/servicer.py to the first streamed token "
          f"({len({f.split('/')[0] for f in files})} packages)")


if __name__ == "__main__":
    main()
