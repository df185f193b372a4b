"""The decode pool's Ray actor: a thin shell around DecodeEngine."""

from __future__ import annotations

from typing import Any

import ray

from decode_worker.engine import DecodeEngine
from decode_worker.scheduler import DecodeSchedulerConfig
from kv_transfer.heads import rank_heads
from kv_transfer.registry import make_receiver
from runtime.messages import DecodeTask, WorkerLoad
from runtime.spec import WorkerSpec
from runtime.tp_links import GroupReceiver, join_endpoints
from runtime.worker import ACTOR_CONCURRENCY, WorkerBase, advertised


class DecodeWorker(WorkerBase):
    def __init__(self, spec: WorkerSpec[DecodeSchedulerConfig]):
        super().__init__(spec)
        self.receiver = make_receiver(spec.transfer, **spec.connector_kwargs())

        def build() -> DecodeEngine:  # on the loop thread (runtime.worker.WorkerBase.start)
            engine = DecodeEngine(spec.worker_id, self.cfg, spec.scheduler, self.receiver,
                                  self.num_blocks, self.tracer, faults=self.faults,
                                  early=spec.scheduler.early_kv,
                                  stream_interval=spec.stream_interval)
            if self.ranks:  # a TP group: every rank receives its own heads (runtime/tp_links)
                m = self.cfg.model
                self.receiver.set_head_range(rank_heads(m.num_kv_heads, len(self.ranks) + 1,
                                                        0))
                engine.receiver = GroupReceiver(self.receiver, engine.runner)
            return engine

        self.start(build)
        # a leg waiting on its KV starts on arrival, not at the nap's end: the link's
        # thread wakes the loop itself (no doorbell thread between them)
        self.receiver.set_arrival_hook(self.loop.wake)

    def channel_commands(self) -> dict:
        e = self.engine
        return {**super().channel_commands(), "reserve": self._on_loop(e.reserve),
                "keepalive": self._on_loop(e.keepalive)}

    def load(self) -> WorkerLoad:
        e = self.engine
        return WorkerLoad(e.bm.num_used_blocks, e.scheduler.promised_free_blocks(),
                          len(e.scheduler.running), len(e.scheduler.pending))

    def endpoint(self) -> str:
        """The receiver's address as peers on other nodes can reach it; a TP worker's is
        every rank's, joined in rank order."""
        own = advertised(self.receiver.endpoint)
        return join_endpoints([own, *ray.get([a.endpoint.remote() for a in self.ranks])])

    def reserve(self, task: DecodeTask) -> bool:
        return self.loop.call(lambda: self.engine.reserve(task))

    def keepalive(self, leg_ids: list[str]) -> int:
        return self.loop.call(lambda: self.engine.keepalive(leg_ids))

    def kv_deliver(self, msg: dict, payload: Any = None) -> list:
        """Entry point of the Ray connector: frames arrive as actor calls; returns acks."""
        return self.receiver.deliver(msg, payload)

    def shutdown(self) -> None:
        super().shutdown()
        self.receiver.close()


RemoteDecodeWorker = ray.remote(max_concurrency=ACTOR_CONCURRENCY)(DecodeWorker)
