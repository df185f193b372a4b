"""Which source files a request's hot path runs, from cluster/grpc/servicer.py's Generate to
its first streamed token, over the real P/D parts in one process (issue 12's measure): the
router's thread, the workers' control channels (the one path of commands and events, as
in production) and the prefill worker's loop; the decode loop and the KV link threads run
beside the path (the first token waits for neither) and are left out.

The router, a PrefillWorker and a DecodeWorker (the actor classes themselves, their
WorkerLoop threads and control channels over TCP with the cluster secret, the tcp
connector) run here; the few actor calls left (ready, stats) go to a thread, as Ray's
threaded actors do. Every Python call of every thread is recorded from the moment
Generate is called until its first response is yielded, after one warm-up request (so
imports and first-use setup are not counted), once that request's leftovers are done;
a worker loop stops counting once its step that yields the first token has handed its
events off (its next steps race the router for that token and are not on the path), so
the count is the same on every run. The decode worker's `reserve` command of the measured
request is held until its first token is out (the router sends it with the prefill's add
and the first token must not wait for it; were it on the path, the run would stop with an
error saying so), so it is left out by construction too. Run: `python -m tests.hot_path [--by-package | --why]` (`--why`: the
first call into each file, its thread and caller).
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


def gate_reserve(worker, gate: threading.Event) -> None:
    """The decode worker's `reserve` command waits until `gate` is set (at most GATE_S)."""
    reserve = worker.channel.commands["reserve"]

    def gated(task):
        if not gate.wait(GATE_S):
            raise RuntimeError("the first token waited for the decode worker's reserve")
        return reserve(task)

    worker.channel.commands["reserve"] = gated


GATE_S = 60.0  # only turns a reserve on the path into an error instead of a hang


class _Context:
    def cancelled(self) -> bool:
        return False

    def invocation_metadata(self):
        return ()

    async def abort(self, code, details):
        raise RuntimeError(f"{code}: {details}")


def _beside(thread: str) -> bool:
    return thread.startswith(("worker-loop:decode", "kv-", "prefill-0->"))


def _yields_first_token(frame, result) -> bool:
    """Is `frame` a prefill engine's step returning the first token's event?"""
    if frame.f_code.co_name != "step" or not isinstance(result, list):
        return False
    from runtime.messages import EventKind

    return any(getattr(ev, "kind", None) == EventKind.FIRST_TOKEN for ev in result)


def _files(model_dir: str) -> dict[str, str]:
    from cluster.config.serve import ServeConfig
    from cluster.grpc.servicer import GenerationServicer, ServingState
    from cluster.launch.placement import plan_pools
    from cluster.launch.worker_specs import worker_specs
    from cluster.router.pool import WorkerHandle
    from cluster.router.router import Router, RouterConfig
    from decode_worker.worker import DecodeWorker
    from engine.loader import load_tokenizer
    from prefill_worker.worker import PrefillWorker
    from proto.pdserve.v1 import pdserve_pb2 as pb

    seen: dict[str, str] = {}
    recording = threading.Event()
    reserve_gate = threading.Event()  # set: decode's reserve runs (cleared while measured)
    reserve_gate.set()
    handing: set[str] = set()  # worker loops whose step yielded the first token
    done: set[str] = set()  # ... and that handed it off (back to taking commands)

    def profile(frame, event, arg):
        if not recording.is_set():
            return
        name = threading.current_thread().name
        if event == "return" and _yields_first_token(frame, arg):
            handing.add(name)
            return
        if name in handing and frame.f_code.co_name == "_drain_commands":
            done.add(name)  # its next steps race the router for the token: not the path
        # off the path: the decode loop's steps and the KV links run beside it (the first
        # token waits for neither)
        if (event == "call" and not _beside(name) and name not in done
                and frame.f_code.co_filename not in seen):
            back = frame.f_back
            seen[frame.f_code.co_filename] = (
                f"{frame.f_code.co_name} on {name}, called from "
                f"{back.f_code.co_filename.rsplit('/', 2)[-2:]}:{back.f_code.co_name}"
                if back else f"{frame.f_code.co_name} on {name}")

    # every thread from here on (the worker loops, the actor-call pool) is profiled
    threading.setprofile(profile)
    sys.setprofile(profile)
    cfg = ServeConfig.from_dict({"model": {"path": model_dir}, "cache": {"num_blocks": 256}})
    plan = plan_pools(1, 1, device="cpu", gpus_per_worker=0, cpus_per_worker=1,
                      available={"CPU": 2})
    with mock.patch("ray.get_gpu_ids", lambda: []):
        specs = worker_specs(cfg, plan, model_dir, "pdserve-hot")
        workers = [PrefillWorker(specs[0]), DecodeWorker(specs[1])]
    gate_reserve(workers[1], reserve_gate)
    handles = []
    for w, spec in zip(workers, specs, strict=True):
        h = WorkerHandle(spec.worker_id, spec.role, ThreadActor(w))
        h.endpoint, h.num_blocks, h.block_size = w.endpoint(), w.num_blocks, 16
        h.channel = f"{w.channel.host}:{w.channel.port}"  # the per-step control channel
        handles.append(h)
    model = workers[0].cfg.model
    # with the cluster secret, as every deployment: commands and events go over the
    # workers' per-step channels
    router = Router([handles[0]], [handles[1]], RouterConfig(), load_tokenizer(model_dir),
                    model.vocab_size, 1024, model.eos_token_ids,
                    channel_secret=specs[0].transfer.secret)
    servicer = GenerationServicer(router, ServingState())

    async def first_token(rid: str, record: bool) -> None:
        req = pb.GenerateRequest(request_id=rid, token_ids=pb.TokenIds(ids=list(range(1, 40))),
                                 max_tokens=4, temperature=0.0)
        stream = servicer.Generate(req, _Context())
        if record:
            reserve_gate.clear()
            recording.set()
        try:
            await stream.__anext__()
        finally:
            recording.clear()
            reserve_gate.set()
        async for _ in stream:
            pass

    async def quiet() -> None:
        """Wait until the prefill worker holds no leg: the warm-up's KV send is done and
        polled, so none of its leftovers (send records) lands in the measured window."""
        while workers[0].engine.jobs or router.flights:
            await asyncio.sleep(0.01)

    async def run() -> None:
        await first_token("warm-up", record=False)
        await quiet()
        await first_token("measured", record=True)
        await router.shutdown(5)

    try:
        asyncio.run(run())
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        for w in workers:
            w.shutdown()
    ours = {str(Path(f).resolve().relative_to(ROOT)): why for f, why in seen.items()
            if Path(f).resolve().is_relative_to(ROOT)}
    return {f: ours[f] for f in sorted(ours) if f.split("/")[0] in PACKAGES}


def main() -> None:
    from engine.tiny_model import ensure_model

    args = sys.argv[1:]
    files = _files(str(ensure_model("tiny", "llama")))
    if "--by-package" in args:
        by_pkg: dict[str, list[str]] = {}
        for f in files:
            pkg, _, rest = f.partition("/")
            by_pkg.setdefault(pkg, []).append(rest.removesuffix(".py"))
        for pkg, names in by_pkg.items():
            print(f"{pkg}: {' '.join(names)} ({len(names)})")
    else:
        for f, why in files.items():
            print(f"{f}  <- {why}" if "--why" in args else f)
    print(f"{len(files)} files from cluster/grpc/servicer.py to the first streamed token "
          f"({len({f.split('/')[0] for f in files})} packages)")


if __name__ == "__main__":
    main()
