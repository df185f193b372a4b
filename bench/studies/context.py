"""The options and context every study of one process shares: the model, the reference
timing, the emulated link and the services, and :meth:`StudyContext.run`, which runs one
configuration's workload and writes its trace files.

A study builds configurations as dotted ServeConfig overrides of ``ctx.base_config()``
(the same base for every study, so the shared default configuration is launched once per
``run_all``) and runs the same seeded workload on each.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from bench.studies.config_run import ConfigRun
from bench.studies.link import DEFAULT_RATIO, LinkEmulation, Reference, measure_reference
from bench.studies.service import DISAGG, Drive, Layout, ServicePool
from bench.studies.traces import with_emulated_link, write_trace_files
from bench.workload import WorkloadRequest
from cluster.config.serve import ServeConfig

log = logging.getLogger(__name__)
DEFAULT_SLOS = {"ttft": 2000.0, "tpot": 200.0}  # ms; CPU-sized, recorded in every result
# ms; on an emulated accelerator (--emulate, without --slo): an interactive 8B service on
# one GPU, first token within 250 ms and 40 tokens/s after it
EMULATED_SLOS = {"ttft": 250.0, "tpot": 25.0}
TENANT_WEIGHTS = {"gold": 2.0, "free": 1.0}


@dataclass(frozen=True)
class StudyOptions:
    out: Path
    quick: bool = False
    model: str = "tiny"  # tiny | small | a model directory
    link_gbps: float | None = None  # given: use it; else from transfer_compute_ratio
    transfer_compute_ratio: float = DEFAULT_RATIO
    transport: str = "inproc"  # inproc (router_driver) | grpc (bench.client)
    seed: int = 0
    trace: bool = True
    progress: bool = True
    slos: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_SLOS))
    configs: tuple[str, ...] = ()  # run only these configuration names (empty: all)
    num_requests: int | None = None  # override the study's request count
    # real services on an emulated accelerator (pdserve serve --emulate PROFILE
    # --model-shape SHAPE): step times from the cost model, so the link is emulated at
    # the device's transfer/compute ratio; ``model`` is then the label titles carry
    emulate: str | None = None
    model_shape: str | None = None
    # with ``emulate``: the share of each chunk's KV bytes the prefill workers send (the
    # link charged in full; pdserve serve --emulate-kv-fraction), where this host's copies
    # would otherwise set the pace; every label says so
    emulate_kv_fraction: float = 1.0
    # tenant -> weight: scheduler.tenant_weights of every configuration, so one mapping
    # drives the prefill policy, the KV send queue and decode admission
    tenant_weights: Mapping[str, float] = field(default_factory=lambda: dict(TENANT_WEIGHTS))

    def __post_init__(self) -> None:
        if self.transport not in ("inproc", "grpc"):
            raise ValueError(f"transport must be 'inproc' or 'grpc', got {self.transport!r}")
        if self.link_gbps is not None and not self.link_gbps > 0:
            raise ValueError(f"link_gbps must be > 0, got {self.link_gbps}")
        if not self.transfer_compute_ratio > 0:
            raise ValueError(f"transfer_compute_ratio must be > 0, got {self.transfer_compute_ratio}")
        if self.emulate is not None:
            self.emulate_config  # noqa: B018 - ValueError naming a bad profile or shape
        if not self.tenant_weights or not all(w > 0 for w in self.tenant_weights.values()):
            raise ValueError(f"tenant weights must be positive, got {dict(self.tenant_weights)}")

    @property
    def emulate_config(self):
        """engine.config.EmulateConfig of ``emulate`` (None: the model on this CPU)."""
        if self.emulate is None:
            return None
        from engine.config import EmulateConfig

        if not self.model_shape:
            raise ValueError("--emulate needs --model-shape")
        return EmulateConfig(self.emulate, self.model_shape, self.emulate_kv_fraction)

    def summary(self) -> str:
        """One line for the console and the index."""
        link = f"link {self.link_gbps} Gbit/s" if self.link_gbps else \
            f"transfer/compute ratio {self.transfer_compute_ratio:g}"
        return (f"model {self.model}, {'quick' if self.quick else 'full'}, {link}, "
                f"transport {self.transport}, seed {self.seed}, out {self.out}")


def resolve_model_dir(model: str) -> Path:
    from engine.tiny_model import ensure_model

    if model in ("tiny", "small"):
        return ensure_model(model, "llama")
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(f"--model {model!r}: expected tiny, small or a HF model directory")
    return path


class StudyContext:
    """Shared by the studies of one process: model, reference timings, link, services.

    ``load_scale`` multiplies each study's request count and rate (1 here; a simulated
    cluster, sim/study.py, scales the load with its pools)."""

    load_scale = 1.0
    simulated = False

    def __init__(self, opts: StudyOptions):
        self.opts = opts
        self.out = Path(opts.out)
        self.out.mkdir(parents=True, exist_ok=True)
        em = opts.emulate_config
        if em is None:
            self.model_dir = resolve_model_dir(opts.model)
        else:
            from engine.emulate.model_dir import emulated_model_dir

            self.model_dir = emulated_model_dir(em.shape)
        self._start_pool()

    def _start_pool(self) -> None:
        self.pool = ServicePool(trace=self.opts.trace)
        self.pool.pin(self.base_config())

    @property
    def launches(self) -> int:
        return self.pool.launches

    def describe(self) -> str:
        """Where the configurations run (one line for the console and the index)."""
        em = self.opts.emulate_config
        where = "this machine" if em is None else f"this machine, on the {em.label}"
        return f"real services on {where} (Ray workers, router, KV connector)"

    def credit_window_mb(self, cfg: ServeConfig) -> float:
        """The credit window the workers of ``cfg`` run with."""
        from cluster.launch.worker_specs import credit_window_bytes

        return credit_window_bytes(cfg, self.model_config) / float(1 << 20)

    @cached_property
    def model_config(self):
        from engine.loader import load_model_config

        return load_model_config(self.model_dir)

    @cached_property
    def reference(self) -> Reference:
        """Measured once per process (seconds: the engine loads the model first); on an
        emulated device, what its cost model gives (the steps the services will take)."""
        if self.opts.emulate_config is not None:
            return self._emulated_reference(min(512, self.max_model_len // 2))
        ref = measure_reference(self.model_dir, prompt_tokens=min(512, self.max_model_len // 2))
        log.info("reference: prefill %.1f ms, decode step %.2f ms", ref.prefill_s * 1e3,
                 ref.decode_step_s * 1e3)
        return ref

    def _emulated_reference(self, prompt_tokens: int) -> Reference:
        """The cost model's prefill of a ``prompt_tokens`` prompt (with its first token)
        and one decode step after it: what the emulated workers' steps take."""
        from engine.config import torch_dtype
        from engine.emulate.offline import emulated_engine_config
        from engine.emulate.runner import emulated_costs
        from engine.kv_cache import KVCache

        em = self.opts.emulate_config
        cfg = emulated_engine_config(em.costs, em.shape)
        costs = emulated_costs(cfg)
        prefill = costs.prefill_s([(prompt_tokens, 0)]) + costs.sample_s(1)
        decode = costs.decode_s(1, prompt_tokens + 1) + costs.sample_s(1)
        per_token = KVCache.bytes_per_token(cfg.model, torch_dtype(cfg.dtype))
        log.info("reference (%s): prefill %.2f ms, decode step %.3f ms", em.label,
                 prefill * 1e3, decode * 1e3)
        return Reference(prompt_tokens, prefill, decode, per_token)

    @cached_property
    def link(self) -> LinkEmulation:
        o, block = self.opts, 16
        if o.link_gbps is not None:
            return LinkEmulation.from_gbps(self.reference, o.link_gbps, block)
        return LinkEmulation.from_ratio(self.reference, o.transfer_compute_ratio, block)

    @property
    def max_model_len(self) -> int:
        return min(2048, self.model_config.max_position_embeddings)

    @property
    def vocab_range(self) -> tuple[int, int]:
        return 1, self.model_config.vocab_size - 1

    def base_config(self) -> ServeConfig:
        """The default configuration every study starts from (and shares)."""
        data = {
            "model": {"path": str(self.model_dir), "device": "cpu",
                      "max_model_len": self.max_model_len,
                      **({"emulate": self.opts.emulate, "model_shape": self.opts.model_shape,
                          "emulate_kv_fraction": self.opts.emulate_kv_fraction,
                          "dtype": "bfloat16"} if self.opts.emulate else {})},
            "pools": {"cpus_per_worker": 1.0, "max_restarts": 0},
            "cache": {"kv_cache_memory_gb": 0.25, "enable_prefix_caching": False},
            "scheduler": {"max_prefill_chunk": 256, "max_num_batched_tokens": 256,
                          "tenant_weights": dict(self.opts.tenant_weights)},
            "transfer": {"connector": "tcp"},
        }
        return ServeConfig.from_dict(data).with_values(self.link.config_values())

    def selected(self, names: Sequence[str]) -> list[str]:
        """The configuration names to run: all, or those named by ``--configs``."""
        if not self.opts.configs:
            return list(names)
        unknown = set(self.opts.configs) - set(names)
        if unknown:
            raise ValueError(f"unknown configuration(s) {sorted(unknown)}; this study has "
                             f"{list(names)}")
        return [n for n in names if n in self.opts.configs]

    def n_requests(self, quick: int, full: int) -> int:
        """A study's request count: ``--num-requests``, else its own times ``load_scale``."""
        if self.opts.num_requests:
            return self.opts.num_requests
        return max(1, round((quick if self.opts.quick else full) * self.load_scale))

    def run(self, study: str, name: str, cfg: ServeConfig,
            work: Sequence[WorkloadRequest] | Drive, layout: Layout = DISAGG,
            **metric_kw: Any) -> ConfigRun:
        """Launch (or reuse) ``cfg``, run ``work`` with a progress bar, export traces."""
        from tqdm import tqdm

        t0 = time.monotonic()
        drive = work if isinstance(work, Drive) else Drive.of(work)
        svc = self.pool.get(cfg, layout)
        bar = tqdm(total=drive.total, desc=f"{study} {name}", unit="req",
                   disable=not self.opts.progress, leave=False)
        try:
            out = svc.run_workload(drive, transport=self.opts.transport,
                                   on_done=lambda _: bar.update(1))
        finally:
            bar.close()
        run = ConfigRun(name, cfg, layout, out, slos=dict(self.opts.slos), **metric_kw)
        if out.events:
            em = self.opts.emulate_config
            run.files = write_trace_files(self.out, study, name, with_emulated_link(
                out.events, cfg.transfer.link_gbps), em.label if em is not None else None)
        log.info("%s %s: %d requests in %.1fs (service up in %.1fs)", study, name,
                 len(out.records), time.monotonic() - t0, svc.startup_s)
        return run

    def close(self) -> None:
        self.pool.close()
