"""WorkerSpec: everything a worker actor needs to build its engine (a plain dataclass)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from decode_worker.scheduler import DecodeSchedulerConfig
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm import default_num_blocks
from engine.loader import load_model_config
from prefill_worker.scheduler import PrefillSchedulerConfig


@dataclass(frozen=True)
class WorkerSpec:
    worker_id: str
    role: str  # "prefill" | "decode"
    model_dir: str
    device: str = "cpu"
    dtype: str = "float32"
    attention_backend: str = "auto"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_bytes: int = 1 << 30
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
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', got {self.role!r}")


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def engine_config(spec: WorkerSpec) -> tuple[EngineConfig, int]:
    """The engine config of this worker and its number of KV blocks."""
    model = load_model_config(spec.model_dir)
    cfg = EngineConfig(
        model_dir=spec.model_dir,
        model=model,
        cache=CacheConfig(spec.block_size, spec.num_blocks, spec.kv_cache_memory_bytes,
                          spec.enable_prefix_caching and spec.role == "prefill"),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=spec.max_num_batched_tokens,
            max_num_seqs=spec.max_num_seqs,
            max_model_len=spec.max_model_len or model.max_position_embeddings,
        ),
        device=resolve_device(spec.device),
        dtype=spec.dtype,
        attention_backend=spec.attention_backend,
    )
    return cfg, spec.num_blocks or default_num_blocks(cfg)


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
