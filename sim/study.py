"""`pdserve study NAME --simulate`: the studies' sweeps at cluster scale in the simulator.

    pdserve study chunk-size --simulate --analytic h200 --model-shape llama-3-8b \
        --prefill-workers 8 --decode-workers 24 --load-scale 8 --out study-sim
    pdserve study pacing --simulate --calibration cal.json --out study-sim

``SimStudyContext`` is a ``StudyContext`` whose ``run`` simulates a configuration
(``simulate_config``) instead of launching it, so a study's configurations, workload,
table, plots and trace files are the same code. What changes with the scale: the pools
(``--prefill-workers`` / ``--decode-workers``), the load (each study's request count and
rate times ``--load-scale``), the model (its shape, dtype and hardware from the cost
model) and the reference the emulated link is derived from (a prefill of the reference
prompt and a decode step, from the cost model). Layouts other than P/D pools
(the interference study's colocated engines) are not simulated.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from bench.studies.config_run import ConfigRun
from bench.studies.context import StudyContext, StudyOptions
from bench.studies.link import Reference
from bench.studies.service import DISAGG, Drive, Layout
from bench.studies.traces import with_emulated_link, write_trace_files
from engine.costs.calibration import Calibration
from engine.costs.loader import load_costs
from sim.adapters import ServeConfig, kv_bytes_per_token
from sim.options import SimOptions


@dataclass(frozen=True)
class SimStudy:
    calibration: str | None = None
    analytic: str | None = None
    model_shape: str = "llama-3-8b"
    dtype: str = "bfloat16"
    prefill_workers: int = 8
    decode_workers: int = 24
    load_scale: float = 8.0
    interconnect: str | None = None
    decode_order: str = "least-legs"

    def __post_init__(self) -> None:
        if (self.calibration is None) == (self.analytic is None):
            raise ValueError("--simulate needs one of --calibration FILE or --analytic PROFILE")
        if self.prefill_workers < 1 or self.decode_workers < 1 or not self.load_scale > 0:
            raise ValueError("--prefill-workers and --decode-workers >= 1, --load-scale > 0")

    def load(self) -> Calibration:
        if self.calibration is not None:
            return Calibration.load(self.calibration)
        from engine.costs.analytic import analytic_calibration

        return analytic_calibration(self.analytic, self.model_shape, self.dtype)


class SimStudyContext(StudyContext):
    """A study context whose configurations run in the simulator."""

    simulated = True

    def __init__(self, opts: StudyOptions, study: SimStudy):
        self.study = study
        self.costs = load_costs(study.load())
        link = study.interconnect or ("infiniband" if study.analytic else None)
        self.options = SimOptions(trace=opts.trace, interconnect=link,
                                  decode_order=study.decode_order)
        self.load_scale = study.load_scale
        self.simulations = 0
        super().__init__(opts)

    def _start_pool(self) -> None:  # nothing is launched
        self.pool = None

    @property
    def launches(self) -> int:
        return 0

    @property
    def shape(self) -> dict[str, Any]:
        return self.costs.calibration.get("model")

    @property
    def max_model_len(self) -> int:
        return min(2048, int(self.shape["max_position_embeddings"]))

    @property
    def vocab_range(self) -> tuple[int, int]:
        return 1, int(self.shape["vocab_size"]) - 1

    @cached_property
    def reference(self) -> Reference:
        """The reference prompt's prefill and a decode step, from the cost model."""
        c, n = self.costs, min(512, self.max_model_len // 2)
        prefill = (c.prefill_s([(n, 0)]) + c.step_overhead_s("prefill", 1) + c.sample_s(1))
        decode = c.decode_s(1, n + 1) + c.step_overhead_s("decode", 1) + c.sample_s(1)
        kvb = kv_bytes_per_token(self.shape, self.costs.calibration.get("dtype"))
        return Reference(n, prefill, decode, kvb)

    def base_config(self) -> ServeConfig:
        base = super().base_config().with_values({
            "pools.prefill_workers": self.study.prefill_workers,
            "pools.decode_workers": self.study.decode_workers})
        return base  # on a GPU profile the KV pool is sized from its memory (plan_workers)

    def credit_window_mb(self, cfg: ServeConfig) -> float:
        from sim.cluster import Simulation

        return Simulation(cfg, self.costs, self.options).plan.transfer.credit_window_bytes / float(
            1 << 20)

    def run(self, study: str, name: str, cfg: ServeConfig,
            work: Any, layout: Layout = DISAGG, **metric_kw: Any) -> ConfigRun:
        from sim.cluster import simulate_config

        if layout != DISAGG or isinstance(work, Drive):
            raise ValueError(f"{study}: the simulator runs P/D pools on a fixed workload "
                             f"(not {layout.kind} layouts or adaptive drives)")
        t0 = time.monotonic()
        out = simulate_config(cfg, work, self.costs, self.options)
        run = ConfigRun(name, cfg, layout, out, slos=dict(self.opts.slos), **metric_kw)
        if out.events:
            run.files = write_trace_files(self.out, study, name, with_emulated_link(
                out.events, cfg.transfer.link_gbps))
        self.simulations += 1
        print(f"  {study} {name}: {len(work)} requests simulated in "
              f"{time.monotonic() - t0:.1f} s", flush=True)
        return run

    def close(self) -> None:
        pass

    def describe(self) -> str:
        s = self.study
        return (f"simulated: {s.prefill_workers}P/{s.decode_workers}D, load x{s.load_scale:g}, "
                f"decode order {s.decode_order}; cost model: {self.costs.label}")


def sim_context_factory(args: argparse.Namespace) -> Callable[[StudyOptions], SimStudyContext]:
    """The study context maker of `pdserve study ... --simulate` (ValueError names a
    missing or inconsistent flag)."""
    if not args.simulate:
        raise ValueError("--calibration / --analytic go with --simulate")
    study = SimStudy(args.calibration, args.analytic, args.model_shape, args.analytic_dtype,
                     args.prefill_workers, args.decode_workers, args.load_scale,
                     args.interconnect, args.decode_order)
    return lambda opts: SimStudyContext(opts, study)
