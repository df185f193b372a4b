"""The KV frame header and its strict validation (every field typed and range-checked)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from kv_transfer.heads import HeadRange


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
