"""Pools from GPUs or CPU slots: how many resources each worker actor asks Ray for.

On a machine or cluster with GPUs each worker asks for `gpus_per_worker` GPUs; when the
workers outnumber what that allows (1 prefill + 1 decode on one GPU with the default 1.0),
they share GPUs: the plan gives each worker 1/k of a GPU for the smallest k that places
every worker (pinned pools only on the nodes that offer their custom resources), and says
so in `PoolPlan.note`. On CPU-only machines each worker declares `cpus_per_worker` CPUs
and uses as many torch threads. Every actor declares `num_cpus` explicitly: an actor left
at Ray's default can wait forever for a CPU on a small machine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# Ray keeps 4 decimal places of a fractional resource: round shares down to that
_RAY_PRECISION = 10_000


@dataclass(frozen=True)
class WorkerPlacement:
    worker_id: str  # "prefill-0", "decode-1", "colocated-0", ...
    role: str
    num_cpus: float  # per rank (a worker of tensor-parallel size `tp` has `tp` actors)
    num_gpus: float
    resources: dict[str, float] = field(default_factory=dict)
    tp: int = 1  # tensor-parallel ranks: actors placed together (one placement group)

    def bundles(self) -> list[dict[str, float]]:
        """One placement-group bundle per rank (what each rank's actor asks for)."""
        one = {"CPU": self.num_cpus, **self.resources}
        if self.num_gpus > 0:
            one["GPU"] = self.num_gpus
        return [dict(one) for _ in range(self.tp)]

    def describe(self) -> str:
        gpus = f", {self.num_gpus:g} GPU" if self.num_gpus else ""
        each = f"{self.num_cpus:g} CPU{gpus}"
        if self.tp == 1:
            return f"{self.worker_id}: 1 actor ({each})"
        return (f"{self.worker_id}: TP group of {self.tp} actors ({each} each), one "
                "STRICT_PACK placement group")

    @property
    def torch_threads(self) -> int:
        return max(1, math.floor(self.num_cpus))

    @property
    def gpu_share(self) -> float:
        """The share of one GPU's memory this worker may use (1.0 with whole GPUs)."""
        return min(1.0, self.num_gpus) if self.num_gpus > 0 else 1.0


@dataclass(frozen=True)
class PoolPlan:
    workers: tuple[WorkerPlacement, ...]
    use_gpus: bool
    note: str = ""  # set when workers share GPUs (the launcher logs it)

    def role(self, role: str) -> list[WorkerPlacement]:
        return [w for w in self.workers if w.role == role]

    @property
    def total_cpus(self) -> float:
        return sum(w.num_cpus * w.tp for w in self.workers)

    @property
    def total_gpus(self) -> float:
        return sum(w.num_gpus * w.tp for w in self.workers)

    def report(self) -> str:
        """One line per worker: its actors and what each asks Ray for."""
        return "; ".join(w.describe() for w in self.workers)


Pool = tuple[str, int, Mapping[str, float]]  # (role, workers, custom resources of each)


class _Node:
    """A node's free GPUs (one capacity per GPU: a share below one GPU must fit inside one
    GPU, as Ray places fractional GPUs) and free custom resources."""

    def __init__(self, resources: Mapping[str, float]):
        self.gpus = [1.0] * math.floor(resources.get("GPU", 0.0) + 1e-9)
        self.res = dict(resources)

    def _has_res(self, res: Mapping[str, float]) -> bool:
        return all(self.res.get(k, 0.0) + 1e-9 >= v for k, v in res.items())

    def fits(self, per_gpu: float, res: Mapping[str, float]) -> bool:
        if not self._has_res(res):
            return False
        if per_gpu < 1:
            return any(g + 1e-9 >= per_gpu for g in self.gpus)
        return sum(g > 1 - 1e-9 for g in self.gpus) >= math.ceil(per_gpu)

    def take(self, per_gpu: float, res: Mapping[str, float]) -> None:
        for k, v in res.items():
            self.res[k] = self.res.get(k, 0.0) - v
        if per_gpu < 1:  # best fit: the fullest GPU that still has room
            i = min((i for i, g in enumerate(self.gpus) if g + 1e-9 >= per_gpu),
                    key=lambda i: self.gpus[i])
            self.gpus[i] -= per_gpu
            return
        for _ in range(math.ceil(per_gpu)):
            self.gpus[self.gpus.index(next(g for g in self.gpus if g > 1 - 1e-9))] = 0.0


def fits(pools: Sequence[Pool], per_gpu: float, nodes: Sequence[Mapping[str, float]]) -> bool:
    """Whether every worker finds a node: the pool with the fewest candidate nodes first,
    each worker on the first candidate with room left (GPUs and custom resources)."""
    state = [_Node(n) for n in nodes]
    order = sorted(pools, key=lambda p: sum(n.fits(per_gpu, p[2]) for n in state))
    for _, count, res in order:
        for _ in range(count):
            node = next((n for n in state if n.fits(per_gpu, res)), None)
            if node is None:
                return False
            node.take(per_gpu, res)
    return True


def _gpu_share(pools: Sequence[Pool], gpus_per_worker: float,
               nodes: Sequence[Mapping[str, float]]) -> tuple[float, str]:
    """The GPUs each worker of `pools` (placed together on `nodes`) asks for, and a note
    when that is less than `gpus_per_worker`."""
    if fits(pools, gpus_per_worker, nodes):
        return gpus_per_worker, ""
    workers = sum(n for _, n, _ in pools)
    gpus = sum(math.floor(n.get("GPU", 0.0) + 1e-9) for n in nodes)
    roles = " + ".join(f"{n} {role}" for role, n, _ in pools)
    for k in range(1, workers + 1):
        share = math.floor(_RAY_PRECISION / k) / _RAY_PRECISION
        if share < gpus_per_worker and fits(pools, share, nodes):
            return share, (
                f"{roles} workers share {gpus} GPU(s): {share:g} GPU each, up to {k} per "
                f"GPU (pools.gpus_per_worker={gpus_per_worker:g} would need "
                f"{workers * gpus_per_worker:g}); each sizes its KV cache from its share "
                "of the GPU's memory")
    raise ValueError(
        f"{roles} workers do not fit on {gpus} GPU(s) even when sharing them: a pinned "
        "pool's nodes (prefill_resources / decode_resources) offer no GPU")


def _groups(pools: Sequence[Pool], nodes: Sequence[Mapping[str, float]]
            ) -> list[tuple[list[Pool], list[Mapping[str, float]]]]:
    """Pools that can use the same nodes, with those nodes: pools pinned to disjoint
    nodes are planned apart (a decode pool alone on its node keeps whole GPUs)."""
    cand = [{i for i, n in enumerate(nodes) if _Node(n).fits(0.0, p[2])} for p in pools]
    groups: list[tuple[set[int], set[int]]] = []  # (pool indices, node indices)
    for i, c in enumerate(cand):
        merged = ({i}, set(c))
        for g in [g for g in groups if g[1] & c]:
            groups.remove(g)
            merged = (merged[0] | g[0], merged[1] | g[1])
        groups.append(merged)
    return [([pools[i] for i in sorted(pi)], [nodes[j] for j in sorted(ni)])
            for pi, ni in groups]


def _plan(pools: Sequence[Pool], *, device: str, gpus_per_worker: float,
          cpus_per_worker: float, available: Mapping[str, float],
          nodes: Sequence[Mapping[str, float]] | None,
          tp: Mapping[str, int] | None = None) -> PoolPlan:
    tp = dict(tp or {})
    ranks = [(role, n * tp.get(role, 1), res) for role, n, res in pools]  # actors to place
    gpus = available.get("GPU", 0.0)
    use_gpus = device.startswith("cuda") or (device == "auto" and gpus > 0)
    share: dict[str, float] = {role: 0.0 for role, _, _ in pools}
    notes = []
    if use_gpus:
        if gpus_per_worker <= 0:
            raise ValueError("gpus_per_worker must be > 0 on a GPU cluster")
        if gpus <= 0:
            raise ValueError(f"device {device!r} needs GPUs; the cluster has none")
        for group, group_nodes in _groups(ranks, nodes or [available]):
            per_gpu, note = _gpu_share(group, gpus_per_worker, group_nodes)
            share.update({role: per_gpu for role, _, _ in group})
            notes += [note] if note else []
        for role, size in tp.items():
            if size > 1 and share.get(role, 1.0) < 1:  # NCCL: one rank per GPU
                raise ValueError(
                    f"{role} workers of tensor-parallel size {size} need a whole GPU per "
                    f"rank, but the pools fit only with {share[role]:g} GPU each: fewer "
                    "workers, a smaller TP size, or more GPUs")
    workers = [
        WorkerPlacement(f"{role}-{i}", role, cpus_per_worker, share[role], dict(res or {}),
                        tp.get(role, 1))
        for role, n, res in pools
        for i in range(n)
    ]
    return PoolPlan(tuple(workers), use_gpus, "; ".join(notes))


def plan_pools(
    prefill_workers: int,
    decode_workers: int,
    *,
    device: str,
    gpus_per_worker: float,
    cpus_per_worker: float,
    available: Mapping[str, float],
    prefill_resources: Mapping[str, float] | None = None,
    decode_resources: Mapping[str, float] | None = None,
    nodes: Sequence[Mapping[str, float]] | None = None,
    prefill_tp: int = 1,
    decode_tp: int = 1,
) -> PoolPlan:
    """Split the cluster into the two pools; ValueError names what does not fit.

    `available`: the cluster's total resources; `nodes`: each alive node's resources
    (`ray.nodes()`), for placing pinned pools and fractional GPUs per node (default: the
    whole cluster as one node). `prefill_tp` / `decode_tp`: actors per worker (each
    asks for `cpus_per_worker` and its GPU share; on GPUs a whole GPU per rank).
    """
    if prefill_workers < 1 or decode_workers < 1:
        raise ValueError("need at least one prefill and one decode worker")
    pools = [("prefill", prefill_workers, dict(prefill_resources or {})),
             ("decode", decode_workers, dict(decode_resources or {}))]
    return _plan(pools, device=device, gpus_per_worker=gpus_per_worker,
                 cpus_per_worker=cpus_per_worker, available=available, nodes=nodes,
                 tp={"prefill": prefill_tp, "decode": decode_tp})


def plan_colocated(
    num_engines: int, *, device: str, gpus_per_worker: float, cpus_per_worker: float,
    available: Mapping[str, float], nodes: Sequence[Mapping[str, float]] | None = None,
) -> PoolPlan:
    """The colocated baseline's engines, placed like the P/D pools (GPUs included)."""
    if num_engines < 1:
        raise ValueError("need at least one colocated engine")
    return _plan([("colocated", num_engines, {})], device=device,
                 gpus_per_worker=gpus_per_worker, cpus_per_worker=cpus_per_worker,
                 available=available, nodes=nodes)


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
