"""WorkerHandle: the router's view of one worker actor (liveness, load, endpoint), and
PrefixAffinity: which prefill worker last took a prompt's first block."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from cluster.types import WorkerStats
from engine.block_manager import block_hashes

MAX_AFFINITY_KEYS = 1 << 16  # first blocks remembered (they come from clients' prompts)


@dataclass
class WorkerHandle:
    worker_id: str
    role: str  # "prefill" | "decode"
    actor: Any  # ray.actor.ActorHandle
    endpoint: str = ""
    num_blocks: int = 0
    block_size: int = 0  # 0: not reported (its KV capacity is then unknown to the router)
    node_id: str = ""
    alive: bool = True
    restarts: int = 0
    outstanding_tokens: int = 0  # prefill: prompt tokens dispatched, not yet done
    legs: set[str] = field(default_factory=set)  # leg ids currently on this worker
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def kv_usage(self) -> float:
        used = self.stats.get("kv_blocks_used", 0)
        return used / self.num_blocks if self.num_blocks else 0.0

    @property
    def capacity_tokens(self) -> int | None:
        """Tokens the whole KV cache holds (None when the worker did not say)."""
        return self.num_blocks * self.block_size if self.block_size else None

    def refresh(self, info: dict[str, Any]) -> None:
        self.endpoint = info.get("endpoint", "")
        self.num_blocks = info.get("num_blocks", 0)
        self.block_size = info.get("block_size", 0)
        self.node_id = info.get("node_id", "")

    def to_stats(self) -> WorkerStats:
        """The last stats this worker reported, as the API's WorkerStats."""
        s = self.stats
        return WorkerStats(
            self.worker_id, self.role, self.alive, int(s.get("num_running", 0)),
            int(s.get("num_waiting", 0)), int(s.get("kv_blocks_used", 0)),
            int(s.get("kv_blocks_free", 0)), int(s.get("jobs", s.get("num_waiting", 0))),
            int(s.get("send_queue_depth", 0)),
            {k: float(v) for k, v in s.items() if isinstance(v, int | float)
             and not isinstance(v, bool)},
        )


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
        best = min(alive, key=lambda w: w.outstanding_tokens)
        if len(prompt) <= self.block_size:
            return best
        key = block_hashes(prompt[: self.block_size], self.block_size)[0]
        sticky = next((w for w in alive if w.worker_id == self._last.get(key)), None)
        if sticky and sticky.outstanding_tokens <= best.outstanding_tokens + self.slack_tokens:
            best = sticky
        self._last[key] = best.worker_id
        self._last.move_to_end(key)
        while len(self._last) > self.capacity:
            self._last.popitem(last=False)
        return best
