"""WorkerHandle: the router's view of one worker actor (liveness, load, endpoint)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
