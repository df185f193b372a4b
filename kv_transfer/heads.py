"""KV-head ranges under tensor parallelism: who holds which heads, who sends what to whom.

A TP group of ``tp`` ranks splits a model's ``num_kv_heads`` KV heads Megatron/vLLM style:

    num_kv_heads >= tp  (must divide):  rank r holds heads [r*H/tp, (r+1)*H/tp)
    num_kv_heads <  tp  (tp must be a multiple): each head is replicated on tp/H ranks,
                        rank r holds the single head r // (tp/H)

    H=4, tp=2:  rank 0 |h0 h1|  rank 1 |h2 h3|
    H=2, tp=4:  rank 0 |h0| rank 1 |h0| rank 2 |h1| rank 3 |h1|

Head indices are always the model's (global) ones; a rank's cache stores its heads at
local index ``h - rank_range.start``. ``transfer_plan`` says, for a prefill group of
``prefill_tp`` ranks and a decode group of ``decode_tp`` ranks, which prefill rank sends
which heads to which decode rank: every decode rank gets each of its heads exactly once,
from a prefill rank that holds it (a replicated head is taken from replica
``decode_rank % replicas``, spreading the sending load), and a (prefill rank, decode
rank) pair exchanges at most one contiguous range. Each transfer's ``share`` is its
fraction of the group-to-group bytes: the part of a worker-pair budget (pacing rate,
credit window) its link may use, so the group as a whole keeps the configured budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class HeadRange(NamedTuple):
    """KV heads ``[start, end)`` of a model with ``total`` KV heads."""

    start: int
    end: int
    total: int

    @property
    def count(self) -> int:
        return self.end - self.start

    @property
    def is_full(self) -> bool:
        return self.start == 0 and self.end == self.total

    def check(self) -> HeadRange:
        if not (type(self.start) is int and type(self.end) is int and type(self.total) is int
                and 0 <= self.start < self.end <= self.total):
            raise ValueError(f"head range [{self.start}, {self.end}) of {self.total} KV heads "
                             "must satisfy 0 <= start < end <= total")
        return self


def check_tp(num_kv_heads: int, tp: int, what: str = "tensor_parallel_size") -> None:
    """Raise ``ValueError`` unless ``tp`` ranks can split ``num_kv_heads`` KV heads."""
    if type(tp) is not int or tp < 1:
        raise ValueError(f"{what} must be an int >= 1, got {tp!r}")
    if type(num_kv_heads) is not int or num_kv_heads < 1:
        raise ValueError(f"num_kv_heads must be an int >= 1, got {num_kv_heads!r}")
    if num_kv_heads >= tp and num_kv_heads % tp:
        raise ValueError(f"{num_kv_heads} KV heads cannot be split over {what}={tp}: "
                         f"{tp} must divide {num_kv_heads}")
    if num_kv_heads < tp and tp % num_kv_heads:
        raise ValueError(f"{num_kv_heads} KV heads cannot be replicated over {what}={tp}: "
                         f"{tp} must be a multiple of {num_kv_heads}")


def rank_heads(num_kv_heads: int, tp: int, rank: int) -> HeadRange:
    """The KV heads TP rank ``rank`` of ``tp`` holds."""
    check_tp(num_kv_heads, tp)
    if type(rank) is not int or not 0 <= rank < tp:
        raise ValueError(f"rank must be in [0, {tp}), got {rank!r}")
    if num_kv_heads >= tp:
        per = num_kv_heads // tp
        return HeadRange(rank * per, (rank + 1) * per, num_kv_heads)
    h = rank // (tp // num_kv_heads)
    return HeadRange(h, h + 1, num_kv_heads)


def head_replicas(num_kv_heads: int, tp: int, head: int) -> list[int]:
    """The ranks (ascending) that hold KV head ``head``."""
    check_tp(num_kv_heads, tp)
    if num_kv_heads >= tp:
        return [head // (num_kv_heads // tp)]
    rep = tp // num_kv_heads
    return list(range(head * rep, (head + 1) * rep))


@dataclass(frozen=True)
class HeadTransfer:
    """Prefill rank ``prefill_rank`` sends heads ``heads`` to decode rank ``decode_rank``."""

    prefill_rank: int
    decode_rank: int
    heads: HeadRange
    share: float  # fraction of the group-to-group bytes this link carries


def transfer_plan(num_kv_heads: int, prefill_tp: int, decode_tp: int) -> tuple[HeadTransfer, ...]:
    """Every (prefill rank, decode rank, head range) transfer, ordered by decode rank then
    head; raises ``ValueError`` naming the pool whose TP cannot split the heads."""
    check_tp(num_kv_heads, prefill_tp, "prefill tensor_parallel_size")
    check_tp(num_kv_heads, decode_tp, "decode tensor_parallel_size")
    runs: list[tuple[int, int, int, int]] = []  # (prefill rank, decode rank, start, end)
    for d in range(decode_tp):
        want = rank_heads(num_kv_heads, decode_tp, d)
        for h in range(want.start, want.end):
            reps = head_replicas(num_kv_heads, prefill_tp, h)
            p = reps[d % len(reps)]
            if runs and runs[-1][:2] == (p, d) and runs[-1][3] == h:
                runs[-1] = (p, d, runs[-1][2], h + 1)  # extend a contiguous run
            else:
                runs.append((p, d, h, h + 1))
    total = sum(e - s for _, _, s, e in runs)
    return tuple(HeadTransfer(p, d, HeadRange(s, e, num_kv_heads), (e - s) / total)
                 for p, d, s, e in runs)


def sends_of(plan: tuple[HeadTransfer, ...], prefill_rank: int) -> tuple[HeadTransfer, ...]:
    """The transfers prefill rank ``prefill_rank`` makes (possibly none: a replica)."""
    return tuple(t for t in plan if t.prefill_rank == prefill_rank)


def receives_of(plan: tuple[HeadTransfer, ...], decode_rank: int) -> tuple[HeadTransfer, ...]:
    """The transfers decode rank ``decode_rank`` receives."""
    return tuple(t for t in plan if t.decode_rank == decode_rank)
