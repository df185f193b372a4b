"""The decode pool's Ray actor: a thin shell around DecodeEngine (its hot commands come
over its control channel, runtime/channel.py)."""

from __future__ import annotations

from typing import Any

import ray

from decode_worker.engine import DecodeEngine
from decode_worker.scheduler import DecodeSchedulerConfig
from kv_transfer.base import KVReceiver
from kv_transfer.heads import rank_heads
from kv_transfer.registry import make_receiver
from runtime.messages import WorkerLoad
from runtime.spec import WorkerSpec
from runtime.tp_links import GroupReceiver, join_endpoints
from runtime.worker import ACTOR_CONCURRENCY, WorkerBase, advertised


def build_engine(spec: WorkerSpec[DecodeSchedulerConfig], cfg, receiver: KVReceiver,
                 num_blocks: int, tracer, faults, tp_size: int, runner=None) -> DecodeEngine:
    """The worker's engine (on its loop thread); ``runner``: keep another engine's (a role
    switch, cluster/launch/role_worker.py)."""
    engine = DecodeEngine(spec.worker_id, cfg, spec.scheduler, receiver, num_blocks, tracer,
                          faults=faults, early=spec.scheduler.early_kv,
                          stream_interval=spec.stream_interval, runner=runner)
    if tp_size > 1:  # a TP group: every rank receives its own heads (runtime/tp_links)
        receiver.set_head_range(rank_heads(cfg.model.num_kv_heads, tp_size, 0))
        engine.receiver = GroupReceiver(receiver, engine.runner)
    return engine


def channel_commands(engine: DecodeEngine, on_loop) -> dict:
    """The decode role's channel commands (``on_loop`` queues a call on the loop)."""
    return {"reserve": on_loop(engine.reserve), "keepalive": on_loop(engine.keepalive)}


def load(engine: DecodeEngine) -> WorkerLoad:
    return WorkerLoad(engine.bm.num_used_blocks, engine.scheduler.promised_free_blocks(),
                      len(engine.scheduler.running), len(engine.scheduler.pending))


class DecodeWorker(WorkerBase):
    def __init__(self, spec: WorkerSpec[DecodeSchedulerConfig]):
        super().__init__(spec)
        self.receiver = make_receiver(spec.transfer, **spec.connector_kwargs())
        self.start(lambda: build_engine(spec, self.cfg, self.receiver, self.num_blocks,
                                        self.tracer, self.faults, len(self.ranks) + 1))
        # a leg waiting on its KV starts on arrival, not at the nap's end: the link's
        # thread wakes the loop itself (no doorbell thread between them)
        self.receiver.set_arrival_hook(self.loop.wake)

    def channel_commands(self) -> dict:
        return {**super().channel_commands(), **channel_commands(self.engine, self.loop.command)}

    def load(self) -> WorkerLoad:
        return load(self.engine)

    def endpoint(self) -> str:
        """The receiver's address as peers on other nodes can reach it; a TP worker's is
        every rank's, joined in rank order."""
        own = advertised(self.receiver.endpoint)
        return join_endpoints([own, *ray.get([a.endpoint.remote() for a in self.ranks])])

    def kv_deliver(self, msg: dict, payload: Any = None) -> list:
        """Entry point of the Ray connector: frames arrive as actor calls; returns acks."""
        return self.receiver.deliver(msg, payload)

    def shutdown(self) -> None:
        super().shutdown()
        self.receiver.close()


RemoteDecodeWorker = ray.remote(max_concurrency=ACTOR_CONCURRENCY)(DecodeWorker)
