"""The unit on the wire: a chunk split into frame pieces, and acks coming back.

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
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

from kv_transfer.base import KVChunk
from kv_transfer.heads import HeadTransfer

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
