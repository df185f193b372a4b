"""Local Ray for integration tests (one session for the whole run) and a router runner."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import pytest

from cluster.router.types import GenerateSpec, RouterError


@pytest.fixture(scope="session")
def ray_session():
    import ray

    if not ray.is_initialized():
        # 4 logical CPUs on a 2-core machine so 2P+2D pools (1 CPU each) can be placed
        ray.init(num_cpus=4, num_gpus=0, include_dashboard=False, namespace="pdserve-tests",
                 configure_logging=False, log_to_driver=False)
    yield ray
    ray.shutdown()


class RouterRunner:
    """Owns a router and the one event loop (in a thread) that all its calls run on."""

    def __init__(self, router):
        self.router = router
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def generate(self, spec: GenerateSpec, timeout: float = 120) -> tuple[list[int], object]:
        """All tokens and the last delta (or the RouterError raised)."""

        async def go():
            toks, last = [], None
            try:
                async for d in self.router.generate(spec):
                    toks += d.token_ids
                    last = d
            except RouterError as e:
                return toks, e
            return toks, last

        return self.run(go(), timeout)

    def generate_many(self, specs: list[GenerateSpec], timeout: float = 300):
        async def go():
            async def one(spec):
                toks, last = [], None
                try:
                    async for d in self.router.generate(spec):
                        toks += d.token_ids
                        last = d
                except RouterError as e:
                    return toks, e
                return toks, last

            return await asyncio.gather(*(one(s) for s in specs))

        return self.run(go(), timeout)

    def stats(self):
        return self.run(self.router.stats())

    def wait_quiescent(self, timeout: float = 30) -> object:
        """Poll stats until every worker reports no blocks used and empty queues."""
        end = time.monotonic() + timeout
        while True:
            st = self.stats()
            idle = all(
                w.kv_blocks_used == 0 and w.num_running == 0 and w.num_waiting == 0
                and w.extra.get("jobs", 0) == 0 for w in st.workers if w.alive
            ) and st.num_inflight == 0
            if idle or time.monotonic() > end:
                return st
            time.sleep(0.2)

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        try:
            self.run(self.router.shutdown(2.0), timeout=60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5)


def _router_factory(tiny_model):
    """A `start(overrides, launch_options) -> RouterRunner` and the runners it started."""
    import ray

    from cluster.config.serve import ServeConfig
    from cluster.launch.launcher import LaunchOptions, build_disaggregated_router

    runners: list[RouterRunner] = []

    def start(overrides: dict | None = None, opts: LaunchOptions | None = None) -> RouterRunner:
        data = {"model": {"path": str(tiny_model), "device": "cpu"},
                "pools": {"cpus_per_worker": 1.0}}
        for section, values in (overrides or {}).items():
            data.setdefault(section, {}).update(values)
        cfg = ServeConfig.from_dict(data)
        p = cfg.pools
        need = (p.prefill_workers + p.decode_workers) * p.cpus_per_worker
        # a killed actor's CPUs come back a moment after ray.kill; past that, fail naming
        # the cause instead of waiting out the launcher's placement timeout
        end = time.monotonic() + 30
        while (free := ray.available_resources().get("CPU", 0.0)) < need \
                and time.monotonic() < end:
            time.sleep(0.2)
        assert free >= need, (f"the test Ray has {free:g} CPUs free, this router needs "
                              f"{need:g}: an earlier test leaked its worker actors")
        runner = RouterRunner(build_disaggregated_router(cfg, opts))
        runners.append(runner)
        return runner

    return start, runners


def _close_all(runners: list[RouterRunner]) -> None:
    for r in runners:
        try:
            r.close()
        except Exception:
            pass


@pytest.fixture
def start_router(ray_session, tiny_model) -> Callable[..., RouterRunner]:
    """start_router({'transfer': {...}}, launch_options) -> a RouterRunner, closed when the
    test ends (its worker actors are killed and their CPUs freed)."""
    start, runners = _router_factory(tiny_model)
    yield start
    _close_all(runners)


@pytest.fixture(scope="module")
def start_module_router(ray_session, tiny_model) -> Callable[..., RouterRunner]:
    """Like start_router, for module-scoped fixtures: closed when the module ends."""
    start, runners = _router_factory(tiny_model)
    yield start
    _close_all(runners)
