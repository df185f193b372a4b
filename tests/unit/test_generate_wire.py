"""The streamed common message's hand-written wire bytes are protobuf's own, and the
Generation service registered with bytes-passing Generate still serves every method."""

from __future__ import annotations

import pytest

from cluster.grpc.wire import common_message, id_field, response_bytes
from proto.pdserve.v1 import pdserve_pb2 as pb


@pytest.mark.parametrize("token_ids", [[0], [127], [128], [16383], [16384], [151_935],
                                       [2**31 - 1], [-1], [5, 6, 300], [],
                                       list(range(0, 40_000, 97))])
@pytest.mark.parametrize("text", ["", "a", "héllo ✓ 日本語 \U0001f600", "x" * 20_000])
def test_common_message_is_protobufs_serialization(token_ids, text):
    for rid in ("load-17", "r" * 300):
        want = pb.GenerateResponse(request_id=rid, token_ids=token_ids, text=text)
        got = common_message(id_field(rid), token_ids, text)
        assert got == want.SerializeToString()
        assert pb.GenerateResponse.FromString(got) == want


def test_the_serializer_passes_bytes_and_serializes_messages():
    msg = pb.GenerateResponse(request_id="r", finish_reason=pb.FINISH_REASON_STOP)
    assert response_bytes(msg) == msg.SerializeToString()
    assert response_bytes(b"\x0a\x01r") == b"\x0a\x01r"
