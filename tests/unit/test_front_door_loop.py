"""runtime/event_loop.py: the front door's event loop by name (server.event_loop),
and the whole gRPC front door (streams, health, Abort, drain) on uvloop."""

from __future__ import annotations

import pytest

from cluster.config.serve import ServeConfig
from cluster.grpc.client import AsyncPdserveClient
from cluster.serve.server import GenerationServer
from runtime.event_loop import EVENT_LOOPS, resolve, run, running_loop_name
from tests.unit.test_front_door import FakeRouter


def test_names_resolve_and_an_unknown_one_is_refused() -> None:
    assert resolve("asyncio") == "asyncio"
    assert resolve("auto") in ("uvloop", "asyncio")
    with pytest.raises(ValueError, match="unknown event loop 'trio'.*auto, uvloop, asyncio"):
        resolve("trio")
    assert ServeConfig().server.event_loop == "auto"
    with pytest.raises(ValueError, match="event_loop"):
        ServeConfig().with_values({"server.event_loop": "trio"})
    assert set(EVENT_LOOPS) == {"auto", "uvloop", "asyncio"}


async def _loop_name() -> str:
    return running_loop_name()


@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])
def test_run_uses_the_named_loop(kind: str) -> None:
    if kind == "uvloop":
        pytest.importorskip("uvloop")
    assert run(_loop_name(), kind) == kind


def test_grpc_front_door_streams_aborts_and_drains_on_uvloop() -> None:
    pytest.importorskip("uvloop")
    router = FakeRouter()
    cfg = ServeConfig().with_values({"server.port": 0, "server.event_loop": "uvloop"})

    async def main() -> tuple[str, list, str, bool, list[str]]:
        server = GenerationServer(router, cfg, health_poll_s=0.02)
        address = await server.start()
        async with AsyncPdserveClient(address) as client:
            chunks = [c async for c in client.generate("héllo ✓", request_id="r1")]
            health = await client.health()
            hung = client.generate("hang", request_id="r2")
            first = await hung.__anext__()  # the request is in flight now
            found = await client.abort("r2")
            rest = [c async for c in hung]
        await server.stop(drain_timeout_s=0)
        return running_loop_name(), chunks, health, found, [first.text] + [
            c.finish_reason for c in rest]

    loop, chunks, health, found, hung = run(main(), cfg.server.event_loop)
    assert loop == "uvloop"
    assert "".join(c.text for c in chunks) == "héllo ✓"
    assert [t for c in chunks for t in c.token_ids] == list("héllo ✓".encode())
    assert chunks[-1].finish_reason == "stop"
    assert health == "SERVING"
    assert found and hung == ["A", "abort"]
    assert router.aborted == ["r2"] and router.shut_down
