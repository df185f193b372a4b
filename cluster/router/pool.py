"""WorkerHandle: the router's view of one worker actor (liveness, load, endpoint). Where a
prompt goes is cluster/router/policies.py's (the router's and the simulator's)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cluster.router.types import ErrorCode, RouterError, WorkerStats
from runtime.actor import WorkerActor
from runtime.messages import WorkerInfo, WorkerLoad
from runtime.stats import EngineStats, PrefillStats


@dataclass
class WorkerHandle:
    worker_id: str
    role: str  # "prefill" | "decode" | "colocated"
    actor: WorkerActor
    endpoint: str = ""
    num_blocks: int = 0
    block_size: int = 0  # 0: not reported (its KV capacity is then unknown to the router)
    node_id: str = ""
    alive: bool = True
    restarts: int = 0
    outstanding_tokens: int = 0  # prefill: prompt tokens dispatched, not yet done
    legs: set[str] = field(default_factory=set)  # leg ids currently on this worker
    stats: EngineStats | None = None  # the last stats it reported (None: none yet)
    channel: str = ""  # its control channel's address (host:port, or inproc://NAME)
    link: Any = None  # cluster.router.channel.WorkerChannel: that channel, while open
    actor_name: str = ""  # its Ray actor's name (other front doors find it by it)
    info: WorkerInfo | None = None  # what its ready() said last
    load: WorkerLoad | None = None  # the load its last channel message carried
    others_outstanding: int = 0  # prefill tokens other front doors put on it (estimate)

    @property
    def handle(self) -> WorkerActor:
        """The worker's Ray actor itself (`actor` may wrap it in its channel)."""
        return getattr(self.actor, "ray_actor", self.actor)

    @property
    def kv_usage(self) -> float:
        """Share of its KV blocks in use or promised (from its last load message; without
        one, the blocks in use as of its last stats)."""
        if not self.num_blocks:
            return 0.0
        if self.load is not None and self.role == "decode":
            return 1.0 - self.load.kv_blocks_promisable / self.num_blocks
        used = self.stats.kv_blocks_used if self.stats is not None else 0
        return used / self.num_blocks

    def has_room(self, prompt_len: int, promised_blocks: int = 0) -> bool:
        """Does its last load message leave room for a prompt? `promised_blocks`: blocks
        asked for since (reserves in flight), not counted there. Before its first load
        message: yes, unless reserves in flight already ask for its whole cache (a burst
        at start would otherwise all be sent, and all but the first few refused)."""
        load = self.load
        if load is None:
            return not (promised_blocks and self.num_blocks) or has_room(
                self.num_blocks - promised_blocks, self.block_size, prompt_len)
        return has_room(load.kv_blocks_promisable - promised_blocks, self.block_size,
                        prompt_len)

    @property
    def prefill_load(self) -> int:
        """Prompt tokens queued on it: this router's own plus the others' last seen."""
        return self.outstanding_tokens + self.others_outstanding

    def observe_load(self, load: WorkerLoad) -> None:
        self.load = load
        self.others_outstanding = max(0, load.outstanding_tokens - self.outstanding_tokens)

    @property
    def capacity_tokens(self) -> int | None:
        """Tokens the whole KV cache holds (None when the worker did not say)."""
        return self.num_blocks * self.block_size if self.block_size else None

    @property
    def chunk_sizes(self) -> Mapping[int, int]:
        """Prefill chunks run so far by size (empty for other roles)."""
        return self.stats.chunk_sizes if isinstance(self.stats, PrefillStats) else {}

    def refresh(self, info: WorkerInfo) -> None:
        self.endpoint = info.endpoint
        self.num_blocks = info.num_blocks
        self.block_size = info.block_size
        self.node_id = info.node_id
        self.channel = info.channel
        self.info = info

    def to_stats(self) -> WorkerStats:
        """The last stats this worker reported, as the API's WorkerStats."""
        s = self.stats if self.stats is not None else EngineStats(role=self.role)
        return WorkerStats(self.worker_id, self.role, self.alive, s.num_running, s.num_waiting,
                           s.kv_blocks_used, s.kv_blocks_free, s.queue_depth,
                           s.send_queue_depth, s.figures())


def has_room(promisable_blocks: int, block_size: int, prompt_len: int) -> bool:
    """The rule of `WorkerHandle.has_room` (the router's and the simulator's): a decode
    worker's unpromised free blocks hold the prompt (always, when it gave no block size)."""
    return not block_size or promisable_blocks * block_size > prompt_len


class ReservesInFlight:
    """A router's decode reserves sent with their prefill adds and not yet answered, per
    decode worker (keyed by ``id(worker)``): how many, and the blocks they ask for at
    least (the prompt's; its output and headroom are the worker's to count). The router's
    and the simulator's ledger."""

    def __init__(self) -> None:
        self._sent: dict[int, list[int]] = {}

    def sent(self, key: int, prompt_len: int, block_size: int) -> int:
        """Count one; the blocks it asks for."""
        blocks = prompt_len // block_size + 1 if block_size else 0
        entry = self._sent.setdefault(key, [0, 0])
        entry[0] += 1
        entry[1] += blocks
        return blocks

    def answered(self, key: int, blocks: int) -> None:
        entry = self._sent.get(key)
        if entry is None:
            return
        entry[0] -= 1
        entry[1] -= blocks
        if entry[0] <= 0:
            del self._sent[key]

    def of(self, key: int) -> tuple[int, int]:
        """(reserves in flight, their blocks) on that worker."""
        entry = self._sent.get(key)
        return (entry[0], entry[1]) if entry is not None else (0, 0)

    def __contains__(self, key: int) -> bool:
        return key in self._sent

    def __len__(self) -> int:
        return len(self._sent)


def check_fits(decode: list[WorkerHandle], prompt_len: int) -> None:
    """A prompt no decode worker's whole KV cache can hold is refused at once."""
    caps = [w.capacity_tokens for w in decode if w.role == "decode"]
    known = [c for c in caps if c is not None]  # (every one, or the check is off)
    if caps and len(known) == len(caps) and prompt_len + 1 > max(known):
        raise RouterError(ErrorCode.RESOURCE_EXHAUSTED,
                          f"prompt of {prompt_len} tokens cannot fit any decode worker's "
                          f"KV cache ({max(known)} tokens)")
