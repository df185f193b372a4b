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
