"""The gRPC bench client's record building (bench/client.py) against tiny fake streams."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from bench.client import build_record, collect, run_requests
from bench.metrics import compute_metrics
from bench.workload import WorkloadRequest
from cluster.grpc.client import Chunk
from cluster.router.types import Usage

USAGE = Usage(prompt_tokens=4, completion_tokens=3, queue_s=0.01, prefill_s=0.02,
              transfer_s=0.003, decode_s=0.04)


def req(rid: str = "r0", arrival: float = 0.0, n: int = 3, **kw: object) -> WorkloadRequest:
    return WorkloadRequest(rid, arrival, [5, 6, 7, 8], n, **kw)  # type: ignore[arg-type]


class Clock:
    """A clock that ticks by ``step`` on every read: arrival times are known exactly."""

    def __init__(self, start: float = 100.0, step: float = 0.5):
        self.now, self.step = start, step

    def __call__(self) -> float:
        t, self.now = self.now, self.now + self.step
        return t


async def stream(chunks: list[Chunk], error: grpc.RpcError | None = None):
    for c in chunks:
        await asyncio.sleep(0)
        yield c
    if error is not None:
        raise error


def test_record_gives_each_token_its_chunk_arrival_and_the_usage_phases() -> None:
    timed = [(101.0, Chunk("r0", (1,), "a")), (101.5, Chunk("r0", (2, 3), "bc")),
             (102.0, Chunk("r0", (), "", finish_reason="length", usage=USAGE))]
    r = build_record(req(tenant="gold", kind="long"), 100.0, timed)
    assert r.token_times == (101.0, 101.5, 101.5)  # a 2-token burst arrives together
    assert r.end_time == 102.0 and r.n_out == 3
    assert r.ttft == pytest.approx(1.0) and r.e2el == pytest.approx(2.0)
    assert r.success and r.finish_reason == "length" and r.error == ""
    assert (r.queue_s, r.prefill_s, r.transfer_s, r.decode_s) == (0.01, 0.02, 0.003, 0.04)
    assert (r.tenant, r.kind, r.prompt_len) == ("gold", "long", 4)


@pytest.mark.parametrize("chunks,why", [
    ([Chunk("r0", (1,), "a"), Chunk("r0", (), "", finish_reason="abort")], "abort"),
    ([Chunk("r0", (1,), "a")], "without a finish reason"),
    ([], "without a finish reason"),
])
def test_streams_that_do_not_finish_cleanly_are_failures(chunks, why) -> None:
    r = build_record(req(), 0.0, [(1.0 + i, c) for i, c in enumerate(chunks)])
    assert not r.success and why in r.error
    assert r.queue_s is None or chunks  # no usage without a final chunk


def test_collect_stamps_chunks_and_turns_rpc_errors_into_messages() -> None:
    err = grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(),
                               grpc.aio.Metadata(), details="queue is full")
    chunks, error = asyncio.run(collect(stream([Chunk("r0", (1,), "a")], err), Clock()))
    assert [t for t, _ in chunks] == [100.0] and error == "RESOURCE_EXHAUSTED: queue is full"
    r = build_record(req(), 99.0, chunks, error)
    assert not r.success and r.token_times == (100.0,) and r.error.startswith("RESOURCE")


class FakeClient:
    """generate() like AsyncPdserveClient: n tokens, one chunk each, then a final chunk."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []

    def generate(self, prompt, **kw):
        self.calls.append((kw["request_id"], kw))
        n = kw["max_tokens"]
        chunks = [Chunk(kw["request_id"], (i,), str(i)) for i in range(n)]
        chunks.append(Chunk(kw["request_id"], (), "", "length", USAGE))
        return stream(chunks)


def test_run_requests_sends_greedy_exact_length_requests_and_keeps_input_order() -> None:
    client = FakeClient()
    reqs = [req(f"r{i}", 0.0, n=i + 1, tenant="free", ttft_deadline_ms=500.0) for i in range(3)]
    done: list[str] = []
    records = asyncio.run(run_requests(client, reqs, on_done=lambda r: done.append(r.request_id)))
    assert [r.request_id for r in records] == ["r0", "r1", "r2"]
    assert [r.n_out for r in records] == [1, 2, 3] and all(r.success for r in records)
    assert sorted(done) == ["r0", "r1", "r2"]
    kw = client.calls[0][1]
    assert kw["temperature"] == 0.0 and kw["ignore_eos"] is True
    assert (kw["tenant"], kw["ttft_deadline_ms"]) == ("free", 500.0)
    m = compute_metrics(records)  # the same metrics code as the in-process driver
    assert m.completed == 3 and m.total_output_tokens == 6 and "prefill" in m.phases


def test_max_concurrency_one_serialises_requests() -> None:
    records = asyncio.run(run_requests(FakeClient(), [req(f"r{i}", n=2) for i in range(4)],
                                       max_concurrency=1))
    ordered = sorted(records, key=lambda r: r.send_time)
    for a, b in zip(ordered, ordered[1:], strict=False):
        assert b.send_time >= a.end_time  # the next one is sent only after one ended
    with pytest.raises(ValueError, match="max_concurrency"):
        asyncio.run(run_requests(FakeClient(), [req()], max_concurrency=0))
