"""Front-door scale-out (`pdserve serve --api-servers N`): N processes serve one gRPC port
(SO_REUSEPORT: the kernel spreads connections over them) over the same worker pools.

Front door 0 is the `pdserve serve` process: it starts the pools and then N-1 children
(`python -m cluster.serve.front_door`, cluster/serve/front_door.py), each a Ray driver that looks the
workers up by name and runs its own Router (its own control-channel links, so each
worker sends every front door its own legs' events) and GenerationServer. Placement stays
load-aware: every step message of every worker carries its load to every front door.

Peers: each front door answers two questions over a unix socket in a private (0700)
directory: `abort REQUEST_ID` (an Abort RPC that reached another process than the
request's stream) and `stats` (its in-flight and queued requests, summed by GetStats).
A child exits when its parent dies (its stdin closes) or on SIGTERM (drain first).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import shutil
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

log = logging.getLogger(__name__)
LEN = struct.Struct("!I")
READY_TIMEOUT_S = 300.0
PEER_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ChildSpec:
    """What a child front door needs (sent pickled over its stdin)."""

    index: int
    config: dict  # ServeConfig.to_dict() with server.port = the shared port
    ray_address: str
    namespace: str
    workers: tuple  # (worker_id, role, actor_name, WorkerInfo) per worker
    router_config: Any  # cluster.router.flight.RouterConfig
    channel_secret: bytes
    peers_dir: str


# ---- peers ----------------------------------------------------------------------------
async def _send(writer: asyncio.StreamWriter, obj: Any) -> None:
    body = msgpack.packb(obj)
    writer.write(LEN.pack(len(body)) + body)
    await writer.drain()


async def _recv(reader: asyncio.StreamReader) -> Any:
    (n,) = LEN.unpack(await reader.readexactly(LEN.size))
    return msgpack.unpackb(await reader.readexactly(n))


class PeerServer:
    """Answers the other front doors for this one (its servicer and router)."""

    def __init__(self, path: str, servicer, router):
        self.path, self.servicer, self.router = path, servicer, router
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._server = await asyncio.start_unix_server(self._serve, path=self.path)

    async def _serve(self, reader, writer) -> None:
        try:
            while True:
                op, arg = await _recv(reader)
                if op == "abort":
                    await _send(writer, await self.servicer.abort_local(arg))
                elif op == "stats":
                    await _send(writer, [self.router.num_inflight, self.router.waiting_admission])
                else:
                    await _send(writer, None)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()


class Peers:
    """The other front doors, asked all at once; one that does not answer counts as not
    holding the request (and as having nothing in flight)."""

    def __init__(self, paths: list[str]):
        self.paths = paths
        self._links: dict[str, tuple[asyncio.StreamReader, asyncio.StreamWriter]] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def _ask(self, path: str, op: str, arg: Any = None) -> Any:
        lock = self._locks.setdefault(path, asyncio.Lock())
        async with lock:
            try:
                if path not in self._links:
                    self._links[path] = await asyncio.open_unix_connection(path)
                reader, writer = self._links[path]
                await _send(writer, [op, arg])
                return await asyncio.wait_for(_recv(reader), PEER_TIMEOUT_S)
            except (OSError, asyncio.IncompleteReadError, TimeoutError) as e:
                log.warning("front door %s did not answer %s: %s", path, op, e)
                link = self._links.pop(path, None)
                if link is not None:
                    link[1].close()
                return None

    async def abort(self, request_id: str) -> bool:
        found = await asyncio.gather(*(self._ask(p, "abort", request_id) for p in self.paths))
        return any(bool(f) for f in found)

    async def totals(self) -> tuple[int, int]:
        """(requests in flight, requests waiting for admission) over the peers."""
        got = [g for g in await asyncio.gather(*(self._ask(p, "stats") for p in self.paths))
               if g is not None]
        return sum(g[0] for g in got), sum(g[1] for g in got)

    def close(self) -> None:
        for _, writer in self._links.values():
            writer.close()
        self._links.clear()


def peer_path(peers_dir: str, index: int) -> str:
    return str(Path(peers_dir) / f"fd-{index}.sock")


def attach_peers(server, index: int, count: int, peers_dir: str) -> PeerServer:
    """Make `server` (a started GenerationServer) front door `index` of `count`."""
    server.servicer.peers = Peers([peer_path(peers_dir, i) for i in range(count) if i != index])
    return PeerServer(peer_path(peers_dir, index), server.servicer, server.router)


# ---- the children -----------------------------------------------------------------------
class FrontDoors:
    """Front door 0's view of the others: starts them once it listens, stops them first
    when it drains (they drain too), and serves their peer questions."""

    def __init__(self, cfg, router, count: int):
        if count < 2:
            raise ValueError("FrontDoors is for api_servers >= 2")
        if not hasattr(router, "pump"):
            raise ValueError("server.api_servers > 1 needs the prefill/decode pools (the "
                             "colocated engine runs in one process)")
        self.cfg, self.router, self.count = cfg, router, count
        self.peers_dir = tempfile.mkdtemp(prefix="pdserve-fd-")  # 0700: only we connect
        self.children: list[subprocess.Popen] = []
        self.peer_server: PeerServer | None = None

    def _spec(self, index: int, port: int) -> ChildSpec:
        import ray

        r = self.router
        workers = tuple((w.worker_id, w.role, w.actor_name, w.info) for w in r.workers)
        return ChildSpec(index, self.cfg.with_values({"server.port": port}).to_dict(),
                         ray.get_runtime_context().gcs_address,
                         ray.get_runtime_context().namespace, workers, r.config,
                         r.pump.channel_secret, self.peers_dir)

    async def start(self, server) -> None:
        """Start the children on `server.port`; returns once all of them listen."""
        self.peer_server = attach_peers(server, 0, self.count, self.peers_dir)
        await self.peer_server.start()
        for i in range(1, self.count):
            p = subprocess.Popen([sys.executable, "-m", "cluster.serve.front_door"],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            p.stdin.write(pickle.dumps(self._spec(i, server.port)))
            p.stdin.flush()  # stdin stays open: its EOF tells the child we are gone
            self.children.append(p)
        loop = asyncio.get_running_loop()
        for i, p in enumerate(self.children, 1):
            line = await asyncio.wait_for(loop.run_in_executor(None, p.stdout.readline),
                                          READY_TIMEOUT_S)
            if not line.startswith(b"READY"):
                await self.stop(0)
                raise RuntimeError(f"front door {i} did not start (exit {p.poll()})")

    async def stop(self, drain_timeout_s: float) -> None:
        """SIGTERM every child (each drains for up to `drain_timeout_s`), wait for them."""
        for p in self.children:
            if p.poll() is None:
                p.terminate()
        loop = asyncio.get_running_loop()
        for p in self.children:
            try:
                await loop.run_in_executor(None, p.wait, drain_timeout_s + 30)
            except subprocess.TimeoutExpired:
                p.kill()
            with contextlib.suppress(OSError):
                p.stdin.close()
        self.children.clear()
        if self.peer_server is not None:
            await self.peer_server.stop()
        shutil.rmtree(self.peers_dir, ignore_errors=True)


async def start_front_doors(server) -> None:
    """Start `server.cfg.server.api_servers - 1` more front doors on `server`'s port (it
    listens already); on failure `server` is stopped too."""
    server.front_doors = FrontDoors(server.cfg, server.router, server.cfg.server.api_servers)
    try:
        await server.front_doors.start(server)
    except BaseException:
        await server.stop(drain_timeout_s=0)
        raise
