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

    def refresh(self, info: dict[str, Any]) -> None:
        self.endpoint = info.get("endpoint", "")
        self.num_blocks = info.get("num_blocks", 0)
        self.node_id = info.get("node_id", "")
