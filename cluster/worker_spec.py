"""WorkerSpec: everything a worker actor needs to build its engine (a plain dataclass)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from decode_worker.scheduler import DecodeSchedulerConfig
from engine.config import CacheConfig, EngineConfig, SchedulerConfig, torch_dtype
from engine.device import local_device
from engine.loader import load_model_config
from engine.memory import device_memory, num_kv_blocks, weight_bytes
from prefill_worker.scheduler import PrefillSchedulerConfig

ROLES = ("prefill", "decode", "colocated")


@dataclass(frozen=True)
class WorkerSpec:
    worker_id: str
    role: str  # "prefill" | "decode" | "colocated"
    model_dir: str
    device: str = "cpu"  # 'auto', 'cpu', 'cuda' or 'cuda:N' (resolved inside the actor)
    dtype: str = "float32"
    attention_backend: str = "auto"
    compile: str = "auto"  # engine.compile mode
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_bytes: int = 1 << 30
    gpu_memory_utilization: float = 0.9
    gpu_share: float = 1.0  # of its GPU: < 1 when the plan shares GPUs between workers
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    num_threads: int = 1
    prefill: dict[str, Any] = field(default_factory=dict)  # PrefillSchedulerConfig kwargs
    decode: dict[str, Any] = field(default_factory=dict)  # DecodeSchedulerConfig kwargs
    # TransferConfig kwargs, including the per-cluster secret: never in a repr or a log
    transfer: dict[str, Any] = field(default_factory=dict, repr=False)
    actor_name: str = ""  # the Ray actor's name (the "ray" connector's endpoint)
    trace: bool = False
    fault_injection: dict[str, Any] = field(default_factory=dict)  # tests only

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")


def engine_config(spec: WorkerSpec, ray_gpu_ids: Sequence[str | int] | None = None
                  ) -> tuple[EngineConfig, int]:
    """The engine config of this worker and its number of KV blocks.

    `ray_gpu_ids`: the GPUs Ray gave this actor (`ray.get_gpu_ids()`), None outside Ray:
    inside an actor the device is the one Ray made visible. On a GPU the KV blocks are
    sized before the engine loads its weights, from the checkpoint's size in the target
    dtype (the engine constructors take the block count up front)."""
    model = load_model_config(spec.model_dir)
    device = local_device(spec.device, ray_gpu_ids)
    cfg = EngineConfig(
        model_dir=spec.model_dir,
        model=model,
        cache=CacheConfig(spec.block_size, spec.num_blocks, spec.kv_cache_memory_bytes,
                          spec.enable_prefix_caching and spec.role != "decode",
                          spec.gpu_memory_utilization, spec.gpu_share),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=spec.max_num_batched_tokens,
            max_num_seqs=spec.max_num_seqs,
            max_model_len=spec.max_model_len or model.max_position_embeddings,
        ),
        device=str(device),
        dtype=spec.dtype,
        attention_backend=spec.attention_backend, compile=spec.compile,
    )
    if device.type != "cuda" or spec.num_blocks is not None:
        return cfg, num_kv_blocks(cfg)
    pending = weight_bytes(spec.model_dir, torch_dtype(spec.dtype))
    return cfg, num_kv_blocks(cfg, memory=device_memory(device), pending_bytes=pending)


def prefill_sched_config(spec: WorkerSpec) -> PrefillSchedulerConfig:
    kw = {"max_num_batched_tokens": spec.max_num_batched_tokens, **spec.prefill}
    return PrefillSchedulerConfig(**kw)


def decode_sched_config(spec: WorkerSpec, max_model_len: int) -> DecodeSchedulerConfig:
    kw = {"max_num_seqs": spec.max_num_seqs, "max_model_len": max_model_len, **spec.decode}
    return DecodeSchedulerConfig(**kw)


def connector_kwargs(spec: WorkerSpec) -> dict[str, Any]:
    """Per-connector constructor arguments of this worker's side of the link."""
    name = spec.transfer.get("connector", "inproc")
    if name == "inproc":
        return {"name": spec.worker_id}
    if name == "ray" and spec.role == "decode":
        return {"endpoint": spec.actor_name}
    if name == "tcp" and spec.role == "prefill":
        return {"name": spec.worker_id}
    return {}
