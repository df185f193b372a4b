"""The gRPC front door: `pdserve.v1.Generation` + grpc.health.v1 + reflection over a RouterAPI.

    server = GenerationServer(router, cfg)      # cfg: ServeConfig (server + limits used)
    address = await server.start()              # "127.0.0.1:50051"
    server.http_url                             # "http://127.0.0.1:8000" with server.http_port
    ...
    await server.stop()                         # drain, then router.shutdown()

or `await serve(router, cfg)` (runs until SIGINT/SIGTERM), or, from synchronous code
(tests, notebooks), `with BackgroundServer(router, cfg) as srv: srv.address`.

With `server.http_port` set, the OpenAI-compatible HTTP API (cluster/http/api.py) is
served by uvicorn on the same event loop, over the same router and ServingState: draining
covers both front doors, and the bearer token and TLS files apply to both.

Health: "" and "pdserve.v1.Generation" are SERVING while the router is healthy (polled
every `health_poll_s`), else (or while draining) NOT_SERVING; no token needed (see
cluster/grpc/auth.py). Graceful stop: NOT_SERVING, new Generate calls get UNAVAILABLE, running
ones get `limits.drain_timeout_s` to finish and are then aborted, the gRPC server stops,
then `router.shutdown()`. `server.api_servers` > 1: cluster/serve/front_doors.py.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cluster.config.serve import ServeConfig
from cluster.grpc.auth import BearerTokenInterceptor, read_token, server_credentials
from cluster.grpc.health import HealthReporter
from cluster.grpc.intake import PromptIntake
from cluster.grpc.servicer import GenerationServicer, ServingState
from cluster.grpc.wire import add_generation
from cluster.http.asgi_server import BindError, HttpServer
from cluster.router.types import RouterAPI
from proto.pdserve.v1 import pdserve_pb2
from runtime.event_loop import running_loop_name
from runtime.gc_pauses import settle

log = logging.getLogger(__name__)

SERVICE_NAME = pdserve_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
# SO_REUSEPORT off: a second server on a busy port must fail, not silently share it
GRPC_OPTIONS = [("grpc.so_reuseport", 0)]
SHARED_PORT_OPTIONS = [("grpc.so_reuseport", 1)]  # server.api_servers > 1: shared on purpose


class GenerationServer:
    """A grpc.aio server over one RouterAPI; start/stop run on the caller's event loop."""

    def __init__(self, router: RouterAPI, cfg: ServeConfig | None = None, *,
                 health_poll_s: float = 0.5):
        self.router = router
        self.cfg = cfg or ServeConfig()
        self.state = ServingState()
        self.health = HealthReporter(router, SERVICE_NAME, lambda: self.state.draining,
                                     health_poll_s)
        self.port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._drain_end = float("inf")
        self._stopped: asyncio.Event | None = None  # created by start() (needs a loop)
        self.http: HttpServer | None = None
        self.servicer: GenerationServicer | None = None
        self.front_doors = None  # cluster.serve.front_doors.FrontDoors of front door 0

    @property
    def address(self) -> str:
        host = self.cfg.server.host
        host = f"[{host}]" if ":" in host and not host.startswith("[") else host  # IPv6
        return f"{host}:{self.port}"

    async def start(self) -> str:
        """Bind and start serving; returns "host:port" (the real port when port was 0)."""
        srv_cfg, limits = self.cfg.server, self.cfg.limits
        interceptors = []
        if srv_cfg.auth_token_file:
            interceptors.append(BearerTokenInterceptor(read_token(srv_cfg.auth_token_file)))
        options = SHARED_PORT_OPTIONS if srv_cfg.api_servers > 1 else GRPC_OPTIONS
        server = grpc.aio.server(interceptors=interceptors, options=options)
        # one intake (size checks, the tokenizer thread) serves both front doors
        self.intake = PromptIntake(self.router, max_prompt_tokens=limits.max_prompt_tokens,
                                   max_prompt_bytes=limits.max_prompt_bytes,
                                   max_logprobs=limits.max_logprobs,
                                   logprobs_mode=self.cfg.model.logprobs_mode)
        servicer = GenerationServicer(self.router, self.state,
                                      request_timeout_s=limits.request_timeout_s,
                                      intake=self.intake)
        self.servicer = servicer
        add_generation(servicer, server)  # (Generate's streamed messages go as bytes)
        health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        host = srv_cfg.host
        bind = f"[{host}]:{srv_cfg.port}" if ":" in host and not host.startswith("[") \
            else f"{host}:{srv_cfg.port}"
        try:
            if srv_cfg.tls_cert:
                creds = server_credentials(srv_cfg.tls_cert, srv_cfg.tls_key)
                self.port = server.add_secure_port(bind, creds)
            else:
                self.port = server.add_insecure_port(bind)
        except RuntimeError as e:
            raise BindError(f"cannot bind gRPC server to {bind}: {e} (port in use?)") from e
        if not self.port:
            raise BindError(f"cannot bind gRPC server to {bind} (port in use?)")
        if srv_cfg.http_port is not None:
            try:
                await self._start_http()
            except BaseException:
                await server.stop(grace=0)
                raise
        await server.start()
        self._server = server
        self._stopped = asyncio.Event()
        await self.health.start()
        log.info("serving %s on %s (tls=%s, auth=%s, loop=%s)", SERVICE_NAME, self.address,
                 bool(srv_cfg.tls_cert), bool(srv_cfg.auth_token_file), running_loop_name())
        return self.address

    @property
    def model_name(self) -> str:
        """The model's name on the HTTP API (server.served_model_name, else model.path)."""
        return self.cfg.server.served_model_name or self.cfg.model.path

    @property
    def http_url(self) -> str | None:
        """Base URL of the OpenAI-compatible API (None without server.http_port)."""
        return self.http.url if self.http is not None else None

    async def _start_http(self) -> None:
        from cluster.http.api import FrontDoorOptions, OpenAIFrontDoor

        srv_cfg, limits = self.cfg.server, self.cfg.limits
        opts = FrontDoorOptions(
            model_name=self.model_name,
            token=read_token(srv_cfg.auth_token_file) if srv_cfg.auth_token_file else None,
            request_timeout_s=limits.request_timeout_s,
            max_prompt_tokens=limits.max_prompt_tokens)
        app = OpenAIFrontDoor(self.router, self.state, opts, self.intake).app()
        http = HttpServer(app, srv_cfg.host, srv_cfg.http_port, ssl_certfile=srv_cfg.tls_cert,
                          ssl_keyfile=srv_cfg.tls_key, log_level=srv_cfg.log_level)
        await http.start()
        self.http = http
        log.info("serving the OpenAI-compatible API on %s/v1", http.url)

    async def stop(self, drain_timeout_s: float | None = None,
                   shutdown_router: bool = True) -> None:
        """Graceful stop: drain, abort stragglers, stop gRPC, shut the router down.

        Idempotent; a second call while draining (e.g. a second Ctrl-C) with
        drain_timeout_s=0 cuts the drain short.
        """
        timeout = self.cfg.limits.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        if self._server is None or self.state.draining:
            self._drain_end = min(self._drain_end, time.monotonic() + timeout)
            if self._stopped is not None:
                await self._stopped.wait()
            return
        self.state.draining = True
        self._drain_end = time.monotonic() + timeout
        await self.health.set(False)
        doors = None if self.front_doors is None else asyncio.ensure_future(
            self.front_doors.stop(timeout))  # the other front doors drain meanwhile
        log.info("draining %d request(s) for up to %.1f s", len(self.state.active), timeout)
        while self.state.active and time.monotonic() < self._drain_end:
            await asyncio.sleep(0.05)
        if self.state.active:
            log.warning("drain timeout: aborting %d request(s)", len(self.state.active))
            for rid in list(self.state.active):
                self.state.mark_aborted(rid)  # their streams end with finish_reason ABORT
                await self.router.abort(rid)
            grace_end = time.monotonic() + 2.0
            while self.state.active and time.monotonic() < grace_end:
                await asyncio.sleep(0.05)
        await self._server.stop(grace=1.0)
        if doors is not None:
            await doors  # before the pools go: their streams run on them
        if self.http is not None:
            await self.http.stop()
        self.health.stop()
        if shutdown_router:
            await self.router.shutdown(max(0.0, self._drain_end - time.monotonic()))
        log.info("server stopped")
        self._stopped.set()

    async def wait_for_termination(self) -> None:
        assert self._stopped is not None, "start() first"
        await self._stopped.wait()


async def serve(router: RouterAPI, cfg: ServeConfig | None = None, *,
                on_ready: Callable[[str], None] | None = None,
                on_started: Callable[[GenerationServer], None] | None = None) -> None:
    """Serve until SIGINT/SIGTERM (main thread) or until the server is stopped; then drain.

    `on_ready(address)` / `on_started(server)` run once every front door listens (with
    `server.api_servers` N > 1, N - 1 more processes share the port)."""
    server = GenerationServer(router, cfg)
    address = await server.start()
    if server.cfg.server.api_servers > 1:
        from cluster.serve.front_doors import start_front_doors

        await start_front_doors(server)
    settle()  # what startup built (torch, tokenizer, pools) stays off the collector, so
    # a full collection walks the requests' objects only
    if on_ready is not None:
        on_ready(address)
    if on_started is not None:
        on_started(server)
    loop = asyncio.get_running_loop()
    stopping: list[asyncio.Task] = []

    def on_signal(sig: signal.Signals) -> None:
        if stopping:  # a second signal: stop now
            log.warning("%s again: stopping without drain", sig.name)
            stopping.append(asyncio.ensure_future(server.stop(drain_timeout_s=0)))
            return
        log.info("%s: draining", sig.name)
        stopping.append(asyncio.ensure_future(server.stop()))

    installed = []
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal, sig)
            installed.append(sig)
    try:
        await server.wait_for_termination()
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        if not server.state.draining:
            await server.stop()


class BackgroundServer:
    """A GenerationServer on its own event-loop thread, for synchronous callers."""

    def __init__(self, router: RouterAPI, cfg: ServeConfig | None = None, **server_kw):
        self.router = router
        self.cfg = cfg or ServeConfig()
        self._server_kw = server_kw
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="pdserve-grpc",
                                        daemon=True)
        self.server: GenerationServer | None = None
        self.address = ""

    def run(self, coro, timeout: float | None = None):
        """Run a coroutine on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> str:
        self._thread.start()
        self.server = GenerationServer(self.router, self.cfg, **self._server_kw)
        self.address = self.run(self.server.start())
        return self.address

    def stop(self, drain_timeout_s: float | None = None, shutdown_router: bool = True) -> None:
        if not self._thread.is_alive():
            return
        try:
            if self.server is not None:
                self.run(self.server.stop(drain_timeout_s, shutdown_router))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
            if not self._thread.is_alive():
                self.loop.close()

    def __enter__(self) -> BackgroundServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
