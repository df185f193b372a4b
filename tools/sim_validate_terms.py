"""The under-load terms tools/sim_validate.py fits to a row's real runs against their
simulated twins: the contention factors (per role and for the control plane), the KV
handoff (its mean, or each leg's unexplained part), each request's unexplained dispatch
and first-token delivery, the link factor and the stalls' scale found by bisection over
simulated runs, and the token delivery refitted to the traces."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from tools.sim_validate_report import by_request, control_terms


def contention(real, sim) -> dict[str, float]:
    """Per role: the real workers' mean step time over the simulator's on the same run;
    for the control plane: the real median dispatch latency over the simulated one."""
    from bench.studies.service import mean_step_s

    out = {}
    for role in ("prefill", "decode"):
        a, b = mean_step_s(real.worker_stats, role), mean_step_s(sim.worker_stats, role)
        out[role] = a / b if a and b else 1.0
    a, b = control_terms(real)["dispatch p50"], control_terms(sim)["dispatch p50"]
    out["control"] = a / b if a and b and a > 0 and b > 0 else 1.0
    return out


def _after_compute(costs):
    """What the simulator counts in a final prefill step after its compute (sampling, the
    KV export, the step overhead): subtracted from trace-measured delays on both sides."""
    return lambda r: (costs.sample_s(1) + costs.kv_export_s(r.prompt_len)
                      + costs.step_overhead_s("prefill", 1))


def handoff_mean(out) -> float | None:
    """Mean KV handoff of a traced run: a leg's last chunk computed -> its decode worker
    admits it (the post-compute work, the final frames' transfer, the decode worker
    taking them at its next step)."""
    from sim.measure_control import samples

    h = samples(out, lambda r: 0.0)[2]
    return float(np.mean(list(h.values()))) if h else None


def handoff_residuals(real, sim) -> list[float]:
    """Each leg's KV handoff (its last chunk computed -> its decode worker admits it) in
    the traced ``real`` run less the same leg's in ``sim`` (the same workload simulated
    at the idle link): what the model leaves out of that leg's handoff under this load.
    The handoffs are ``handoff_mean``'s (sim/measure_control.py ``samples``)."""
    from sim.measure_control import samples

    r, s = samples(real, lambda _: 0.0)[2], samples(sim, lambda _: 0.0)[2]
    return [r[k] - s[k] for k in sorted(r) if k in s]


def arrivals(out, after_compute: Callable[[Any], float]) -> dict[str, tuple[float, float]]:
    """Per request of a traced run with its first token: its dispatch (send -> its first
    chunk's start) and its first token's delay after its last chunk's compute, less
    ``after_compute(record)`` (the work the simulator counts in that step after it)."""
    ev, off, out_ = by_request(out.events), out.wall_offset, {}
    for r in out.records:
        chunks = sorted(ev.get(r.request_id, {}).get("prefill_chunk", []), key=lambda x: x.start)
        if r.success and chunks and r.token_times:
            out_[r.request_id] = (chunks[0].start - (r.send_time + off),
                                  r.token_times[0] + off - chunks[-1].end - after_compute(r))
    return out_


def arrival_residuals(real, sim, costs) -> list[tuple[float, float]]:
    """Per request of the traced ``real`` run also in ``sim`` (the same workload simulated
    with the fitted terms, ``costs``): its dispatch less the simulated one (the waits both
    model cancel), and its first token's delay after its last chunk less the modelled
    delivery (``costs.delivery.first_token_s``; the simulated step's drawn spread lies
    after its traced compute, so the simulated delay would carry a second draw)."""
    after = _after_compute(costs)
    r, s = arrivals(real, after), arrivals(sim, after)
    first = costs.delivery.first_token_s
    return [(r[k][0] - s[k][0], r[k][1] - first) for k in sorted(r) if k in s]


def _bisect(gap: Callable[[float], float], lo: float, hi: float, iters: int) -> float:
    """The f in [lo, hi] where the increasing ``gap(f)`` crosses 0, by bisection on log f."""
    if gap(lo) >= 0:
        return lo
    if gap(hi) <= 0:
        return hi
    for _ in range(iters):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if gap(mid) < 0 else (lo, mid)
    return math.sqrt(lo * hi)


def fit_link_factor(target: float | None, simulate: Callable[[float], Any],
                    lo: float = 0.25, hi: float = 256.0, iters: int = 14) -> float:
    """The factor on the KV link's write time (latency and seconds per byte) that makes the
    simulated mean handoff equal ``target``, the real one under this load: the connector's
    threads, the receiver and the decode loop share the machine, which slows the handoff
    beyond the idle link's figures. ``simulate(f)`` runs the simulator with the link scaled
    by ``f``; the handoff grows with ``f``, so a bisection on log f finds it."""
    if target is None:
        return 1.0

    def gap(f: float) -> float:
        h = handoff_mean(simulate(f))
        return (h if h is not None else 0.0) - target

    return _bisect(gap, lo, hi, iters)


def fit_stall_scale(target: float | None, simulate: Callable[[float], Any],
                    lo: float = 0.25, hi: float = 4.0, iters: int = 10) -> float:
    """The factor on the delivery's stalls that makes the simulated ITL p99 (the median of
    the seeded runs ``simulate(f)`` gives) the real one (``target``). The stalls' size fitted on the real step ends (``fit_delivery``) sets
    the real ITL p99 there, but in the simulator the stalls meet simulated steps, whose
    own tail is narrower; so the stall term is taken end to end, as the link's is. A
    target that even ``hi`` times the stalls cannot reach is not the stalls' (the paced
    rows' ITL p99 is the KV pacing's first gap, 36-55 ms): then 1, as fitted (scaled to
    13-24 ms there, the stalls coalesced nearly every token: ITL p50 0). ``simulate(f)``
    runs the simulator with the stalls scaled by ``f``, once per seed."""
    from bench.metrics import compute_metrics

    if target is None:
        return 1.0

    def gap(f: float) -> float:
        p99s = [compute_metrics(run.records).itl.percentiles[99.0] for run in simulate(f)]
        p99s = [p for p in p99s if p is not None]
        return (float(np.median(p99s)) if p99s else 0.0) - target

    if gap(hi) < 0:
        return 1.0
    return _bisect(gap, lo, hi, iters)


def delivery_under_load(real, costs):
    """The delivery model (first token, token delays and their coalescing, stalls) fitted
    to a loaded run's traces, instead of the idle service's: (Delivery, fit error s) or
    None when too few requests had complete traces."""
    from sim.measure_control import fit_streams, samples

    _, first, _, streams = samples(real, _after_compute(costs))
    if len(first) < 2 or len(streams) < 2:
        return None
    return fit_streams(first, streams, costs)
