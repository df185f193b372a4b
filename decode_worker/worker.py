"""The decode pool's Ray actor: a thin shell around DecodeEngine."""

from __future__ import annotations

from typing import Any

import ray

from cluster.worker_base import ACTOR_CONCURRENCY, WorkerBase
from cluster.worker_runtime import WorkerLoop
from cluster.worker_spec import WorkerSpec, connector_kwargs, decode_sched_config
from engine.messages import DecodeTask


class DecodeWorker(WorkerBase):
    def __init__(self, spec: WorkerSpec):
        super().__init__(spec)
        from decode_worker.engine import DecodeEngine
        from kv_transfer.config import TransferConfig
        from kv_transfer.registry import make_receiver

        self.receiver = make_receiver(TransferConfig(**spec.transfer), **connector_kwargs(spec))
        self.engine = DecodeEngine(
            spec.worker_id, self.cfg,
            decode_sched_config(spec, self.cfg.scheduler.max_model_len),
            self.receiver, self.num_blocks, self.tracer,
        )
        self.loop = WorkerLoop(self.engine)

    def endpoint(self) -> str:
        return self.receiver.endpoint

    def reserve(self, task: DecodeTask) -> bool:
        return self.loop.call(lambda: self.engine.reserve(task))

    def kv_deliver(self, msg: dict, payload: Any = None) -> list:
        """Entry point of the Ray connector: frames arrive as actor calls; returns acks."""
        return self.receiver.deliver(msg, payload)

    def shutdown(self) -> None:
        super().shutdown()
        self.receiver.close()


RemoteDecodeWorker = ray.remote(max_concurrency=ACTOR_CONCURRENCY)(DecodeWorker)
