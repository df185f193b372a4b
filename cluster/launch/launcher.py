"""build_disaggregated_router: start (or join) Ray, place the pools, start the worker
actors, and hand back a Router that owns them."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import secrets
import time
from dataclasses import dataclass, replace

import ray

from cluster.config.serve import ServeConfig
from cluster.launch.placement import PoolPlan, actor_options, plan_colocated, plan_pools
from cluster.launch.role_worker import RemoteRoleWorker
from cluster.launch.tp_groups import TPGroups
from cluster.launch.worker_specs import role_specs, router_config, worker_specs
from cluster.router.pool import WorkerHandle
from cluster.router.router import Router, RouterConfig
from decode_worker.worker import RemoteDecodeWorker
from engine.loader import load_model_config, load_tokenizer
from prefill_worker.worker import RemotePrefillWorker

log = logging.getLogger(__name__)
NAMESPACE = "pdserve"
READY_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class LaunchOptions:
    """Knobs beyond ServeConfig that tests and studies set programmatically."""

    prefill_resources: dict | None = None  # custom Ray resources pinning a pool to nodes
    decode_resources: dict | None = None
    max_restarts: int = 2
    trace: bool = False
    fault_injection: dict | None = None  # tests only


def _init_ray(cfg: ServeConfig, plan_cpus: float) -> bool:
    """Join `pools.address` or start an embedded Ray; returns True if we started it."""
    if ray.is_initialized():
        return False
    if cfg.pools.address:
        ray.init(address=cfg.pools.address, namespace=NAMESPACE, log_to_driver=True)
        return True
    # Declare at least what the pools ask for: on a 2-core machine 2P+2D x 1 CPU would
    # otherwise wait forever (the threads then share the cores).
    cpus = max(os.cpu_count() or 1, math.ceil(plan_cpus))
    ray.init(num_cpus=cpus, namespace=NAMESPACE, include_dashboard=False,
             log_to_driver=True, configure_logging=False)
    return True


def options_from_config(cfg: ServeConfig) -> LaunchOptions:
    p = cfg.pools
    return LaunchOptions(prefill_resources=dict(p.prefill_resources or {}) or None,
                         decode_resources=dict(p.decode_resources or {}) or None,
                         max_restarts=p.max_restarts, trace=p.trace)


def build_disaggregated_router(cfg: ServeConfig, opts: LaunchOptions | None = None) -> Router:
    opts = opts or options_from_config(cfg)
    model_dir = str(cfg.model.resolve_path())  # (an emulated model's with model.emulate)
    model = load_model_config(model_dir)
    p = cfg.pools
    provisional = plan_pools(p.prefill_workers, p.decode_workers, device="cpu",
                             gpus_per_worker=0, cpus_per_worker=p.cpus_per_worker,
                             available={}, prefill_tp=p.prefill_tp, decode_tp=p.decode_tp)
    started = _init_ray(cfg, provisional.total_cpus)
    plan = plan_pools(p.prefill_workers, p.decode_workers, device=cfg.model.device,
                      gpus_per_worker=p.gpus_per_worker, cpus_per_worker=p.cpus_per_worker,
                      available=ray.cluster_resources(), nodes=_alive_nodes(),
                      prefill_resources=opts.prefill_resources,
                      decode_resources=opts.decode_resources,
                      prefill_tp=p.prefill_tp, decode_tp=p.decode_tp)
    if plan.note:
        log.warning("placement: %s", plan.note)
    log.info("placement: %s", plan.report())
    tag = f"pdserve-{secrets.token_hex(3)}"
    handles: list[WorkerHandle] = []
    groups = TPGroups()
    specs = worker_specs(cfg, plan, model_dir, tag, trace=opts.trace,
                         fault_injection=opts.fault_injection)
    try:
        for spec, w in zip(specs, plan.workers, strict=True):
            cls = RemotePrefillWorker if w.role == "prefill" else RemoteDecodeWorker
            args: tuple = (spec,)
            if p.role_switch or p.planner:  # (their check: TP 1, so no placement group)
                cls, args = RemoteRoleWorker, (role_specs(cfg, spec), w.role)
            pg = groups.start(spec, w, opts.max_restarts)  # None for a one-rank worker
            actor = cls.options(**actor_options(w, spec.actor_name, opts.max_restarts,
                                                pg, 0 if pg else None)).remote(*args)
            handles.append(WorkerHandle(w.worker_id, w.role, actor,
                                        actor_name=spec.actor_name))
        _wait_ready(handles, plan)
    except BaseException:
        groups.close()
        raise
    router = Router(
        [h for h in handles if h.role == "prefill"], [h for h in handles if h.role == "decode"],
        router_config(cfg, cfg.cache.prefill_block_size or cfg.cache.block_size),
        load_tokenizer(model_dir), model.vocab_size,
        cfg.model.max_model_len or model.max_position_embeddings, model.eos_token_ids,
        channel_secret=specs[0].transfer.secret,
    )
    router.on_shutdown = lambda: _teardown(handles, started, groups)
    return router


def _alive_nodes() -> list[dict[str, float]]:
    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]


def _wait_ready(handles: list[WorkerHandle], plan: PoolPlan) -> None:
    """Wait for every actor's ready(); on failure kill them all (no half-started pool
    keeps holding the cluster's CPUs and GPUs) and raise."""
    try:
        _wait_all_ready(handles, plan)
    except BaseException:
        for h in handles:
            with contextlib.suppress(Exception):
                ray.kill(h.handle, no_restart=True)
        raise


def _wait_all_ready(handles: list[WorkerHandle], plan: PoolPlan) -> None:
    refs = {h.actor.ready.remote(): h for h in handles}
    deadline = time.monotonic() + READY_TIMEOUT_S
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=len(pending), timeout=5.0)
        for ref in done:
            info = ray.get(ref)
            refs[ref].refresh(info)
            if info.tp_ranks:
                log.info("placement: %s is a TP group of %d: %s", info.worker_id,
                         len(info.tp_ranks), "; ".join(info.tp_ranks))
        if pending and time.monotonic() > deadline:
            names = [refs[r].worker_id for r in pending]
            raise RuntimeError(
                f"workers {names} did not start within {READY_TIMEOUT_S:.0f}s: the cluster "
                f"has {ray.available_resources()} free; the pools ask for "
                f"{plan.total_cpus:g} CPUs and {plan.total_gpus:g} GPUs")


def _teardown(handles: list[WorkerHandle], started_ray: bool,
              groups: TPGroups | None = None) -> None:
    for h in handles:
        try:
            ray.get(h.handle.shutdown.remote(), timeout=10)
        except Exception:
            pass
        ray.kill(h.handle, no_restart=True)
    if groups is not None:
        groups.close()
    if started_ray:
        ray.shutdown()


def build_colocated_pool_router(cfg: ServeConfig, num_engines: int,
                                enable_chunked_prefill: bool,
                                opts: LaunchOptions | None = None) -> Router:
    """N colocated engines as Ray actors behind the same Router (the interference baseline)."""
    from cluster.launch.colocated_pool import RemoteColocatedWorker

    opts = opts or LaunchOptions()
    model_dir = str(cfg.model.resolve_path())
    model = load_model_config(model_dir)
    _init_ray(cfg, num_engines * cfg.pools.cpus_per_worker)
    p = cfg.pools
    plan = plan_colocated(num_engines, device=cfg.model.device,
                          gpus_per_worker=p.gpus_per_worker, cpus_per_worker=p.cpus_per_worker,
                          available=ray.cluster_resources(), nodes=_alive_nodes())
    if plan.note:
        log.warning("placement: %s", plan.note)
    tag = f"pdserve-{secrets.token_hex(3)}"
    handles = []
    specs = worker_specs(cfg, plan, model_dir, tag, trace=opts.trace)
    for spec, w in zip(specs, plan.workers, strict=True):
        e = spec.engine
        spec = replace(spec, engine=replace(e, scheduler=replace(
            e.scheduler, enable_chunked_prefill=enable_chunked_prefill)))
        actor = RemoteColocatedWorker.options(
            **actor_options(w, spec.actor_name, opts.max_restarts)
        ).remote(spec)
        handles.append(WorkerHandle(spec.worker_id, "colocated", actor))
    _wait_ready(handles, plan)
    router = Router(handles, handles, RouterConfig(
        max_queue_len=cfg.limits.max_queue_len, request_timeout_s=cfg.limits.request_timeout_s,
        prefix_affinity=False), load_tokenizer(model_dir), model.vocab_size,
        cfg.model.max_model_len or model.max_position_embeddings, model.eos_token_ids,
        channel_secret=specs[0].transfer.secret)
    router.on_shutdown = lambda: _teardown(handles, False)
    return router
