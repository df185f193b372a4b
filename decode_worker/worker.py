"""The decode pool's Ray actor: a thin shell around DecodeEngine."""

from __future__ import annotations

from typing import Any

import ray

from cluster.faults import worker_fault_injector
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
            faults=worker_fault_injector(spec),  # None unless a test sets a fault plan
        )
        self.loop = WorkerLoop(self.engine)

    def endpoint(self) -> str:
        """The receiver's address as peers on other nodes can reach it."""
        ep = self.receiver.endpoint
        for wildcard in ("0.0.0.0", "[::]"):
            if f"//{wildcard}:" in ep:  # bound to every interface: advertise this node's IP
                ep = ep.replace(wildcard, ray.util.get_node_ip_address())
        return ep

    def reserve(self, task: DecodeTask) -> bool:
        return self.loop.call(lambda: self.engine.reserve(task))

    def keepalive(self, request_ids: list[str]) -> int:
        return self.loop.call(lambda: self.engine.keepalive(request_ids))

    def stats(self) -> dict[str, Any]:
        s = super().stats()
        rx = self.receiver.stats()
        s["kv_checksum_failures"] = rx.get("checksum_failures", 0)
        s["kv_duplicate_frames"] = rx.get("duplicates", 0)
        s["kv_rx_active_requests"] = rx.get("active_requests", 0)
        if self.engine.faults is not None:
            s.update(self.engine.faults.stats())
        return s

    def kv_deliver(self, msg: dict, payload: Any = None) -> list:
        """Entry point of the Ray connector: frames arrive as actor calls; returns acks."""
        return self.receiver.deliver(msg, payload)

    def shutdown(self) -> None:
        super().shutdown()
        self.receiver.close()


RemoteDecodeWorker = ray.remote(max_concurrency=ACTOR_CONCURRENCY)(DecodeWorker)
