"""The prefill pool's Ray actor: a thin shell around PrefillEngine (its hot commands come
over its control channel, runtime/channel.py)."""

from __future__ import annotations

import ray

from kv_transfer.base import KVSender
from kv_transfer.registry import make_sender
from prefill_worker.engine import PrefillEngine
from prefill_worker.scheduler import PrefillSchedulerConfig
from runtime.messages import WorkerLoad
from runtime.spec import WorkerSpec
from runtime.tp_links import GroupSender, HeadSender
from runtime.worker import ACTOR_CONCURRENCY, WorkerBase


def build_engine(spec: WorkerSpec[PrefillSchedulerConfig], cfg, sender: KVSender,
                 num_blocks: int, tracer, tp_group: bool, runner=None) -> PrefillEngine:
    """The worker's engine (on its loop thread); ``runner``: keep another engine's (a role
    switch, cluster/launch/role_worker.py)."""
    t = spec.transfer
    engine = PrefillEngine(spec.worker_id, cfg, spec.scheduler, sender, num_blocks, tracer,
                           layerwise_groups=t.layerwise_groups if t.layerwise else 0,
                           runner=runner)
    # its KV heads to a decode worker of any TP size (runtime/tp_links.py)
    heads = HeadSender(sender, cfg.model.num_kv_heads, cfg.tensor_parallel_size)
    if tp_group:  # a TP group: every rank sends its own heads, rank 0 coordinates
        engine.sender = GroupSender(heads, engine.runner)
    else:  # one rank: only a multi-rank decode worker's chunks are cut by heads
        engine.rank_sender = heads
    return engine


def channel_commands(engine: PrefillEngine, on_loop) -> dict:
    """The prefill role's channel commands (``on_loop`` queues a call on the loop)."""
    return {"add": on_loop(engine.add), "set_decode_pressure": on_loop(
        engine.scheduler.chunk_policy.observe_decode_pressure)}


def load(engine: PrefillEngine) -> WorkerLoad:
    return WorkerLoad(engine.bm.num_used_blocks, 0, len(engine.scheduler.active),
                      len(engine.scheduler.waiting), engine.scheduler.num_outstanding_tokens)


class PrefillWorker(WorkerBase):
    def __init__(self, spec: WorkerSpec[PrefillSchedulerConfig]):
        super().__init__(spec)
        self.sender = make_sender(spec.transfer, **spec.connector_kwargs())
        if self.faults is not None and self.faults.has_kv_faults:
            self.sender.wrap_transports(self.faults.wrap_transport)
        self.start(lambda: build_engine(spec, self.cfg, self.sender, self.num_blocks,
                                        self.tracer, bool(self.ranks)))

    def channel_commands(self) -> dict:
        return {**super().channel_commands(), **channel_commands(self.engine, self.loop.command)}

    def load(self) -> WorkerLoad:
        return load(self.engine)

    def shutdown(self) -> None:
        super().shutdown()
        self.sender.close()


RemotePrefillWorker = ray.remote(max_concurrency=ACTOR_CONCURRENCY)(PrefillWorker)
