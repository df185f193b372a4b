"""A pool of colocated engines as Ray actors: the baseline of the interference study.

Each actor runs a whole `engine.LLM` (prefill and decode on one worker, chunked prefill
on or off, as its spec's engine config says) through runtime.colocated.ColocatedEngine,
behind the same actor interface and control channel as the P/D workers (the launcher
gives the pool a cluster secret of its own), so the same Router spreads requests
over them (least outstanding tokens ~ round-robin for equal loads) and the same client
measures both layouts.
"""

from __future__ import annotations

from dataclasses import replace

import ray

from engine.llm import LLM
from runtime.colocated import ColocatedEngine
from runtime.messages import WorkerInfo
from runtime.spec import WorkerSpec
from runtime.worker import ACTOR_CONCURRENCY, WorkerBase


class ColocatedWorker(WorkerBase):
    """One colocated engine; plays both pool roles for the Router."""

    def __init__(self, spec: WorkerSpec[None]):
        super().__init__(spec)
        cfg = replace(self.cfg, cache=replace(self.cfg.cache, num_blocks=self.num_blocks))
        # built on the loop thread, which steps it (runtime.worker.WorkerBase.start)
        self.start(lambda: ColocatedEngine(spec.worker_id, LLM.from_config(cfg)))

    def channel_commands(self) -> dict:
        # the colocated engine admits and preempts on its own: a reserve is always granted
        return {**super().channel_commands(), "add": self.loop.command(self.engine.add),
                "reserve": lambda task: True, "set_decode_pressure": lambda pressure: None}

    def ready(self) -> WorkerInfo:
        return replace(super().ready(), endpoint="colocated")


RemoteColocatedWorker = ray.remote(max_concurrency=ACTOR_CONCURRENCY)(ColocatedWorker)
