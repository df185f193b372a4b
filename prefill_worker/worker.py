"""The prefill pool's Ray actor: a thin shell around PrefillEngine."""

from __future__ import annotations

import ray

from kv_transfer.registry import make_sender
from prefill_worker.engine import PrefillEngine
from prefill_worker.scheduler import PrefillSchedulerConfig
from runtime.messages import PrefillTask, WorkerLoad
from runtime.spec import WorkerSpec
from runtime.tp_links import GroupSender, HeadSender
from runtime.worker import ACTOR_CONCURRENCY, WorkerBase


class PrefillWorker(WorkerBase):
    def __init__(self, spec: WorkerSpec[PrefillSchedulerConfig]):
        super().__init__(spec)
        self.sender = make_sender(spec.transfer, **spec.connector_kwargs())
        if self.faults is not None and self.faults.has_kv_faults:
            self.sender.wrap_transports(self.faults.wrap_transport)
        # its KV heads to a decode worker of any TP size (runtime/tp_links.py)
        heads = HeadSender(self.sender, self.cfg.model.num_kv_heads, self.cfg.tensor_parallel_size)

        def build() -> PrefillEngine:  # on the loop thread (runtime.worker.WorkerBase.start)
            t = spec.transfer
            engine = PrefillEngine(spec.worker_id, self.cfg, spec.scheduler, self.sender,
                                   self.num_blocks, self.tracer,
                                   layerwise_groups=t.layerwise_groups if t.layerwise else 0)
            if self.ranks:  # a TP group: every rank sends its own heads, rank 0 coordinates
                engine.sender = GroupSender(heads, engine.runner)
            else:  # one rank: only a multi-rank decode worker's chunks are cut by heads
                engine.rank_sender = heads
            return engine

        self.start(build)

    def channel_commands(self) -> dict:
        e = self.engine
        return {**super().channel_commands(), "add": self._on_loop(e.add),
                "set_decode_pressure": self._on_loop(
                    e.scheduler.chunk_policy.observe_decode_pressure)}

    def load(self) -> WorkerLoad:
        e = self.engine
        return WorkerLoad(e.bm.num_used_blocks, 0, len(e.scheduler.active),
                          len(e.scheduler.waiting), e.scheduler.num_outstanding_tokens)

    def add(self, task: PrefillTask) -> None:
        self.loop.call(lambda: self.engine.add(task))

    def set_decode_pressure(self, pressure: float) -> None:
        self.loop.call(lambda: self.engine.scheduler.chunk_policy.observe_decode_pressure(pressure))

    def shutdown(self) -> None:
        super().shutdown()
        self.sender.close()


RemotePrefillWorker = ray.remote(max_concurrency=ACTOR_CONCURRENCY)(PrefillWorker)
