"""Shared shell of the worker actors: an engine driven by a WorkerLoop.

Actors are threaded (`max_concurrency`) so a long-poll `poll()` never blocks `add` or
`abort`. Every actor declares `num_cpus` (cluster.placement) and uses that many torch
threads.
"""

from __future__ import annotations

import os
from typing import Any

import ray
import torch

from cluster.worker_runtime import WorkerLoop
from cluster.worker_spec import WorkerSpec, engine_config
from engine.messages import WorkerEvent
from engine.tracing import TraceRecorder

ACTOR_CONCURRENCY = 8


class WorkerBase:
    def __init__(self, spec: WorkerSpec):
        torch.set_num_threads(max(1, spec.num_threads))
        self.spec = spec
        self.tracer = TraceRecorder(enabled=spec.trace, worker=spec.worker_id)
        # Ray makes the actor's GPU(s) visible as cuda:0..; a 'cuda:N' of the spec is moot
        self.cfg, self.num_blocks = engine_config(spec, ray.get_gpu_ids())
        self.engine: Any = None
        self.loop: WorkerLoop | None = None

    def ready(self) -> dict[str, Any]:
        return {"worker_id": self.spec.worker_id, "role": self.spec.role,
                "num_blocks": self.num_blocks, "block_size": self.cfg.cache.block_size,
                "pid": os.getpid(),
                "endpoint": self.endpoint(), "node_id": ray.get_runtime_context().get_node_id(),
                "device": self.cfg.device, "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def endpoint(self) -> str:
        return ""

    def poll(self, timeout_s: float = 0.05) -> list[WorkerEvent]:
        return self.loop.poll(timeout_s)

    def abort(self, request_id: str) -> bool:
        if self.loop.stopped:  # shut down: nothing runs any more, nothing to abort
            return False
        return self.loop.call(lambda: self.engine.abort(request_id))

    def stats(self) -> dict[str, Any]:
        s = self.loop.call(self.engine.stats)
        s["loop_error"] = self.loop.error or ""
        return s

    def drain_trace(self) -> list[dict]:
        return [e.to_dict() for e in self.tracer.drain()]

    def ping(self) -> str:
        return self.spec.worker_id

    def shutdown(self) -> None:
        if self.loop:
            self.loop.stop()
