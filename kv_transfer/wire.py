"""KV frame format (docs/design.md §6): preamble + msgpack header + raw payload.

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

The unit on the wire: a chunk split into frame pieces, and acks coming back.

A chunk bigger than one frame's payload limit is split by LAYER first: slicing the
leading dim of ``[layers, 2, tokens, heads, dim]`` keeps each piece a contiguous view
(zero copy). Only when a single layer is still too big are token sub-ranges copied out.

A frame is identified by ``(request_id, seq_no, part)``; ``num_parts`` lets the receiver
know when chunk ``seq_no`` is complete. ``tx`` numbers the frames a sender queues (one
counter per sender, increasing), and every ack echoes it: a frame's credit is matched to
that one transmission, never to an older frame that reused its request id and key.
"""

from __future__ import annotations

import dataclasses
import math
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, NamedTuple

import msgpack
import torch

from kv_transfer.base import KVChunk
from kv_transfer.heads import HeadRange, HeadTransfer

# ---- the frame header and its strict validation ----

class WireError(Exception):
    """A frame that must not be trusted: malformed, truncated, oversized or corrupt."""


DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
_NAMES = {v: k for k, v in DTYPES.items()}
CHECKSUM_ALGOS = ("crc32", "adler32", "xxh3_64")
_BIG = 1 << 48  # no token index, layer, dim or seq number is anywhere near this


def _int(d: dict, key: str, lo: int = 0, hi: int = _BIG) -> int:
    v = d.get(key)
    if type(v) is not int or not lo <= v <= hi:  # bool is an int subclass: reject it too
        raise WireError(f"header field {key!r} must be an int in [{lo}, {hi}], got {v!r}")
    return v


def _str(d: dict, key: str, max_len: int) -> str:
    v = d.get(key)
    if not isinstance(v, str) or not 0 < len(v) <= max_len:
        raise WireError(f"header field {key!r} must be a str of 1..{max_len} chars")
    return v


def _heads(d: dict, sh: list[int]) -> tuple[int, int, int]:
    """(head start, end, total) of a header: all three fields or none (= every head)."""
    present = [k for k in ("hs", "he", "hn") if k in d]
    if not present:
        return 0, sh[3], sh[3]
    if len(present) != 3:
        raise WireError(f"header has head field(s) {present} but not all of 'hs', 'he', 'hn'")
    hs, he, hn = _int(d, "hs"), _int(d, "he", 1), _int(d, "hn", 1)
    if not hs < he <= hn:
        raise WireError(f"header head range [{hs}, {he}) is not within [0, {hn})")
    if sh[3] != he - hs:
        raise WireError(f"header shape {sh} has {sh[3]} KV heads but the head range "
                        f"[{hs}, {he}) has {he - hs}")
    return hs, he, hn


@dataclass(frozen=True)
class FrameHeader:
    request_id: str
    seq_no: int
    part: int
    num_parts: int
    token_start: int
    token_end: int
    layer_start: int
    layer_end: int
    dtype: str
    shape: tuple[int, ...]  # [layers, 2, tokens, kv_heads, head_dim]
    is_final: bool
    first_token: int | None
    tenant: str
    checksum: int
    checksum_algo: str
    tx: int = 0  # the sender's transmission number, echoed by the ack
    # the model's KV heads [head_start, head_end) of num_kv_heads the payload holds; a
    # frame without them (a single-rank sender's) holds every head: [0, shape[3]) of shape[3]
    head_start: int = 0
    head_end: int = 0
    num_kv_heads: int = 0

    @staticmethod
    def dtype_name(dtype: torch.dtype) -> str:
        try:
            return _NAMES[dtype]
        except KeyError:
            raise WireError(f"dtype {dtype} cannot travel; supported: {sorted(DTYPES)}") from None

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.request_id, self.seq_no, self.part)

    @property
    def heads(self) -> HeadRange:
        return HeadRange(self.head_start, self.head_end, self.num_kv_heads)

    @property
    def payload_nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize

    def tensor_from(self, raw: torch.Tensor) -> torch.Tensor:
        """View a flat uint8 tensor of ``payload_nbytes`` as the payload (no copy)."""
        assert raw.numel() == self.payload_nbytes
        return raw.view(DTYPES[self.dtype]).view(self.shape)

    def to_wire(self) -> dict[str, Any]:
        return {
            "k": "kv", "rid": self.request_id, "seq": self.seq_no, "part": self.part,
            "np": self.num_parts, "ts": self.token_start, "te": self.token_end,
            "ls": self.layer_start, "le": self.layer_end, "dt": self.dtype,
            "sh": list(self.shape), "fin": self.is_final, "ft": self.first_token,
            "ten": self.tenant, "cs": self.checksum, "ca": self.checksum_algo,
            "tx": self.tx, "hs": self.head_start, "he": self.head_end, "hn": self.num_kv_heads,
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> FrameHeader:
        """Validate a decoded header map; raise ``WireError`` naming the bad field."""
        dt = d.get("dt")
        if dt not in DTYPES:
            raise WireError(f"header field 'dt' must be one of {sorted(DTYPES)}, got {dt!r}")
        sh = d.get("sh")
        if not isinstance(sh, list) or len(sh) != 5 or any(
            type(x) is not int or not 0 <= x < _BIG for x in sh
        ):
            raise WireError(f"header field 'sh' must be 5 non-negative ints, got {sh!r}")
        fin = d.get("fin")
        if type(fin) is not bool:
            raise WireError(f"header field 'fin' must be a bool, got {fin!r}")
        ft = d.get("ft")
        if ft is not None and (type(ft) is not int or not 0 <= ft < _BIG):
            raise WireError(f"header field 'ft' must be null or a token id, got {ft!r}")
        ca = d.get("ca")
        if ca not in CHECKSUM_ALGOS:
            raise WireError(f"header field 'ca' must be one of {CHECKSUM_ALGOS}, got {ca!r}")
        hs, he, hn = _heads(d, sh)
        h = cls(
            request_id=_str(d, "rid", 1024), seq_no=_int(d, "seq"), part=_int(d, "part"),
            num_parts=_int(d, "np", 1), token_start=_int(d, "ts"), token_end=_int(d, "te"),
            layer_start=_int(d, "ls"), layer_end=_int(d, "le"), dtype=dt, shape=tuple(sh),
            is_final=fin, first_token=ft, tenant=_str(d, "ten", 256),
            checksum=_int(d, "cs", 0, 0xFFFFFFFFFFFFFFFF), checksum_algo=ca, tx=_int(d, "tx"),
            head_start=hs, head_end=he, num_kv_heads=hn,
        )
        if h.part >= h.num_parts:
            raise WireError(f"header part {h.part} not below num_parts {h.num_parts}")
        if h.token_end < h.token_start or h.layer_end < h.layer_start:
            raise WireError("header token or layer range is reversed")
        if sh[0] != h.layer_end - h.layer_start or sh[1] != 2 or sh[2] != h.token_end - h.token_start:
            raise WireError(
                f"header shape {sh} disagrees with layers [{h.layer_start}, {h.layer_end}) "
                f"x 2 x tokens [{h.token_start}, {h.token_end})"
            )
        if ft is not None and not fin:
            raise WireError("header carries first_token on a non-final frame")
        return h


# ---- pieces (a chunk split into frames) and acks ----

FrameKey = tuple[str, int, int]  # (request_id, seq_no, part)


@dataclass(frozen=True, eq=False)
class Piece:
    """One frame's worth of a chunk (``chunk`` is the sliced sub-chunk)."""

    chunk: KVChunk
    part: int
    num_parts: int
    tx: int = 0

    @property
    def key(self) -> FrameKey:
        return (self.chunk.request_id, self.chunk.seq_no, self.part)

    @property
    def nbytes(self) -> int:
        return self.chunk.nbytes


class AckStatus(IntEnum):
    """Every transmission gets exactly one ack that returns its credit (OK, DROPPED or
    FAILED); a copy of a transmission the receiver already holds or acked gets DUPLICATE,
    which carries no credit."""

    OK = 0  # the owner released the frame
    DROPPED = 1  # discarded: request aborted/unknown/already failed or completed
    FAILED = 2  # the frame was bad (e.g. checksum mismatch); the request failed
    DUPLICATE = 3  # a copy of the same transmission; the original's ack carries the credit


class Ack(NamedTuple):
    request_id: str
    seq_no: int
    part: int
    status: int
    reason: str = ""
    tx: int = 0  # the transmission this ack answers (``Piece.tx``)

    @property
    def key(self) -> FrameKey:
        return (self.request_id, self.seq_no, self.part)


def _sub(chunk: KVChunk, payload, layer_off: int, tok_off: int, last: bool) -> KVChunk:
    n_tok = payload.shape[2]
    return KVChunk(
        request_id=chunk.request_id,
        seq_no=chunk.seq_no,
        token_start=chunk.token_start + tok_off,
        token_end=chunk.token_start + tok_off + n_tok,
        payload=payload,
        is_final=chunk.is_final and last,
        first_token=chunk.first_token if last else None,
        tenant=chunk.tenant,
        layer_start=chunk.layer_start + layer_off,
        head_start=chunk.head_start,
        num_kv_heads=chunk.num_kv_heads,
    )


def split_chunk(chunk: KVChunk, max_payload_bytes: int) -> list[Piece]:
    """Split ``chunk`` into pieces of at most ``max_payload_bytes`` payload each."""
    assert max_payload_bytes > 0
    p = chunk.payload  # [L, 2, T, H, D]
    if chunk.nbytes <= max_payload_bytes or p.shape[0] == 0 or p.shape[2] == 0:
        return [Piece(chunk, 0, 1)]
    n_layers, n_tok = p.shape[0], p.shape[2]
    per_layer = chunk.nbytes // n_layers
    subs: list[tuple[object, int, int]] = []  # (payload, layer offset, token offset)
    if per_layer <= max_payload_bytes:
        step = max_payload_bytes // per_layer
        for l0 in range(0, n_layers, step):
            subs.append((p[l0 : l0 + step], l0, 0))  # contiguous view, no copy
    else:
        per_token = per_layer // n_tok  # bytes of one token of one layer (K and V)
        step = max(1, max_payload_bytes // per_token)
        for l0 in range(n_layers):
            for t0 in range(0, n_tok, step):
                # [1, 2, t, H, D] out of a [L, 2, T, H, D] tensor is strided: copy it
                subs.append((p[l0 : l0 + 1, :, t0 : t0 + step].contiguous(), l0, t0))
    n = len(subs)
    return [
        Piece(_sub(chunk, sp, lo, to, i == n - 1), i, n) for i, (sp, lo, to) in enumerate(subs)
    ]


def split_layers(chunk: KVChunk, boundaries: Sequence[int],
                 max_payload_bytes: int) -> list[tuple[int, Piece]] | None:
    """``(layer end, piece)`` of a chunk sent group by group of layers (``boundaries``:
    ``KVChunk.layers_ready``), each group split as ``split_chunk`` would, parts numbered
    across the whole chunk; None when one layer is bigger than a frame (token splits copy,
    so they must wait for the whole payload)."""
    p = chunk.payload  # [L, 2, T, H, D]
    if p.shape[0] and chunk.nbytes // p.shape[0] > max_payload_bytes:
        return None
    groups: list[tuple[int, Piece]] = []
    lo = 0
    for hi in boundaries:
        sub = _sub(chunk, p[lo:hi], lo, 0, hi == boundaries[-1])  # contiguous view
        groups += [(hi, x) for x in split_chunk(sub, max_payload_bytes)]
        lo = hi
    n = len(groups)
    return [(end, Piece(x.chunk, i, n)) for i, (end, x) in enumerate(groups)]


def chunks_for_heads(chunk: KVChunk, sends: Sequence[HeadTransfer],
                     dests: Sequence[str]) -> list[tuple[KVChunk, str]]:
    """One prefill rank's ``chunk`` (payload: the rank's heads) cut into what each decode
    rank gets from it: ``sends`` are the rank's transfers (``heads.sends_of``), ``dests``
    the decode ranks' endpoints by rank. Feed the result to ``KVSender.send_many``.

    A transfer of all the chunk's heads reuses its payload; a narrower one copies its
    heads out (``[L, 2, T, H, D][..., a:b, :]`` is strided), so only they travel, after
    waiting for the chunk's export (``KVChunk.ready``) on the caller's thread.
    """
    have = chunk.heads
    out = []
    for t in sends:
        h = t.heads
        if h.total != have.total or not have.start <= h.start < h.end <= have.end:
            raise ValueError(f"transfer of heads {tuple(h)} to decode rank {t.decode_rank} is "
                             f"not within the chunk's heads {tuple(have)}")
        if not 0 <= t.decode_rank < len(dests):
            raise ValueError(f"no endpoint for decode rank {t.decode_rank} ({len(dests)} given)")
        if (h.start, h.end) == (have.start, have.end):
            out.append((chunk, dests[t.decode_rank]))
            continue
        a, b = h.start - have.start, h.end - have.start
        chunk = chunk.resolved()  # the copy reads the payload: its export must be complete
        out.append((dataclasses.replace(chunk, payload=chunk.payload[:, :, :, a:b].contiguous(),
                                        head_start=h.start, num_kv_heads=h.total),
                    dests[t.decode_rank]))
    return out


# ---- framing: preamble + header + payload ----

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
    "Ack", "AckStatus", "ChecksumError", "FrameHeader", "FrameKey", "FrameReader", "Message",
    "Piece", "WireError", "chunks_for_heads", "decode", "encode", "encode_control",
    "header_for", "payload_view", "resolve_checksum", "split_chunk", "split_layers", "verify",
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
