"""EarlyKV: KV chunks that reached a decode worker before the leg's `reserve` did.

The router sends `reserve` (to decode) and `add` (to prefill) at once, so a short prompt's
KV can overtake its reservation. Such chunks are held here, unreleased (their credit stays
with the sender, which keeps the link's own window as a second bound), in arrival order,
until the reserve comes and the engine writes them as if they had just arrived. Bounded:
per leg and in total, by bytes and by chunks; an entry older than `ttl_s` (a reserve that
never comes) goes. A leg's entry goes when its reserve is refused, its abort comes, its
stream fails (e.g. the link closed) or a bound is hit; its chunks are then released, its
id closed in the receiver (late frames are dropped there) and, but for a refusal,
buried, so a reserve that comes later is refused rather than left waiting for KV that is
gone. Every drop is counted by reason. Only the engine's loop thread touches an EarlyKV.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.tombstones import RecentIds, Tombstones
from kv_transfer.base import KVChunk, KVReceiver

DROP_REASONS = ("refused", "aborted", "failed", "expired", "limit", "shutdown")


@dataclass(frozen=True)
class EarlyKVConfig:
    """Set from ServeConfig's transfer.early_kv_* (cluster/launch/worker_specs.py), carried to the
    decode worker in DecodeSchedulerConfig.early_kv."""

    max_leg_bytes: int = 64 << 20  # payload held for one leg
    max_leg_chunks: int = 4096
    max_total_bytes: int = 256 << 20  # payload held for all legs together
    max_total_chunks: int = 16384
    ttl_s: float = 30.0  # how long a leg's KV waits for its reserve

    def __post_init__(self) -> None:
        sizes = (self.max_leg_bytes, self.max_leg_chunks, self.max_total_bytes,
                 self.max_total_chunks)
        if min(sizes) < 1:
            raise ValueError(f"early KV limits must be >= 1, got {sizes}")
        if self.max_leg_bytes > self.max_total_bytes or \
                self.max_leg_chunks > self.max_total_chunks:
            raise ValueError("early KV per-leg limits must not exceed the total limits")
        if self.ttl_s <= 0:
            raise ValueError(f"early KV ttl_s must be > 0, got {self.ttl_s}")


@dataclass(eq=False)
class Held:
    since: float  # monotonic time of its first chunk
    chunks: list[KVChunk] = field(default_factory=list)  # arrival order
    nbytes: int = 0
    complete: bool = False  # the receiver reported every frame of it in


class EarlyKV:
    def __init__(self, config: EarlyKVConfig | None = None,
                 tombstones: Tombstones | None = None):
        self.config = config if config is not None else EarlyKVConfig()
        self.tombstones = tombstones if tombstones is not None else Tombstones()
        # legs refused here (and not reserved since): their late chunks are not held. Not
        # closed in the receiver: a queued leg may ask this worker again, same id.
        self.refused: RecentIds[str] = RecentIds(self.tombstones.capacity)
        self.held: dict[str, Held] = {}  # leg id -> its early chunks (insertion: oldest first)
        self.nbytes = 0
        self.nchunks = 0
        self.applied_legs = 0  # legs whose early chunks were handed to their reservation
        self.refusals = 0  # reserves refused here (full, fault, overtaken by their abort)
        self.dropped_chunks = dict.fromkeys(DROP_REASONS, 0)
        self.dropped_legs = dict.fromkeys(DROP_REASONS, 0)

    def __contains__(self, leg_id: str) -> bool:
        return leg_id in self.held

    def __len__(self) -> int:
        return len(self.held)

    # ---- the engine's calls (receiver: the engine's current one) ------------------------
    def offer(self, chunk: KVChunk, now: float, receiver: KVReceiver) -> tuple[bool, str | None]:
        """A chunk of a leg with no reservation here: (held?, problem). Not held (False):
        the leg ended, was aborted or refused here: the caller discards it as before. A
        problem: a bound was hit and the whole leg was dropped (its leg should fail)."""
        leg, t = chunk.request_id, self.tombstones
        if leg in t.buried or leg in t.ended_ids or leg in self.refused:
            return False, None
        problem = self.hold(chunk, now)
        if problem is not None:
            receiver.release(chunk)
            self.close(leg, "limit", receiver)
            self.dropped_chunks["limit"] += 1
        return True, problem

    def on_reserve(self, leg_id: str, ok: bool, receiver: KVReceiver) -> Held | None:
        """The leg's reserve ran here: granted, its held chunks (to be written now);
        refused, they go."""
        if ok:
            self.refused.pop(leg_id)
            return self.take(leg_id)
        self.refusals += 1
        self.refused.add(leg_id)
        self.close(leg_id, "refused", receiver)
        return None

    def close(self, leg_id: str, reason: str, receiver: KVReceiver) -> bool:
        """Drop what is held for `leg_id` (True if anything was): its chunks are released
        (their credit and buffers go back), its id is closed in the receiver (later frames
        are dropped there) and, but for a refusal, buried: a reserve coming later is
        refused (its KV is gone)."""
        h = self.drop(leg_id, reason)
        if h is None:
            return False
        for c in h.chunks:
            receiver.release(c)
        receiver.abort(leg_id)
        if reason != "refused":
            self.tombstones.bury(leg_id)
        return True

    # ---- the store --------------------------------------------------------------------
    def hold(self, chunk: KVChunk, now: float) -> str | None:
        """Keep `chunk` for its leg; returns why it cannot be kept (a bound would be
        exceeded: the caller then drops the whole leg with `drop(leg, "limit")`)."""
        c, leg, n = self.config, chunk.request_id, chunk.payload.nbytes
        h = self.held.get(leg)
        have_b, have_c = (h.nbytes, len(h.chunks)) if h is not None else (0, 0)
        if have_b + n > c.max_leg_bytes or have_c + 1 > c.max_leg_chunks:
            return (f"KV that arrived before its reservation exceeds the per-leg bound "
                    f"({have_c + 1} chunks, {have_b + n} bytes; limits {c.max_leg_chunks} "
                    f"chunks, {c.max_leg_bytes} bytes)")
        if self.nbytes + n > c.max_total_bytes or self.nchunks + 1 > c.max_total_chunks:
            return (f"KV held for unreserved legs would exceed the worker's bound "
                    f"({self.nchunks + 1} chunks, {self.nbytes + n} bytes; limits "
                    f"{c.max_total_chunks} chunks, {c.max_total_bytes} bytes)")
        if h is None:
            h = self.held[leg] = Held(now)
        h.chunks.append(chunk)
        h.nbytes += n
        self.nbytes += n
        self.nchunks += 1
        return None

    def mark_complete(self, leg_id: str) -> bool:
        h = self.held.get(leg_id)
        if h is not None:
            h.complete = True
        return h is not None

    def take(self, leg_id: str) -> Held | None:
        """The leg's reservation arrived: its held chunks leave here (to be written)."""
        h = self._pop(leg_id)
        if h is not None:
            self.applied_legs += 1
        return h

    def drop(self, leg_id: str, reason: str) -> Held | None:
        """Forget the leg's held chunks (counted under `reason`, one of DROP_REASONS)."""
        h = self._pop(leg_id)
        if h is not None:
            self.dropped_legs[reason] += 1
            self.dropped_chunks[reason] += len(h.chunks)
        return h

    def expired(self, now: float) -> list[str]:
        """Legs whose reserve did not come within ttl_s (oldest first)."""
        out = []
        for leg, h in self.held.items():  # insertion order is first-arrival order
            if now - h.since <= self.config.ttl_s:
                break
            out.append(leg)
        return out

    def _pop(self, leg_id: str) -> Held | None:
        h = self.held.pop(leg_id, None)
        if h is not None:
            self.nbytes -= h.nbytes
            self.nchunks -= len(h.chunks)
        return h
