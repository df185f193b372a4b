"""ServeConfig -> the typed configs of each worker, translated once, here.

`engine_config` (EngineConfig of a role), `prefill_config` / `decode_config` (the pools'
scheduler configs), `transfer_config` (TransferConfig with the cluster's secret) and
`worker_specs` (one runtime.spec.WorkerSpec per planned worker) are the only place
where a ServeConfig key becomes a knob of an engine, a scheduler or a connector.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from cluster.config.serve import ServeConfig
from cluster.launch.placement import PoolPlan
from cluster.router.flight import RouterConfig
from decode_worker.early_kv import EarlyKVConfig
from decode_worker.scheduler import DecodeSchedulerConfig
from engine.compile import role_mode
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, torch_dtype
from engine.kv_cache import KVCache
from engine.loader import load_model_config
from kv_transfer.config import TransferConfig
from kv_transfer.faults import FaultPlan
from prefill_worker.policies import CHUNK_POLICIES
from prefill_worker.scheduler import PrefillSchedulerConfig
from runtime.spec import WorkerSpec


def engine_config(cfg: ServeConfig, model_dir: str, role: str, gpu_share: float = 1.0,
                  model: ModelConfig | None = None) -> EngineConfig:
    """The engine of a `role` worker; its device as configured (resolved where it runs)."""
    model = model or load_model_config(model_dir)
    c, s = cfg.cache, cfg.scheduler
    block = {"prefill": c.prefill_block_size, "decode": c.decode_block_size}.get(role)
    tp = {"prefill": cfg.pools.prefill_tp, "decode": cfg.pools.decode_tp}.get(role, 1)
    colocated = role == "colocated"
    return EngineConfig(
        model_dir=model_dir, model=model,
        cache=CacheConfig(block or c.block_size, c.num_blocks, c.kv_cache_memory_bytes,
                          c.enable_prefix_caching and role != "decode",
                          c.gpu_memory_utilization, gpu_share),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=s.max_num_batched_tokens, max_num_seqs=s.max_num_seqs,
            max_prefill_chunk=s.max_prefill_chunk if colocated else None,
            enable_chunked_prefill=s.enable_chunked_prefill if colocated else True,
            max_model_len=cfg.model.max_model_len or model.max_position_embeddings),
        device=cfg.model.device, dtype=cfg.model.dtype,
        attention_backend=cfg.model.attention_backend,
        compile=role_mode(cfg.model.compile, role),  # a prefill worker: no decode graphs
        tensor_parallel_size=tp, emulate=cfg.model.emulate_config)


def router_config(cfg: ServeConfig, affinity_block_size: int) -> RouterConfig:
    """The disaggregated router's settings (the service's and the simulator's router);
    ``affinity_block_size``: the prefill workers' block size (prefix affinity hashes it)."""
    s = cfg.scheduler
    return RouterConfig(
        max_queue_len=cfg.limits.max_queue_len, request_timeout_s=cfg.limits.request_timeout_s,
        prefix_affinity=cfg.cache.enable_prefix_caching, affinity_block_size=affinity_block_size,
        placement=cfg.pools.prefill_placement, unavailable_grace_s=cfg.limits.restart_grace_s,
        adaptive_chunks=CHUNK_POLICIES.get(s.chunk_policy).uses_decode_pressure,
        itl_target_s=s.itl_target_ms / 1000, stream_interval=cfg.server.stream_interval,
        reserve_with_add=cfg.pools.reserve_with_add,
        pipelined_reserves=cfg.pools.pipelined_reserves,
        admission_order=s.decode_admission, tenant_weights=dict(s.tenant_weights or {}))


def prefill_config(cfg: ServeConfig) -> PrefillSchedulerConfig:
    s = cfg.scheduler
    return PrefillSchedulerConfig(
        max_num_batched_tokens=s.max_num_batched_tokens, max_prefill_chunk=s.max_prefill_chunk,
        fairness_policy=s.fairness_policy, chunk_policy=s.chunk_policy, aging_s=s.aging_s,
        tenant_weights=dict(s.tenant_weights or {}))


def decode_config(cfg: ServeConfig, max_model_len: int) -> DecodeSchedulerConfig:
    return DecodeSchedulerConfig(max_num_seqs=cfg.scheduler.max_num_seqs,
                                 max_model_len=max_model_len,
                                 kv_wait_timeout_s=cfg.limits.kv_wait_timeout_s,
                                 early_kv=early_kv_config(cfg),
                                 overlap=cfg.scheduler.overlap)


def early_kv_config(cfg: ServeConfig) -> EarlyKVConfig:
    """`transfer.early_kv_*`: what a decode worker holds of KV that came before its leg's
    reserve (MiB -> bytes, rounded up: a positive size never becomes 0)."""
    t = cfg.transfer
    return EarlyKVConfig(max_leg_bytes=math.ceil(t.early_kv_leg_mb * (1 << 20)),
                         max_leg_chunks=t.early_kv_leg_chunks,
                         max_total_bytes=math.ceil(t.early_kv_total_mb * (1 << 20)),
                         max_total_chunks=t.early_kv_total_chunks, ttl_s=t.early_kv_ttl_s)


def credit_window_bytes(cfg: ServeConfig, model: ModelConfig) -> int:
    """`transfer.credit_window_mb`, raised to `credit_window_chunks` of the model's
    largest prefill chunk: a window smaller than one chunk's KV (an 8B model's 1,000
    tokens are 125 MiB) would turn every chunk into stop-and-wait frames."""
    t, s = cfg.transfer, cfg.scheduler
    chunk_tokens = min(s.max_prefill_chunk, s.max_num_batched_tokens)
    chunk = chunk_tokens * KVCache.bytes_per_token(model, torch_dtype(cfg.model.dtype))
    return max(int(t.credit_window_mb * (1 << 20)), math.ceil(t.credit_window_chunks * chunk))


def transfer_config(cfg: ServeConfig, model: ModelConfig, secret: bytes) -> TransferConfig:
    t = cfg.transfer
    # an emulated device sent a fraction F of each chunk's bytes: rates and window times F
    # charge the link the full size (engine/emulate/: --emulate-kv-fraction)
    f = cfg.model.emulate_kv_fraction if cfg.model.emulate else 1.0
    window = math.ceil(credit_window_bytes(cfg, model) * f)
    return TransferConfig(
        connector=t.connector,
        send_policy=t.send_policy,
        rate_bytes_per_s=(t.rate_gbps or 0.0) * 1e9 / 8 * f,
        # the emulated link is the transport's: every send policy runs unchanged above it
        link_rate_bytes_per_s=(t.link_gbps or 0.0) * 1e9 / 8 * f,
        link_latency_s=t.link_latency_us * 1e-6,
        burst_bytes=int(t.burst_mb * (1 << 20)),
        credit_window_bytes=window,
        # a frame never exceeds the window, so small windows can be studied
        max_frame_bytes=max(64 << 10, min(64 << 20, window)),
        send_queue=t.send_queue,
        tenant_weights=dict(cfg.scheduler.tenant_weights or {}),
        failure_timeout_s=t.failure_timeout_s,
        bind_host=t.bind_host,
        secret=secret,
        layerwise=t.layerwise, layerwise_groups=t.layerwise_groups,
    )


def worker_specs(cfg: ServeConfig, plan: PoolPlan, model_dir: str, tag: str, *,
                 trace: bool = False,
                 fault_injection: Mapping[str, Any] | FaultPlan | None = None,
                 ) -> list[WorkerSpec]:
    """One spec per planned worker; they share one fresh per-cluster secret (never
    logged: TransferConfig and WorkerSpec keep it out of their reprs), which a colocated
    worker's control channel uses too."""
    model = load_model_config(model_dir)
    transfer = transfer_config(cfg, model, secrets.token_bytes(32))
    faults = FaultPlan.parse(fault_injection)
    prefill = prefill_config(cfg)
    specs: list[WorkerSpec] = []
    for w in plan.workers:
        engine = engine_config(cfg, model_dir, w.role, w.gpu_share, model)
        scheduler = {"prefill": prefill, "decode": decode_config(
            cfg, engine.scheduler.max_model_len)}.get(w.role)
        specs.append(WorkerSpec(
            worker_id=w.worker_id, role=w.role, engine=engine, scheduler=scheduler,
            transfer=transfer,
            num_threads=w.torch_threads, actor_name=f"{tag}-{w.worker_id}", trace=trace,
            faults=faults, stream_interval=cfg.server.stream_interval))
    return specs


def role_specs(cfg: ServeConfig, spec: WorkerSpec) -> dict[str, WorkerSpec]:
    """A role-switching worker's specs (pools.role_switch, cluster/launch/role_worker.py):
    its own and the other role's, with the same id, engine and links; ValueError where the
    two pools' block sizes differ (one KV memory serves both roles)."""
    c = cfg.cache
    if c.effective_prefill_block_size != c.effective_decode_block_size:
        raise ValueError("pools.role_switch needs one block size on both pools, got "
                         f"cache.prefill_block_size {c.effective_prefill_block_size} and "
                         f"cache.decode_block_size {c.effective_decode_block_size}")
    scheduler = {"prefill": prefill_config(cfg),
                 "decode": decode_config(cfg, spec.engine.scheduler.max_model_len)}
    return {role: replace(spec, role=role, scheduler=scheduler[role])
            for role in ("prefill", "decode")}
