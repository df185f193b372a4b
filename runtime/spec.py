"""WorkerSpec: everything a worker actor needs, as the typed configs its parts take.

The launcher builds every spec once (cluster/launch/worker_specs.py); a worker constructs no
config from loose values. What only the actor can know is resolved there by
`resolve_engine`: the device Ray made visible and, on a GPU, the KV blocks that fit.

Fault injection (tests and soak runs only) is OFF unless a plan is given, by the launcher
(`LaunchOptions(fault_injection=...)` -> `WorkerSpec.faults`) or by the `PDSERVE_FAULTS`
environment variable (a JSON plan, see kv_transfer/faults.py) in the worker actors'
environment; without a plan no wrapper is installed and nothing runs
(`worker_fault_injector`). Killing worker actors is cluster/launch/faults.py's job.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

from engine.config import EngineConfig, Shard, torch_dtype
from engine.device import local_device
from engine.memory import device_memory, num_kv_blocks, weight_bytes
from engine.parallel.loader import shard_weight_bytes
from kv_transfer.config import TransferConfig
from kv_transfer.faults import ENV_VAR, FaultInjector, FaultPlan

ROLES = ("prefill", "decode", "colocated")
S = TypeVar("S")  # the role's scheduler config: PrefillSchedulerConfig, DecodeSchedulerConfig


@dataclass(frozen=True)
class WorkerSpec(Generic[S]):
    worker_id: str
    role: str  # "prefill" | "decode" | "colocated"
    engine: EngineConfig  # its device as asked ('auto', 'cuda', ...): see resolve_engine
    scheduler: S | None = None  # the role's scheduler (colocated: engine.scheduler)
    # the link's config, including the per-cluster secret: never in a repr or a log
    transfer: TransferConfig | None = field(default=None, repr=False)
    num_threads: int = 1
    actor_name: str = ""  # the Ray actor's name (the "ray" connector's endpoint)
    trace: bool = False
    faults: FaultPlan = field(default_factory=FaultPlan)  # tests only
    stream_interval: int = 1  # decode: tokens per leg per reported event (the front door's)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.role != "colocated" and (self.scheduler is None or self.transfer is None):
            raise ValueError(f"a {self.role} worker needs its scheduler and transfer configs")
        if self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")

    def connector_kwargs(self) -> dict[str, Any]:
        """Per-connector constructor arguments of this worker's side of the link."""
        from kv_transfer.registry import CONNECTORS

        name = self.transfer.connector if self.transfer is not None else "inproc"
        return CONNECTORS.get(name).worker_kwargs(self.role, self.worker_id, self.actor_name)


def resolve_engine(config: EngineConfig, ray_gpu_ids: Sequence[str | int] | None = None
                   ) -> tuple[EngineConfig, int]:
    """`config` on the device this process runs it on, and its number of KV blocks.

    `ray_gpu_ids`: the GPUs Ray gave this actor (`ray.get_gpu_ids()`), None outside Ray:
    inside an actor the device is the one Ray made visible. On a GPU the KV blocks are
    sized before the engine loads its weights, from the checkpoint's size in the target
    dtype (the engine constructors take the block count up front)."""
    device = local_device(config.device, ray_gpu_ids)
    cfg = replace(config, device=str(device))
    if device.type != "cuda" or cfg.cache.num_blocks is not None:
        return cfg, num_kv_blocks(cfg)
    dtype = torch_dtype(cfg.dtype)
    if cfg.tensor_parallel_size > 1:  # rank 0's slice (it alone holds the LM head)
        shard = Shard.of(cfg.model, cfg.tensor_parallel_size)
        pending = shard_weight_bytes(cfg.model, cfg.model_dir, shard, dtype)
    else:
        pending = weight_bytes(cfg.model_dir, dtype)
    return cfg, num_kv_blocks(cfg, memory=device_memory(device), pending_bytes=pending)


def fault_plan(spec_faults: FaultPlan | None, environ: Mapping[str, str] | None = None
               ) -> FaultPlan:
    """The plan of a worker: its spec's plan plus `$PDSERVE_FAULTS`."""
    env = (os.environ if environ is None else environ).get(ENV_VAR, "")
    return (spec_faults or FaultPlan()).merged(FaultPlan.parse(env))


def worker_fault_injector(spec: WorkerSpec, environ: Mapping[str, str] | None = None
                          ) -> FaultInjector | None:
    """A FaultInjector for this worker, or None when no fault applies."""
    if not spec.faults.faults and not (os.environ if environ is None else environ).get(ENV_VAR):
        return None  # the production path: no parsing, no wrapper
    plan = fault_plan(spec.faults, environ).for_worker(spec.worker_id)
    return FaultInjector(plan, spec.worker_id) if plan.faults else None
