"""WorkerBase: the thin Ray actor shell shared by every worker role (the one module of
runtime/ that imports ray). Its subclasses build an engine and hand it to `start`.

Actors are threaded (`max_concurrency`) so a long-poll `poll()` never blocks `add` or
`abort`. Every actor declares `num_cpus` (cluster.placement) and uses that many torch
threads. The calls it answers are the `runtime.actor.WorkerActor` protocol.

A worker with a cluster secret (every P/D worker) also serves a control channel
(runtime/channel.py, its address in `WorkerInfo.channel`): the front doors send the hot
commands (`CHANNEL_COMMANDS`) over it and receive one message per step with every leg's
events and the worker's load, with no Ray call per poll or per command.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import ray
import torch

from engine.tracing import TraceRecorder
from runtime.channel import ChannelServer
from runtime.loop import SteppableEngine, WorkerLoop
from runtime.messages import WorkerEvent, WorkerInfo, WorkerLoad
from runtime.spec import WorkerSpec, resolve_engine, worker_fault_injector
from runtime.stats import EngineStats

ACTOR_CONCURRENCY = 8


class WorkerBase:
    def __init__(self, spec: WorkerSpec):
        torch.set_num_threads(max(1, spec.num_threads))
        self.spec = spec
        self.tracer = TraceRecorder(enabled=spec.trace, worker=spec.worker_id)
        # Ray makes the actor's GPU(s) visible as cuda:0..; a 'cuda:N' of the spec is moot
        self.cfg, self.num_blocks = resolve_engine(spec.engine, ray.get_gpu_ids())
        self.faults = worker_fault_injector(spec)  # None unless a test sets a fault plan
        self.engine: SteppableEngine | None = None
        self.loop: WorkerLoop | None = None
        self.channel: ChannelServer | None = None

    def start(self, engine: SteppableEngine, thread_init=None) -> None:
        self.engine = engine
        secret = self.spec.transfer.secret if self.spec.transfer is not None else b""
        if len(secret) < 16:  # no cluster secret (colocated pool): the router polls
            self.loop = WorkerLoop(engine, thread_init=thread_init)
            return
        host = self.spec.transfer.bind_host
        self.channel = ChannelServer(
            self.spec.worker_id, self.spec.role, secret, self.channel_commands(), host=host,
            load=self.load, idle=lambda: not engine.has_work, unrouted=self._unrouted)
        self.loop = WorkerLoop(engine, thread_init=thread_init, on_events=self.channel.publish,
                               every_step=True)

    def channel_commands(self) -> dict[str, Callable[..., Any]]:
        """Commands the channel runs: each queues its call on the loop (a Future)."""
        return {"abort": self._on_loop(lambda leg_id: self.engine.abort(leg_id)),
                "hello": lambda: self.spec.worker_id}

    def _on_loop(self, fn: Callable[..., Any]) -> Callable[..., Future]:
        return lambda *args: self.loop.submit(lambda: fn(*args))

    def load(self) -> WorkerLoad:
        """The worker's load (called on the loop thread after each step)."""
        return WorkerLoad()

    def _unrouted(self, events: list[WorkerEvent]) -> None:
        self.loop._to_outbox(events)  # legs a router added over Ray: it polls for them

    def ready(self) -> WorkerInfo:
        if self.loop.fatal is not None:  # a dead engine is not adopted again
            raise RuntimeError(f"worker engine is dead: {self.loop.fatal}")
        return WorkerInfo(
            worker_id=self.spec.worker_id, role=self.spec.role, num_blocks=self.num_blocks,
            block_size=self.cfg.cache.block_size, endpoint=self.endpoint(), pid=os.getpid(),
            node_id=ray.get_runtime_context().get_node_id(), device=self.cfg.device,
            gpu_ids=tuple(str(g) for g in ray.get_gpu_ids()),
            cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
            channel=self._channel_address())

    def endpoint(self) -> str:
        return ""

    def _channel_address(self) -> str:
        """host:port of the channel as peers on other nodes reach it ("" if none)."""
        if self.channel is None:
            return ""
        host = self.channel.host
        if host in ("0.0.0.0", "::"):  # every interface: advertise this node's IP
            host = ray.util.get_node_ip_address()
        return f"[{host}]:{self.channel.port}" if ":" in host else f"{host}:{self.channel.port}"

    def poll(self, timeout_s: float = 0.05) -> list[WorkerEvent]:
        return self.loop.poll(timeout_s)

    def abort(self, leg_id: str) -> bool:
        if self.loop.stopped:  # shut down: nothing runs any more, nothing to abort
            return False
        return self.loop.call(lambda: self.engine.abort(leg_id))

    def stats(self) -> EngineStats:
        s = self.loop.call(self.engine.stats)
        faults = self.faults.stats() if self.faults is not None else {}
        return dataclasses.replace(s, loop_error=self.loop.error or "", faults=faults)

    def drain_trace(self) -> list[dict]:
        return [e.to_dict() for e in self.tracer.drain()]

    def ping(self) -> str:
        return self.spec.worker_id

    def shutdown(self) -> None:
        if self.loop:
            self.loop.stop()
        if self.channel is not None:
            self.channel.close()
