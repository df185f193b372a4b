"""The Generate stream's common message as wire bytes, and the Generation service's
registration that lets Generate send them as they are.

After its first message, a request's tokens stream as GenerateResponse(request_id,
token_ids, text) only (cluster/grpc/servicer.py's StreamWriter writes them): `common_message`
writes the bytes protobuf would write for it, byte for byte, without building a message
(the request id's field is encoded once per request, `id_field`), and `response_bytes`,
Generate's response serializer, passes bytes through and serializes any other message.
"""

from __future__ import annotations

import grpc

from proto.pdserve.v1 import pdserve_pb2 as pb

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name


def varint(n: int) -> bytes:
    if n < 0:  # (an int32 field's negative value takes ten bytes)
        n += 1 << 64
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_SMALL = 1 << 14
_VARINTS = [varint(n) for n in range(_SMALL)]  # one or two bytes: most ids and lengths


def id_field(request_id: str) -> bytes:
    """GenerateResponse.request_id (field 1) on the wire."""
    b = request_id.encode()
    return b"\x0a" + varint(len(b)) + b


def common_message(id_bytes: bytes, token_ids: list[int], text: str) -> bytes:
    """GenerateResponse(request_id, token_ids, text) serialized; `id_bytes`: id_field()."""
    v = _VARINTS
    ids = b"".join([v[t] if 0 <= t < _SMALL else varint(t) for t in token_ids])
    out = [id_bytes]
    if ids:  # token_ids (field 2, packed)
        out += (b"\x12", v[len(ids)] if len(ids) < _SMALL else varint(len(ids)), ids)
    if text:  # text (field 3)
        t = text.encode()
        out += (b"\x1a", v[len(t)] if len(t) < _SMALL else varint(len(t)), t)
    return b"".join(out)


def response_bytes(message) -> bytes:
    """Generate's response serializer: a message, or its wire bytes as they are."""
    return message if message.__class__ is bytes else message.SerializeToString()


def add_generation(servicer, server: grpc.aio.Server) -> None:
    """pdserve_pb2_grpc.add_GenerationServicer_to_server, with `response_bytes` as
    Generate's serializer."""
    unary = grpc.unary_unary_rpc_method_handler
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, pb.GenerateRequest.FromString, response_bytes),
        "Abort": unary(servicer.Abort, pb.AbortRequest.FromString,
                       pb.AbortResponse.SerializeToString),
        "GetStats": unary(servicer.GetStats, pb.GetStatsRequest.FromString,
                          pb.GetStatsResponse.SerializeToString),
        "GetModelInfo": unary(servicer.GetModelInfo, pb.GetModelInfoRequest.FromString,
                              pb.ModelInfo.SerializeToString),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
