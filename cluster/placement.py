"""Pools from GPUs or CPU slots: how many resources each worker actor asks Ray for.

On a machine or cluster with GPUs each worker gets `gpus_per_worker` GPUs, all workers
in one placement group (PACK keeps a P/D pair on one node when it fits); on CPU-only
machines each worker declares `cpus_per_worker` CPUs and uses as many torch threads.
Every actor declares `num_cpus` explicitly: an actor left at Ray's default can wait
forever for a CPU on a small machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class WorkerPlacement:
    worker_id: str  # "prefill-0", "decode-1", ...
    role: str
    num_cpus: float
    num_gpus: float
    resources: dict[str, float] = field(default_factory=dict)

    @property
    def torch_threads(self) -> int:
        return max(1, math.floor(self.num_cpus))


@dataclass(frozen=True)
class PoolPlan:
    workers: tuple[WorkerPlacement, ...]
    use_gpus: bool

    def role(self, role: str) -> list[WorkerPlacement]:
        return [w for w in self.workers if w.role == role]

    @property
    def total_cpus(self) -> float:
        return sum(w.num_cpus for w in self.workers)

    @property
    def total_gpus(self) -> float:
        return sum(w.num_gpus for w in self.workers)


def plan_pools(
    prefill_workers: int,
    decode_workers: int,
    *,
    device: str,
    gpus_per_worker: float,
    cpus_per_worker: float,
    available: dict[str, float],
    prefill_resources: dict[str, float] | None = None,
    decode_resources: dict[str, float] | None = None,
) -> PoolPlan:
    """Split the cluster into the two pools; ValueError names what does not fit."""
    if prefill_workers < 1 or decode_workers < 1:
        raise ValueError("need at least one prefill and one decode worker")
    gpus = available.get("GPU", 0.0)
    use_gpus = device.startswith("cuda") or (device == "auto" and gpus > 0)
    per_gpu = gpus_per_worker if use_gpus else 0.0
    if use_gpus:
        need = (prefill_workers + decode_workers) * per_gpu
        if per_gpu <= 0:
            raise ValueError("gpus_per_worker must be > 0 on a GPU cluster")
        if need > gpus:
            raise ValueError(
                f"{prefill_workers} prefill + {decode_workers} decode workers x "
                f"{per_gpu:g} GPUs need {need:g} GPUs; the cluster has {gpus:g}"
            )
    workers = [
        WorkerPlacement(f"{role}-{i}", role, cpus_per_worker, per_gpu, dict(res or {}))
        for role, n, res in (("prefill", prefill_workers, prefill_resources),
                             ("decode", decode_workers, decode_resources))
        for i in range(n)
    ]
    return PoolPlan(tuple(workers), use_gpus)


def actor_options(w: WorkerPlacement, name: str, max_restarts: int,
                  placement_group: Any = None, bundle_index: int | None = None) -> dict:
    """Options for `RemoteClass.options(...)` of one worker (named in the job's namespace,
    where the workers' own `ray.get_actor` lookups find each other)."""
    opts: dict[str, Any] = {
        "name": name,
        "num_cpus": w.num_cpus,
        "num_gpus": w.num_gpus,
        "max_restarts": max_restarts,
        "max_task_retries": 0,
    }
    if w.resources:
        opts["resources"] = dict(w.resources)
    if placement_group is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=placement_group, placement_group_bundle_index=bundle_index)
    return opts
