"""Wire format: round trips, every rejection path, and fuzzing (only WireError, no hang)."""

from __future__ import annotations

import io
import struct

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv_transfer.base import KVChunk
from kv_transfer.wire import (
    MAGIC,
    PREAMBLE,
    ChecksumError,
    FrameReader,
    Piece,
    WireError,
    decode,
    encode,
    encode_control,
    split_chunk,
)


def _chunk(tokens=5, layers=3, dtype=torch.float32, final=True, start=10) -> KVChunk:
    payload = (torch.arange(layers * 2 * tokens * 2 * 4) % 251).to(dtype).reshape(layers, 2, tokens, 2, 4)
    return KVChunk("req-1", 3, start, start + tokens, payload.contiguous(), is_final=final,
                   first_token=42 if final else None, tenant="t1")


def _frame(chunk: KVChunk, **kw) -> bytes:
    return b"".join(bytes(b) for b in encode(chunk, **kw))


def _reader(data: bytes, **kw) -> FrameReader:
    return FrameReader(io.BytesIO(data).readinto, max_frame_bytes=kw.pop("max_frame_bytes", 1 << 20), **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_round_trip_is_byte_exact_for_each_dtype(dtype):
    c = _chunk(dtype=dtype)
    m = decode(_frame(c))
    h = m.header
    assert (h.request_id, h.seq_no, h.token_start, h.token_end) == ("req-1", 3, 10, 15)
    assert (h.is_final, h.first_token, h.tenant, h.layer_start, h.layer_end) == (True, 42, "t1", 0, 3)
    assert m.payload.dtype == dtype and torch.equal(m.payload, c.payload)


def test_empty_final_chunk_carries_only_the_first_token():
    c = KVChunk("r", 0, 8, 8, torch.empty(4, 2, 0, 2, 4), is_final=True, first_token=9)
    m = decode(_frame(c))
    assert m.payload.shape == (4, 2, 0, 2, 4) and m.header.first_token == 9


def test_streaming_reader_reads_back_to_back_frames_and_controls():
    frames = [_chunk(tokens=t, final=False) for t in (1, 7, 300)]
    data = _frame(frames[0]) + encode_control({"k": "hb"}) + _frame(frames[1]) + _frame(frames[2])
    for buf in (64, 4096, 256 << 10):  # frames straddle the read buffer in every way
        r = _reader(data, buffer_bytes=buf)
        got = [r.read() for _ in range(4)]
        assert [m.kind for m in got] == ["kv", "hb", "kv", "kv"]
        assert torch.equal(got[3].payload, frames[2].payload)
        assert r.read() is None and not r.in_frame


def test_split_pieces_cover_the_chunk_by_layer_then_token():
    c = _chunk(tokens=64, layers=4)
    per_layer = c.nbytes // 4
    by_layer = split_chunk(c, 2 * per_layer)
    assert [(p.chunk.layer_start, p.chunk.layer_end) for p in by_layer] == [(0, 2), (2, 4)]
    assert by_layer[0].chunk.payload.data_ptr() == c.payload.data_ptr()  # a view, no copy
    by_token = split_chunk(c, per_layer // 4)  # 16 of a layer's 64 tokens per frame
    assert len(by_token) == 4 * 4 and all(p.nbytes <= per_layer // 4 for p in by_token)
    assert [p.chunk.is_final for p in by_token].count(True) == 1 and by_token[-1].chunk.is_final
    rebuilt = torch.zeros_like(c.payload)
    for p in by_token:
        s = p.chunk
        rebuilt[s.layer_start : s.layer_end, :, s.token_start - 10 : s.token_end - 10] = s.payload
    assert torch.equal(rebuilt, c.payload)
    assert all(isinstance(p, Piece) and p.num_parts == 16 for p in by_token)


def _mutate_header(frame: bytes, **changes) -> bytes:
    _, _, hlen, plen = PREAMBLE.unpack_from(frame)
    h = msgpack.unpackb(frame[PREAMBLE.size : PREAMBLE.size + hlen])
    h.update(changes)
    hb = msgpack.packb(h)
    return PREAMBLE.pack(MAGIC, 1, len(hb), plen) + hb + frame[PREAMBLE.size + hlen :]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda f: b"XXXX" + f[4:], "bad magic"),
        (lambda f: f[:4] + struct.pack("!H", 9) + f[6:], "unsupported wire version"),
        (lambda f: f[:-1], "short read"),
        (lambda f: f + b"\0", "trailing bytes"),
        (lambda f: f[:-1] + bytes([f[-1] ^ 1]), "checksum mismatch"),
        (lambda f: _mutate_header(f, sh=[3, 2, 6, 2, 4]), "header shape"),
        (lambda f: _mutate_header(f, dt="float64"), "payload length"),
        (lambda f: _mutate_header(f, seq=True), "'seq'"),
        (lambda f: _mutate_header(f, ft=1, fin=False), "first_token"),
        (lambda f: _mutate_header(f, part=2, np=2), "num_parts"),
        (lambda f: f[:6] + struct.pack("!I", 0) + f[10:], "header length"),
    ],
)
def test_untrustworthy_frames_raise_wire_error(mutate, message):
    bad = mutate(_frame(_chunk()))
    with pytest.raises(WireError, match=message):
        decode(bad)


def test_oversized_frame_is_rejected_before_reading_its_payload():
    data = _frame(_chunk(tokens=100))
    with pytest.raises(WireError, match="exceeds the 1000 byte limit"):
        _reader(data[:30], max_frame_bytes=1000).read()  # the payload is not even there


def test_checksum_error_names_the_frame():
    f = _frame(_chunk())
    with pytest.raises(ChecksumError) as e:
        decode(f[:-1] + bytes([f[-1] ^ 0x80]))
    assert e.value.header.key == ("req-1", 3, 0)


_VALID = _frame(_chunk(tokens=3)) + encode_control({"k": "ack", "a": []})


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
def test_fuzz_random_bytes_only_raise_wire_error(data):
    try:
        decode(data, max_frame_bytes=1 << 16)
    except WireError:
        pass
    r = _reader(data, max_frame_bytes=1 << 16, buffer_bytes=64)
    for _ in range(len(data) + 1):  # each read consumes >= 1 byte, so this bounds it
        try:
            if r.read() is None:
                break
        except WireError:
            break


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzz_mutated_valid_frames_only_raise_wire_error(data):
    buf = bytearray(_VALID)
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert", "set"]))
        i = data.draw(st.integers(0, max(0, len(buf) - 1)))
        if op == "flip" and buf:
            buf[i] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "cut":
            del buf[i : i + data.draw(st.integers(1, 16))]
        elif op == "insert":
            buf[i:i] = data.draw(st.binary(min_size=1, max_size=8))
        elif buf:
            buf[i] = data.draw(st.integers(0, 255))
    r = _reader(bytes(buf), buffer_bytes=data.draw(st.sampled_from([32, 4096])))
    for _ in range(len(buf) + 1):
        try:
            m = r.read()
        except WireError:
            break
        if m is None:
            break
        assert m.kind != "kv" or m.payload.numel() * m.payload.element_size() == m.header.payload_nbytes
