"""KV frame format (DESIGN §4): preamble + msgpack header + raw payload.

    offset 0   4s  magic b"PDKV"
           4   u16 version
           6   u32 header length  (<= MAX_HEADER_BYTES)
           10  u64 payload length (preamble + header + payload <= max_frame_bytes)
           18  msgpack header: {"k": "kv", rid, seq, part, np, ts, te, ls, le, dt, sh,
                                fin, ft, ten, cs, ca, tx, hs, he, hn}
                                or a control message {"k": ...}
           ..  payload bytes, layout [layers, 2(K,V), tokens, kv_heads, head_dim]

Decoding never trusts a size: every limit is checked before anything is allocated and
every failure is a ``WireError`` naming what was wrong. Control messages (handshake,
acks, heartbeats) use the same framing with an empty payload.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from kv_transfer.frames import Piece
from kv_transfer.wire_header import FrameHeader, WireError

MAGIC = b"PDKV"
VERSION = 1
PREAMBLE = struct.Struct("!4sHIQ")  # magic, version, header length, payload length
MAX_HEADER_BYTES = 16 << 10
DIRECT_RECV_MIN = 64 << 10  # payload remainders at least this big skip the read buffer
RECV_STEP = 256 << 10  # bytes per direct recv: stays in L2 for hashing right after

CHECKSUM_FUNCS: dict[str, Any] = {"crc32": zlib.crc32, "adler32": zlib.adler32}
try:  # optional: XXH3 hashes ~5x faster than zlib's crc32, which bounds TCP throughput
    import xxhash

    CHECKSUM_FUNCS["xxh3_64"] = xxhash.xxh3_64_intdigest
except ImportError:  # pragma: no cover - depends on the environment
    pass


def resolve_checksum(name: str) -> str:
    """``auto`` -> ``xxh3_64`` where the xxhash package is installed, else ``crc32``."""
    if name == "auto":
        return "xxh3_64" if "xxh3_64" in CHECKSUM_FUNCS else "crc32"
    return name

__all__ = [
    "ChecksumError", "FrameHeader", "FrameReader", "Message", "WireError", "decode",
    "encode", "encode_control", "header_for", "payload_view", "resolve_checksum", "verify",
]


class ChecksumError(WireError):
    """The payload does not match the header's checksum; the stream is still in sync."""

    def __init__(self, message: str, header: FrameHeader) -> None:
        super().__init__(message)
        self.header = header


@dataclass
class Message:
    """A decoded frame: ``kind == "kv"`` with header+payload, else a control dict."""

    kind: str
    header: FrameHeader | None = None
    payload: torch.Tensor | None = None  # [layers, 2, tokens, heads, dim]
    control: dict[str, Any] | None = None
    digest: int | None = None  # checksum of the received payload, hashed while reading


class Hasher:
    """Incremental payload checksum (same value as ``checksum(algo, all bytes)``)."""

    def __init__(self, algo: str) -> None:
        self._algo = algo
        self._state: Any = CHECKSUM_FUNCS[algo](b"") if algo != "xxh3_64" else xxhash.xxh3_64()

    def update(self, data: Any) -> None:
        if self._algo == "xxh3_64":
            self._state.update(data)
        else:  # zlib checksums continue from a running value
            self._state = CHECKSUM_FUNCS[self._algo](data, self._state)

    def digest(self) -> int:
        v = self._state.intdigest() if self._algo == "xxh3_64" else self._state
        return v & 0xFFFFFFFFFFFFFFFF


def payload_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without copying."""
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


def checksum(algo: str, data: Any) -> int:
    return CHECKSUM_FUNCS[algo](data) & 0xFFFFFFFFFFFFFFFF


def header_for(piece: Piece, checksum_algo: str = "crc32") -> FrameHeader:
    c = piece.chunk
    return FrameHeader(
        request_id=c.request_id, seq_no=c.seq_no, part=piece.part, num_parts=piece.num_parts,
        token_start=c.token_start, token_end=c.token_end,
        layer_start=c.layer_start, layer_end=c.layer_end,
        dtype=FrameHeader.dtype_name(c.payload.dtype), shape=tuple(c.payload.shape),
        is_final=c.is_final, first_token=c.first_token, tenant=c.tenant,
        checksum=checksum(checksum_algo, payload_view(c.payload)), checksum_algo=checksum_algo,
        tx=piece.tx, head_start=c.head_start, head_end=c.head_end,
        num_kv_heads=c.heads.total,
    )


def encode_header(header: FrameHeader) -> bytes:
    hb = msgpack.packb(header.to_wire(), use_bin_type=True)
    if len(hb) > MAX_HEADER_BYTES:
        raise WireError(f"header of {len(hb)} bytes exceeds {MAX_HEADER_BYTES}")
    return PREAMBLE.pack(MAGIC, VERSION, len(hb), header.payload_nbytes) + hb


def encode(obj: Piece | Any, *, checksum_algo: str = "crc32") -> list[bytes | memoryview]:
    """Buffers of one frame for ``socket.sendmsg``: [preamble+header, payload view]."""
    piece = obj if isinstance(obj, Piece) else Piece(obj, 0, 1)
    head = encode_header(header_for(piece, checksum_algo))
    payload = payload_view(piece.chunk.payload)
    return [head, payload] if len(payload) else [head]


def encode_control(msg: dict[str, Any]) -> bytes:
    hb = msgpack.packb(msg, use_bin_type=True)
    if len(hb) > MAX_HEADER_BYTES:
        raise WireError(f"control message of {len(hb)} bytes exceeds {MAX_HEADER_BYTES}")
    return PREAMBLE.pack(MAGIC, VERSION, len(hb), 0) + hb


def verify(header: FrameHeader, payload: torch.Tensor, digest: int | None = None) -> None:
    """Raise ``ChecksumError`` unless the payload hashes to ``header.checksum``
    (``digest``: the payload's checksum if already computed, e.g. while receiving)."""
    if header.checksum_algo not in CHECKSUM_FUNCS:
        raise ChecksumError(f"checksum {header.checksum_algo!r} of {header.request_id!r} cannot "
                            "be verified here (is the xxhash package installed?)", header)
    got = digest if digest is not None else checksum(header.checksum_algo, payload_view(payload))
    if got != header.checksum:
        raise ChecksumError(
            f"checksum mismatch for {header.request_id!r} seq {header.seq_no} part "
            f"{header.part}: header says {header.checksum:#x}, payload hashes to {got:#x}",
            header,
        )


def _check_preamble(raw: memoryview, max_frame: int, max_header: int) -> tuple[int, int]:
    magic, version, hlen, plen = PREAMBLE.unpack_from(raw)
    if magic != MAGIC:
        raise WireError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise WireError(f"unsupported wire version {version}, this side speaks {VERSION}")
    if not 0 < hlen <= max_header:
        raise WireError(f"header length {hlen} outside (0, {max_header}]")
    if PREAMBLE.size + hlen + plen > max_frame:
        raise WireError(
            f"frame of {PREAMBLE.size + hlen + plen} bytes exceeds the {max_frame} byte limit"
        )
    return hlen, plen


def _parse(hbytes: memoryview, plen: int) -> tuple[str, FrameHeader | None, dict | None]:
    try:
        obj = msgpack.unpackb(hbytes, raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # msgpack raises many types on garbage; all mean "bad header"
        raise WireError(f"undecodable header: {type(e).__name__}: {e}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("k"), str):
        raise WireError("header is not a map with a str 'k' (kind)")
    if obj["k"] != "kv":
        if plen:
            raise WireError(f"control message {obj['k']!r} must not carry a payload")
        return obj["k"], None, obj
    header = FrameHeader.from_wire(obj)
    if header.payload_nbytes != plen:
        raise WireError(
            f"payload length {plen} does not match dtype {header.dtype} x shape "
            f"{list(header.shape)} = {header.payload_nbytes} bytes"
        )
    return "kv", header, None


def decode(buf: Any, *, max_frame_bytes: int = 1 << 30, verify_checksum: bool = True) -> Message:
    """Decode exactly one frame held in ``buf`` (copies the payload out)."""
    try:
        mv = memoryview(buf).cast("B")
    except TypeError as e:
        raise WireError(f"not a contiguous byte buffer: {e}") from None
    if len(mv) < PREAMBLE.size:
        raise WireError(f"short read: {len(mv)} bytes, the preamble alone is {PREAMBLE.size}")
    hlen, plen = _check_preamble(mv, max_frame_bytes, MAX_HEADER_BYTES)
    total = PREAMBLE.size + hlen + plen
    if len(mv) != total:
        what = "short read" if len(mv) < total else "trailing bytes"
        raise WireError(f"{what}: buffer has {len(mv)} bytes, frame is {total}")
    kind, header, control = _parse(mv[PREAMBLE.size : PREAMBLE.size + hlen], plen)
    if header is None:
        return Message(kind, control=control)
    raw = torch.empty(plen, dtype=torch.uint8)
    if plen:
        memoryview(raw.numpy())[:] = mv[PREAMBLE.size + hlen :]
    payload = header.tensor_from(raw)
    if verify_checksum:
        verify(header, payload)
    return Message(kind, header=header, payload=payload)


class FrameReader:
    """Streaming decoder over ``recv_into(buffer) -> nbytes`` (0 = EOF), e.g. a socket.

    Small reads go through one preallocated buffer (few syscalls for small frames); big
    payloads are received straight into a fresh tensor (no extra copy). ``read`` does not
    verify the checksum; the caller does (``verify``) so it can attribute the failure.
    """

    def __init__(self, recv_into: Any, *, max_frame_bytes: int,
                 max_header_bytes: int = MAX_HEADER_BYTES, buffer_bytes: int = 256 << 10,
                 alloc: Any = None) -> None:
        self._recv_into = recv_into
        # alloc(nbytes) -> flat uint8 tensor for a payload (e.g. a BufferPool's get)
        self._alloc = alloc or (lambda n: torch.empty(n, dtype=torch.uint8))
        self.max_frame_bytes = max_frame_bytes  # may be raised after a handshake
        self.max_header_bytes = max_header_bytes
        self._buf = memoryview(bytearray(buffer_bytes))
        self._lo = self._hi = 0
        self._preamble = memoryview(bytearray(PREAMBLE.size))
        # True once a frame's first byte is consumed until it is fully read: an exception
        # (e.g. socket timeout) raised while False left the stream intact, so read() may
        # simply be called again; while True the stream position is lost.
        self.in_frame = False

    def set_alloc(self, alloc: Any) -> None:
        self._alloc = alloc

    def rebind(self, recv_into: Any, *, buffer_bytes: int) -> None:
        """Read through ``recv_into`` from now on, with a read buffer of ``buffer_bytes``
        (e.g. a handshake's small, deadline-bound reader turned into a link's reader);
        bytes already buffered are kept."""
        pending = bytes(self._buf[self._lo : self._hi])
        buf = memoryview(bytearray(max(buffer_bytes, len(pending))))
        buf[: len(pending)] = pending
        self._recv_into, self._buf, self._lo, self._hi = recv_into, buf, 0, len(pending)

    def _fill(self, dst: memoryview, what: str, at_boundary: bool = False,
              hasher: Any = None) -> bool:
        n, got = len(dst), 0
        while got < n:
            if self._hi > self._lo:  # serve from the buffer first
                take = min(self._hi - self._lo, n - got)
                dst[got : got + take] = self._buf[self._lo : self._lo + take]
                if hasher is not None:
                    hasher.update(dst[got : got + take])
                self._lo += take
                got += take
                self.in_frame = True
                continue
            if n - got >= DIRECT_RECV_MIN:
                # receive in cache-sized steps and hash each while it is still hot, so
                # verifying costs no second trip through memory
                r = self._recv_into(dst[got : got + min(n - got, RECV_STEP)])
                if hasher is not None:
                    hasher.update(dst[got : got + r])
                got += r
                self.in_frame = True
            else:
                r = self._recv_into(self._buf)
                self._lo, self._hi = 0, r
            if not r:
                if at_boundary and got == 0:
                    return False
                raise WireError(f"short read: stream ended after {got} of {n} {what} bytes")
        return True

    def read(self) -> Message | None:
        """The next frame, or None on a clean end of stream between frames."""
        if not self._fill(self._preamble, "preamble", at_boundary=True):
            return None
        hlen, plen = _check_preamble(self._preamble, self.max_frame_bytes, self.max_header_bytes)
        hbytes = memoryview(bytearray(hlen))
        self._fill(hbytes, "header")
        kind, header, control = _parse(hbytes, plen)
        if header is None:
            self.in_frame = False
            return Message(kind, control=control)
        raw = self._alloc(plen)
        hasher = Hasher(header.checksum_algo) if header.checksum_algo in CHECKSUM_FUNCS else None
        if plen:
            self._fill(memoryview(raw.numpy()), "payload", hasher=hasher)
        self.in_frame = False
        digest = hasher.digest() if hasher is not None else None
        return Message(kind, header=header, payload=header.tensor_from(raw), digest=digest)
