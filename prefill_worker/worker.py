"""The prefill pool's Ray actor: a thin shell around PrefillEngine."""

from __future__ import annotations

from typing import Any

import ray

from cluster.faults import worker_fault_injector
from cluster.worker_base import ACTOR_CONCURRENCY, WorkerBase
from cluster.worker_runtime import WorkerLoop
from cluster.worker_spec import WorkerSpec, connector_kwargs, prefill_sched_config
from engine.messages import PrefillTask


class PrefillWorker(WorkerBase):
    def __init__(self, spec: WorkerSpec):
        super().__init__(spec)
        from kv_transfer.config import TransferConfig
        from kv_transfer.registry import make_sender
        from prefill_worker.engine import PrefillEngine

        self.sender = make_sender(TransferConfig(**spec.transfer), **connector_kwargs(spec))
        self.faults = worker_fault_injector(spec)  # None unless a test sets a fault plan
        if self.faults is not None and self.faults.has_kv_faults:
            self.sender.wrap_transports(self.faults.wrap_transport)
        self.engine = PrefillEngine(spec.worker_id, self.cfg, prefill_sched_config(spec),
                                    self.sender, self.num_blocks, self.tracer)
        self.loop = WorkerLoop(self.engine)

    def add(self, task: PrefillTask) -> None:
        self.loop.call(lambda: self.engine.add(task))

    def set_decode_pressure(self, pressure: float) -> None:
        self.loop.call(lambda: self.engine.scheduler.chunk_policy.observe_decode_pressure(pressure))

    def stats(self) -> dict[str, Any]:
        s = super().stats()
        if self.faults is not None:
            s.update(self.faults.stats())
        return s

    def shutdown(self) -> None:
        super().shutdown()
        self.sender.close()


RemotePrefillWorker = ray.remote(max_concurrency=ACTOR_CONCURRENCY)(PrefillWorker)
