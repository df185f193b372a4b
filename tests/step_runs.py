"""Synthetic traced runs for the step-fit tests (tools/sim_validate_fits.py): linear
synthetic costs, and a run whose prefill and decode steps are made of given offsets."""

from __future__ import annotations

import numpy as np

from bench.records import RequestRecord
from bench.studies.service import RunOutput
from engine.costs.loader import load_costs
from engine.tracing import TraceEvent
from sim.synthetic import synthetic_calibration

MS = 1e-3
DECODE_BATCHES = (3, 3, 3, 2, 2, 2, 1, 1, 1, 1)


def linear_costs():
    return load_costs(synthetic_calibration(
        prefill=lambda c, p: 1e-5 * c + 2e-8 * c * p, decode=lambda b, L: 2e-4 + 1e-5 * b,
        sample_s=1e-5, step_overhead_s=3e-4))


def step_run(base, *, p_scale: float, p_offset: float, post: float, d_scale: float,
         d_offset: float, gaps: tuple[float, ...] = (), nap_at: int | None = None
         ) -> RunOutput:
    """Prefill steps whose spans are ``p_scale * calibrated + p_offset`` and whose mean
    step is the mean span plus ``post``; decode steps at batch 1..3 whose periods are
    ``d_scale * calibrated + d_offset`` plus the sampling (the batch shrinks, so only the
    first step is one that legs join); ``gaps`` delays the next step (its legs running
    on); after step ``nap_at`` all legs end, 10 ms pass, new ones run."""
    events, records, spans = [], [], []
    t = 0.0
    for i, (c, p) in enumerate([(16, 0), (64, 0), (128, 128), (256, 0), (256, 256),
                                (32, 0)]):
        span = p_scale * base.prefill_s([(c, p)]) + p_offset
        leg = f"r{i}#x#1"
        events.append(TraceEvent(leg, "prefill_chunk", "prefill-0", t, t + span,
                                 scheduled_tokens=c, past_kv_tokens=p, token_start=p,
                                 token_end=p + c))
        records.append(RequestRecord(f"r{i}", p + c, 0.0, queue_s=(0.1 + i) * MS))
        spans.append(span)
        t += span + 0.01
    t, epoch = 100.0, 0
    for k, b in enumerate(DECODE_BATCHES):
        past = [40 + j for j in range(b)]
        run = base.decode_run_s(b, sum(past) + b, max(past) + 1, 1)
        period = d_scale * float(np.asarray(run)[0]) + d_offset + base.sample_s(b)
        for j in range(b):
            events.append(TraceEvent(f"d{j}-{epoch}#x#1", "decode_step", "decode-0", t,
                                     t + period * 0.8, past_kv_tokens=past[j]))
        t += period + (gaps[k] if k < len(gaps) else 0.0)
        if k == nap_at:
            t, epoch = t + 0.01, epoch + 1
    stats = {"prefill-0": {"role": "prefill", "steps": len(spans),
                           "mean_step_s": float(np.mean(spans)) + post},
             "decode-0": {"role": "decode", "steps": len(DECODE_BATCHES), "mean_step_s": MS}}
    return RunOutput(records, events, stats)
