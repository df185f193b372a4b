"""Run an ASGI app with uvicorn on the caller's event loop (next to the gRPC server).

    http = HttpServer(app, host="127.0.0.1", port=0)
    port = await http.start()        # bound before start() returns; 0 = ephemeral
    ...
    await http.stop()

The socket is bound here (no SO_REUSEPORT: a busy port fails instead of being shared), so
bind errors surface at once as BindError. uvicorn's own signal handling is off: the
process's SIGINT/SIGTERM belong to `cluster.serve.server.serve`, which drains both front doors.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import uvicorn

log = logging.getLogger(__name__)


class BindError(RuntimeError):
    """A front door could not bind its address (port in use, bad host)."""


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield  # signals are cluster.serve.server.serve()'s: it drains, then stops us


def bind_socket(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        raise BindError(f"cannot bind the HTTP server to {host}:{port}: {e.strerror or e}"
                        " (port in use?)") from e
    sock.setblocking(False)
    return sock


class HttpServer:
    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, *,
                 ssl_certfile: str | None = None, ssl_keyfile: str | None = None,
                 log_level: str = "warning"):
        self.app, self.host, self.requested_port = app, host, port
        self.ssl = (ssl_certfile, ssl_keyfile)
        self.log_level = log_level
        self.port: int | None = None
        self._server: _Server | None = None
        self._task: asyncio.Task | None = None

    @property
    def scheme(self) -> str:
        return "https" if self.ssl[0] else "http"

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    async def start(self) -> int:
        sock = bind_socket(self.host, self.requested_port)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app, log_config=None, log_level=self.log_level, access_log=False,
            lifespan="off", ssl_certfile=self.ssl[0], ssl_keyfile=self.ssl[1],
            timeout_graceful_shutdown=2, timeout_keep_alive=5)
        try:
            config.load()  # TLS files are read here: their errors raise now, not in the task
        except Exception:
            sock.close()
            raise
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]),
                                         name="pdserve-http")
        while not self._server.started:
            if self._task.done():  # failed during startup
                sock.close()
                exc = self._task.exception()
                raise BindError(f"the HTTP server failed to start on {self.url}: {exc}")
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self) -> None:
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        try:
            await self._task
        except Exception:
            log.exception("the HTTP server stopped with an error")
        self._server = self._task = None
