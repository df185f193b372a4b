"""WorkerHandle: the router's view of one worker actor (liveness, load, endpoint), and
PrefixAffinity: which prefill worker last took a prompt's first block."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cluster.types import WorkerStats
from engine.block_manager import block_hashes
from runtime.actor import WorkerActor
from runtime.messages import WorkerInfo, WorkerLoad
from runtime.stats import EngineStats, PrefillStats

MAX_AFFINITY_KEYS = 1 << 16  # first blocks remembered (they come from clients' prompts)


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
    channel: str = ""  # host:port of its control channel ("" : the router polls it)
    link: Any = None  # cluster.worker_channel.WorkerChannel: that channel, while open
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


class PrefixAffinity:
    """Sends a prompt to the prefill worker that last took the same first block (whose
    prefix cache likely holds it) unless that one is more than `slack_tokens` busier
    than the least loaded; otherwise the least outstanding prefill tokens wins. Keeps
    the most recent MAX_AFFINITY_KEYS first blocks."""

    def __init__(self, block_size: int, slack_tokens: int, capacity: int = MAX_AFFINITY_KEYS):
        self.block_size, self.slack_tokens, self.capacity = block_size, slack_tokens, capacity
        self._last: OrderedDict[bytes, str] = OrderedDict()  # first block -> worker_id

    def __len__(self) -> int:
        return len(self._last)

    def pick(self, alive: list[WorkerHandle], prompt: tuple[int, ...]) -> WorkerHandle:
        best = min(alive, key=lambda w: w.prefill_load)
        if len(prompt) <= self.block_size:
            return best
        key = block_hashes(prompt[: self.block_size], self.block_size)[0]
        sticky = next((w for w in alive if w.worker_id == self._last.get(key)), None)
        if sticky and sticky.prefill_load <= best.prefill_load + self.slack_tokens:
            best = sticky
        self._last[key] = best.worker_id
        self._last.move_to_end(key)
        while len(self._last) > self.capacity:
            self._last.popitem(last=False)
        return best
