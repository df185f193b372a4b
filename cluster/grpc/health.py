"""grpc.health.v1 for the gRPC front door (cluster/serve/server.py).

"" and "pdserve.v1.Generation" are SERVING while the router is healthy (polled every
`poll_s`) and the server is not draining, else NOT_SERVING. Each change is logged once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from grpc_health.v1 import health, health_pb2

from cluster.router.types import RouterAPI

log = logging.getLogger("cluster.serve.server")
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthReporter:
    def __init__(self, router: RouterAPI, service_name: str, draining: Callable[[], bool],
                 poll_s: float = 0.5):
        self.router = router
        self.names = ("", service_name)
        self.draining = draining
        self.poll_s = poll_s
        self.servicer = health.aio.HealthServicer()  # added to the grpc server
        self._status: int | None = None
        self._poller: asyncio.Task | None = None

    def router_healthy(self) -> bool:
        try:
            return bool(self.router.healthy())
        except Exception:
            log.exception("router.healthy() raised; reporting NOT_SERVING")
            return False

    async def set(self, serving: bool) -> None:
        status = SERVING if serving else NOT_SERVING
        if status == self._status:
            return
        self._status = status
        for name in self.names:
            await self.servicer.set(name, status)
        log.log(logging.INFO if serving else logging.WARNING, "health: %s",
                health_pb2.HealthCheckResponse.ServingStatus.Name(status))

    async def start(self) -> None:
        """Report now, then keep polling (until stop())."""
        await self.set(self.router_healthy())
        self._poller = asyncio.create_task(self._poll(), name="pdserve-health")

    async def _poll(self) -> None:
        while True:
            await self.set(not self.draining() and self.router_healthy())
            await asyncio.sleep(self.poll_s)

    def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
