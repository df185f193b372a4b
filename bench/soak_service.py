"""The small-pool service a ``--pressure`` soak runs in its own process.

Both pools get ``num_blocks`` blocks (a few hundred tokens: 2-3 of the pressure plan's
requests fit on each side); the soak then sees the router from inside (exact phases of
every abort, legs of every request), drains the server near the end and checks the
workers afterwards through the router (the drain has stopped gRPC by then).

Against a service of your own, start it with the same pools and point the soak at it:

    pdserve serve --num-blocks 24 --block-size 16 --max-prefill-chunk 64 \\
        --max-num-batched-tokens 128 --connector tcp --request-timeout-s 120 \\
        --kv-wait-timeout-s 30 ...
    pdserve soak --pressure --addr HOST:PORT --model tiny ...   (no drain, client view)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from dataclasses import dataclass
from typing import Any

from bench.soak_probes import SoakHooks, router_leg_probe, router_phase_probe


@dataclass(frozen=True)
class PressureServiceSpec:
    model: str = "tiny"
    num_blocks: int = 24  # per worker, both pools
    block_size: int = 16
    prefill_workers: int = 1
    decode_workers: int = 1
    cpus_per_worker: float = 1.0
    connector: str = "tcp"
    max_prefill_chunk: int = 64
    max_num_batched_tokens: int = 128
    request_timeout_s: float = 120.0
    kv_wait_timeout_s: float = 30.0
    # at least the soak's deadline: a request stuck when the drain starts reaches its
    # deadline (a hang) before the drain would abort it and hide that
    drain_timeout_s: float = 300.0
    fault_injection: dict[str, Any] | None = None  # kv_transfer.faults plan (tests)

    def __post_init__(self) -> None:
        if self.num_blocks < 4 or self.block_size < 1:
            raise ValueError("num_blocks must be >= 4 and block_size >= 1")

    @property
    def pool_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def serve_config(self):
        from cluster.config.serve import ServeConfig

        return ServeConfig.from_dict({
            "model": {"path": self.model, "device": "cpu"},
            "pools": {"prefill_workers": self.prefill_workers,
                      "decode_workers": self.decode_workers,
                      "cpus_per_worker": self.cpus_per_worker},
            "cache": {"num_blocks": self.num_blocks, "block_size": self.block_size},
            "scheduler": {"max_prefill_chunk": self.max_prefill_chunk,
                          "max_num_batched_tokens": self.max_num_batched_tokens},
            "transfer": {"connector": self.connector},
            "limits": {"request_timeout_s": self.request_timeout_s,
                       "kv_wait_timeout_s": self.kv_wait_timeout_s,
                       "drain_timeout_s": self.drain_timeout_s},
            "server": {"port": 0},
        })


class PressureService:
    """The service, its gRPC server on a background loop, and the soak's hooks into it."""

    def __init__(self, spec: PressureServiceSpec) -> None:
        from cluster.launch.launcher import LaunchOptions, build_disaggregated_router
        from cluster.serve.server import BackgroundServer

        self.spec = spec
        cfg = spec.serve_config()
        self.router = build_disaggregated_router(
            cfg, LaunchOptions(fault_injection=spec.fault_injection))
        self.srv = BackgroundServer(self.router, cfg, health_poll_s=0.2)
        self.addr = self.srv.start()
        self._drain: concurrent.futures.Future | None = None

    def hooks(self) -> SoakHooks:
        return SoakHooks(phase_probe=router_phase_probe(self.router, fine=True),
                         leg_probe=router_leg_probe(self.router),
                         start_drain=self.start_drain, stats=self.stats)

    def start_drain(self) -> concurrent.futures.Future:
        """Drain as on SIGTERM, but keep the workers (the soak checks them afterwards);
        returns once the server refuses new requests, with a future of the drain's end."""
        server = self.srv.server
        assert server is not None, "started in __init__"
        self._drain = asyncio.run_coroutine_threadsafe(
            server.stop(self.spec.drain_timeout_s, shutdown_router=False), self.srv.loop)
        while not server.state.draining and not self._drain.done():
            time.sleep(0.002)
        return self._drain

    async def stats(self):
        return await asyncio.wrap_future(
            asyncio.run_coroutine_threadsafe(self.router.stats(), self.srv.loop))

    def close(self) -> None:
        """Stop the server (if no drain did) and the workers."""
        if self._drain is not None:
            self._drain.result(timeout=self.spec.drain_timeout_s + 30)
            self.srv.run(self.router.shutdown(0.0), timeout=60)
        self.srv.stop(drain_timeout_s=0)

    def __enter__(self) -> PressureService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
