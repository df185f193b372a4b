"""WorkerBase: the thin Ray actor shell shared by every worker role (the one module of
runtime/ that imports ray). Its subclasses build an engine and hand it to `start`.

Actors are threaded (`max_concurrency`) so a slow call (stats, a role switch) never
blocks another. Every actor declares `num_cpus` (cluster.launch.placement) and uses that
many torch threads. The calls it answers over Ray are the `runtime.actor.WorkerActor`
protocol.

Every worker serves a control channel (runtime/channel.py, its address in
`WorkerInfo.channel`; with the cluster secret a socket, without one in-process only): the
front doors send the hot commands (`CHANNEL_COMMANDS`) over it and receive one message
per step with every leg's events and the worker's load, with no Ray call per command or
per event.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import ray
import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.device import local_device
from engine.parallel.state import TPGroupError, destroy_group, init_group
from engine.tp_driver import DriverRunner, make_runner, serve_rank
from engine.tracing import TraceRecorder
from kv_transfer.heads import rank_heads
from kv_transfer.registry import make_receiver, make_sender
from runtime.channel import ChannelServer
from runtime.gc_pauses import process_gc_pauses, settle
from runtime.loop import SteppableEngine, WorkerLoop
from runtime.messages import WorkerInfo, WorkerLoad
from runtime.spec import WorkerSpec, resolve_engine, worker_fault_injector
from runtime.stats import EngineStats
from runtime.tp_links import HeadSender, RankLinks

ACTOR_CONCURRENCY = 8
JOIN_TIMEOUT = timedelta(minutes=10)
log = logging.getLogger(__name__)


def advertised(endpoint: str) -> str:
    """`endpoint` as peers on other nodes reach it (a wildcard bind -> this node's IP)."""
    for wildcard in ("0.0.0.0", "[::]"):
        if f"//{wildcard}:" in endpoint:
            endpoint = endpoint.replace(wildcard, ray.util.get_node_ip_address())
    return endpoint


def rank_actor_name(actor_name: str, rank: int) -> str:
    """The Ray actor name of rank `rank` > 0 of worker `actor_name`'s TP group."""
    return f"{actor_name}-rank{rank}"


class WorkerBase:
    def __init__(self, spec: WorkerSpec):
        torch.set_num_threads(max(1, spec.num_threads))
        self.gc_pauses = process_gc_pauses()
        self.spec = spec
        self.tracer = TraceRecorder(enabled=spec.trace, worker=spec.worker_id)
        # Ray makes the actor's GPU(s) visible as cuda:0..; a 'cuda:N' of the spec is moot
        self.cfg, self.num_blocks = resolve_engine(spec.engine, ray.get_gpu_ids())
        self.faults = worker_fault_injector(spec)  # None unless a test sets a fault plan
        self.engine: SteppableEngine | None = None
        self.loop: WorkerLoop | None = None
        self.ranks: list = []  # the other ranks' actors of a tensor-parallel worker
        self._rank_refs: list = []  # their join() calls: they end when a rank dies
        self.channel: ChannelServer | None = None
        if self.cfg.tensor_parallel_size > 1:
            self._start_group()

    def _start_group(self) -> None:
        """Become rank 0 of this worker's TP group: serve the rendezvous store, have each
        rank actor join (its `join` call runs as long as it serves the group), join."""
        size = self.cfg.tensor_parallel_size
        host = ray.util.get_node_ip_address()
        store = dist.TCPStore(host, 0, size, is_master=True, wait_for_workers=False,
                              timeout=JOIN_TIMEOUT)
        self.ranks = [ray.get_actor(rank_actor_name(self.spec.actor_name, r))
                      for r in range(1, size)]
        # a rank whose actor cannot start fails here, by name, not as a rendezvous timeout
        ray.get([a.ping.remote() for a in self.ranks], timeout=JOIN_TIMEOUT.total_seconds())
        self._rank_refs = [a.join.remote(host, store.port, r, self.num_blocks)
                           for r, a in enumerate(self.ranks, start=1)]
        self._store = store  # served for as long as the group lives
        init_group(0, size, store, torch.device(self.cfg.device))

    def _describe_dead_ranks(self) -> str | None:
        done, _ = ray.wait(self._rank_refs, num_returns=len(self._rank_refs), timeout=0)
        dead = []
        for ref in done:
            r = self._rank_refs.index(ref) + 1
            try:
                ray.get(ref)
                dead.append(f"rank {r} left the group")
            except Exception as e:  # noqa: BLE001 - what killed it, for the message
                dead.append(f"rank {r} failed: {type(e).__name__}: {str(e)[:300]}")
        return "; ".join(dead) or None

    def _group_down(self, error: TPGroupError) -> None:
        """A rank died: this group cannot step again. End this actor's process too, so
        Ray restarts it (and it re-forms the group) and the router re-dispatches its
        requests, as for any dead worker."""
        log.error("%s: %s; exiting for a restart", self.spec.worker_id, error)
        logging.shutdown()
        os._exit(70)

    def start(self, build: Callable[[], SteppableEngine], thread_init=None) -> None:
        """Start the worker loop with the engine `build()` makes. The loop thread builds it
        (its runner loads, warms up and records its CUDA graphs on the thread that will
        step it: runtime.loop.WorkerLoop); this returns once it is built."""
        def built() -> SteppableEngine:
            engine = self.engine = build()
            runner = getattr(engine, "runner", None)
            if isinstance(runner, DriverRunner):
                runner.describe_failure = self._describe_dead_ranks
                runner.on_failure = self._group_down
            if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
                settle()  # the process is this actor's own: its startup off the collector
            return engine

        t = self.spec.transfer
        # the channel first, its commands once the engine is built (they are the
        # engine's); no front door reaches it before ready() answers, after this
        self.channel = ChannelServer(
            self.spec.worker_id, self.spec.role, t.secret if t is not None else b"", {},
            host=t.bind_host if t is not None else "127.0.0.1", load=self.load)
        try:
            self.loop = WorkerLoop(build=built, thread_init=thread_init,
                                   on_events=self.channel.publish, every_step=True)
        except BaseException:
            self.channel.close()
            raise
        self.channel.idle = self.loop.idle
        self.channel.set_role(self.spec.role, self.channel_commands())

    def channel_commands(self) -> dict[str, Callable[..., Any]]:
        """Commands the channel runs: each queues its call on the loop (a Future)."""
        return {"abort": self.loop.command(self.engine.abort),
                "hello": lambda: self.spec.worker_id}

    def load(self) -> WorkerLoad:
        """The worker's load (called on the loop thread after each step)."""
        return WorkerLoad()

    def ready(self) -> WorkerInfo:
        if self.loop.fatal is not None:  # a dead engine is not adopted again
            raise RuntimeError(f"worker engine is dead: {self.loop.fatal}")
        return WorkerInfo(
            worker_id=self.spec.worker_id, role=self.spec.role, num_blocks=self.num_blocks,
            block_size=self.cfg.cache.block_size, endpoint=self.endpoint(), pid=os.getpid(),
            node_id=ray.get_runtime_context().get_node_id(), device=self.cfg.device,
            gpu_ids=tuple(str(g) for g in ray.get_gpu_ids()),
            cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
            tp_ranks=(_where(0), *ray.get([a.where.remote() for a in self.ranks]))
            if self.ranks else (),
            channel=self._channel_address())

    def endpoint(self) -> str:
        return ""

    def _channel_address(self) -> str:
        """host:port of the channel as peers on other nodes reach it (its inproc://
        address without a cluster secret)."""
        if self.channel.inproc:
            return self.channel.inproc
        host = self.channel.host
        if host in ("0.0.0.0", "::"):  # every interface: advertise this node's IP
            host = ray.util.get_node_ip_address()
        return f"[{host}]:{self.channel.port}" if ":" in host else f"{host}:{self.channel.port}"

    def stats(self) -> EngineStats:
        s = self.loop.call(self.engine.stats)
        faults = self.faults.stats() if self.faults is not None else {}
        return dataclasses.replace(s, loop_error=self.loop.error or "", faults=faults,
                                   tensor_parallel_size=self.cfg.tensor_parallel_size,
                                   **self.gc_pauses.figures())

    def drain_trace(self) -> list[dict]:
        return [e.to_dict() for e in self.tracer.drain()]

    def ping(self) -> str:
        return self.spec.worker_id

    def shutdown(self) -> None:
        if self.loop:
            self.loop.stop()
        if self.channel is not None:
            self.channel.close()
        runner = getattr(self.engine, "runner", None)
        if isinstance(runner, DriverRunner):  # the loop is stopped: no step in flight
            try:
                runner.stop_ranks()
            except RuntimeError as e:
                log.warning("%s: stopping the TP ranks failed: %s", self.spec.worker_id, e)
            destroy_group()


class TPRank:
    """Rank r > 0 of a tensor-parallel worker: holds its shard of the model and KV cache
    and runs what rank 0 (the worker actor) broadcasts. `join` serves one group until
    rank 0 stops it or the group fails; a restarted rank 0 calls `join` again."""

    def __init__(self, spec: WorkerSpec, rank: int):
        torch.set_num_threads(max(1, spec.num_threads))
        self.spec, self.rank = spec, rank
        device = local_device(spec.engine.device, ray.get_gpu_ids())
        self.cfg: EngineConfig = dataclasses.replace(spec.engine, device=str(device))
        self._serving = threading.Lock()  # one group at a time
        # this rank's own KV link, kept across groups (a decode rank's endpoint is fixed)
        mine = dataclasses.replace(spec, worker_id=f"{spec.worker_id}-rank{rank}",
                                   actor_name=rank_actor_name(spec.actor_name, rank))
        h, tp = self.cfg.model.num_kv_heads, self.cfg.tensor_parallel_size
        if spec.role == "prefill":
            self.links = RankLinks(sender=HeadSender(
                make_sender(spec.transfer, **mine.connector_kwargs()), h, tp, rank))
        else:
            receiver = make_receiver(spec.transfer, **mine.connector_kwargs())
            receiver.set_head_range(rank_heads(h, tp, rank))
            self.links = RankLinks(receiver=receiver)

    def endpoint(self) -> str:
        return advertised(self.links.receiver.endpoint) if self.links.receiver else ""

    def kv_deliver(self, msg: dict, payload: Any = None) -> list:
        """Entry point of the Ray connector (a decode rank's frames)."""
        return self.links.receiver.deliver(msg, payload)

    def join(self, host: str, port: int, rank: int, num_blocks: int) -> None:
        size = self.cfg.tensor_parallel_size
        with self._serving:
            store = dist.TCPStore(host, port, size, is_master=False, timeout=JOIN_TIMEOUT)
            group = init_group(rank, size, store, torch.device(self.cfg.device))
            try:
                runner = make_runner(self.cfg, num_blocks)
                serve_rank(runner, group, self.links.handlers(runner, group))
            finally:
                destroy_group()

    def ping(self) -> str:
        return f"{self.spec.worker_id}/rank{self.rank}"

    def where(self) -> str:
        return _where(self.rank)


def _where(rank: int) -> str:
    """'rank r: pid P on node N, GPUs [..]' of the calling actor (placement reports)."""
    node = ray.get_runtime_context().get_node_id()
    return f"rank {rank}: pid {os.getpid()} on node {node[:12]}, GPUs {ray.get_gpu_ids()}"


RemoteTPRank = ray.remote(max_concurrency=ACTOR_CONCURRENCY)(TPRank)
