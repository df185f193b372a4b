"""The soak's per-request accounting (a fake gRPC call; the real service runs in
tests/integration/test_soak.py): a cancel that races the final message is no second
terminal status."""

from __future__ import annotations

import asyncio

from bench.soak import SoakConfig, SoakRequest, SoakRunner
from proto.pdserve.v1 import pdserve_pb2 as pb


class _RacingCall:
    """Yields `messages`; once cancelled, the next read raises CancelledError (after
    the messages already buffered, like grpc.aio)."""

    def __init__(self, messages):
        self.messages, self.cancelled = list(messages), False

    def cancel(self) -> bool:
        self.cancelled = True
        return True

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(0.01)  # the cancel timer fires here
        if self.messages:
            return self.messages.pop(0)
        if self.cancelled:
            raise asyncio.CancelledError
        raise StopAsyncIteration


class _Stub:
    def __init__(self, messages):
        self.messages = messages

    def Generate(self, request, metadata=None, timeout=None):  # noqa: N802 (gRPC's name)
        return _RacingCall(self.messages)


def _run(messages, cancel_phase="prefill"):
    runner = SoakRunner(SoakConfig(requests=1))
    req = SoakRequest("r0", "chat", 0.0, (1, 2, 3), 2, 0.0, True,
                      cancel_phase=cancel_phase, cancel_after_s=0.0)

    async def go():
        from tqdm import tqdm

        runner._bar = tqdm(total=1, disable=True)
        await runner._one(_Stub(messages), (), req)

    asyncio.run(go())
    return runner.records["r0"]


def test_a_cancel_racing_the_final_message_counts_one_terminal_status():
    final = pb.GenerateResponse(token_ids=[5, 6], finish_reason=pb.FINISH_REASON_LENGTH)
    rec = _run([final])
    assert rec.cancel_sent and rec.terminal_count == 1
    assert rec.outcome == "finished" and rec.tokens == [5, 6] and not rec.violations


def test_a_cancel_before_any_message_is_one_cancelled_status():
    rec = _run([])
    assert rec.cancel_sent and rec.terminal_count == 1 and rec.outcome == "CANCELLED"


def test_the_pressure_plan_sizes_requests_to_the_pools_and_aims_every_event():
    from bench.soak_plan import ABORT_PHASES, build_plan

    plain = build_plan(SoakConfig(requests=40, seed=5), 1000, 2048)
    assert build_plan(SoakConfig(requests=40, seed=5, abort_rate=0.5), 1000, 2048) == plain
    cfg = SoakConfig(requests=100, seed=5, pressure=True, pool_tokens=384, cancel_rate=0.1,
                     abort_rate=0.25, client_deadline_rate=0.1, reuse_rate=0.1, drain=True)
    plan = build_plan(cfg, 1000, 2048)
    assert build_plan(cfg, 1000, 2048) == plan  # seeded
    for r in plan:  # a prompt fills at most half a pool, a whole request 3/4 of one
        assert len(r.prompt) <= 384 // 2 and len(r.prompt) + r.max_tokens <= 384 * 3 // 4
    aborts = [r.abort_phase for r in plan if r.abort_phase]
    assert sorted(set(aborts)) == sorted(ABORT_PHASES) and len(aborts) == 25
    assert not any(r.abort_phase and r.cancel_phase for r in plan)
    keys = [r.key for r in plan]
    assert len(set(keys)) == len(plan)
    for j, r in enumerate(plan):
        if r.reuses is not None:  # an earlier request's id, each reused once
            i = keys.index(r.reuses)
            assert i < j and plan[i].request_id == r.request_id and not plan[i].after_drain
    assert 5 <= sum(r.reuses is not None for r in plan) <= 10  # some have no earlier one
    assert [r.after_drain for r in plan] == [False] * 90 + [True] * 10
    burst = {r.arrival_s for r in plan[84:90]}  # arrive together just before the drain
    assert len(burst) == 1 and burst.pop() == plan[90].arrival_s - 0.05


class _AbortableCall(_RacingCall):
    """A stream that ends with finish_reason ABORT once the stub's Abort RPC ran."""

    def __init__(self, stub):
        super().__init__([])
        self.stub = stub

    async def __anext__(self):
        await asyncio.sleep(0.01)
        if self.stub.aborted:
            self.stub.aborted = False
            return pb.GenerateResponse(finish_reason=pb.FINISH_REASON_ABORT)
        if self.stub.ended:
            raise StopAsyncIteration
        return pb.GenerateResponse(token_ids=[7])


class _AbortStub:
    def __init__(self):
        self.aborted = self.ended = False

    def Generate(self, request, metadata=None, timeout=None):  # noqa: N802
        return _AbortableCall(self)

    async def Abort(self, request, metadata=None, timeout=None):  # noqa: N802
        self.aborted = self.ended = True
        return pb.AbortResponse(found=True)


def test_an_abort_rpc_at_the_decode_phase_ends_the_stream_aborted_once():
    runner = SoakRunner(SoakConfig(requests=1))
    req = SoakRequest("r0", "chat", 0.0, (1, 2, 3), 8, 0.0, True, abort_phase="decode",
                      cancel_after_tokens=3)

    async def go():
        from tqdm import tqdm

        runner._bar = tqdm(total=1, disable=True)
        await runner._one(_AbortStub(), (), req)

    asyncio.run(go())
    rec = runner.records["r0"]
    assert rec.abort_sent and rec.abort_found and rec.terminal_count == 1
    assert rec.outcome == "aborted" and rec.tokens == [7, 7, 7] and not rec.violations
    assert rec.cancel_observed == "decode" and not rec.cancel_sent


def test_soak_cli_pressure_defaults_and_the_plain_soak_unchanged():
    from bench.soak_cli import config_from_args
    from cluster.cli import build_parser

    parse = build_parser().parse_args
    plain = config_from_args(parse(["soak", "--no-progress"]))
    assert (plain.addr, plain.rate, plain.cancel_rate, plain.mix) == (
        "127.0.0.1:50051", 8.0, 0.3, (0.6, 0.2, 0.2))
    assert not plain.pressure and plain.abort_rate == plain.reuse_rate == 0 and not plain.drain
    own = config_from_args(parse(["soak", "--pressure", "--no-progress"]))
    assert own.pressure and own.drain and own.rate == 3.0 and own.abort_rate == 0.25
    assert (own.cancel_rate, own.client_deadline_rate, own.reuse_rate) == (0.1, 0.1, 0.1)
    remote = config_from_args(parse(["soak", "--pressure", "--addr", "h:1", "--abort-rate",
                                     "0.5", "--pool-tokens", "512", "--no-progress"]))
    assert remote.addr == "h:1" and not remote.drain and remote.abort_rate == 0.5
    assert remote.pool_tokens == 512


class _SlowToCreateStub:
    """Creating the call takes `create_s` (a busy host); the call's deadline runs from its
    creation, as grpc's does, and its first read fails DEADLINE_EXCEEDED once it passed."""

    def __init__(self, create_s: float):
        self.create_s = create_s

    def Generate(self, request, metadata=None, timeout=None):  # noqa: N802 (gRPC's name)
        import time

        import grpc

        ends = time.monotonic() + timeout
        time.sleep(self.create_s)

        class _Call:
            def __aiter__(self):
                return self

            async def __anext__(self):
                await asyncio.sleep(max(ends - time.monotonic(), 0.0))
                raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                           grpc.aio.Metadata(), grpc.aio.Metadata(),
                                           details="Deadline Exceeded")

        return _Call()


def test_a_client_deadline_passed_while_the_call_was_created_is_no_hang():
    runner = SoakRunner(SoakConfig(requests=1))
    req = SoakRequest("r0", "chat", 0.0, (1, 2, 3), 2, 0.0, True, client_deadline_s=0.01)

    async def go():
        from tqdm import tqdm

        runner._bar = tqdm(total=1, disable=True)
        await runner._one(_SlowToCreateStub(create_s=0.03), (), req)

    asyncio.run(go())
    rec = runner.records["r0"]
    assert rec.outcome == "DEADLINE_EXCEEDED" and rec.terminal_count == 1
    assert rec.message == "Deadline Exceeded" and not rec.violations
