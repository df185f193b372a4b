"""The figures of bench/sim_validate.py: what a run is summarised to (TTFT / ITL
percentiles and the terms they are made of, from records, worker stats and traces), the
contention factors, and the table with the term furthest off where a figure misses."""

from __future__ import annotations

from typing import Any

import numpy as np

GOAL = 0.10


def _by_request(events) -> dict[str, dict[str, list]]:
    out: dict[str, dict[str, list]] = {}
    for e in events:  # leg ids are "<request_id>#...": the request's legs together
        out.setdefault(e.request_id.split("#")[0], {}).setdefault(e.phase, []).append(e)
    return out


def control_terms(out) -> dict[str, float | None]:
    """From the traces against the client's times (wall clock): dispatch (send -> first
    prefill chunk), first-token delivery (last chunk's end -> first token) and token
    delivery p50 / p99 (a decode step's end -> its token at the client)."""
    ev, off = _by_request(out.events), out.wall_offset
    dispatch, first, lags = [], [], []
    for r in out.records:
        e = ev.get(r.request_id, {})
        chunks = sorted(e.get("prefill_chunk", []), key=lambda x: x.start)
        steps = sorted(e.get("decode_step", []), key=lambda x: x.end)
        if not r.success or not chunks or not r.token_times:
            continue
        t = [x + off for x in r.token_times]
        dispatch.append(chunks[0].start - (r.send_time + off))
        first.append(t[0] - chunks[-1].end)
        if len(steps) == len(t) - 1:  # one leg, no preemption: step k made token k + 1
            lags += [a - s.end for a, s in zip(t[1:], steps, strict=True)]
    q = (lambda xs, p: float(np.percentile(xs, p)) if xs else None)  # noqa: E731
    return {f"{name} p{p}": q(xs, p) for name, xs in (
        ("dispatch", dispatch), ("first-token delivery", first), ("token delivery", lags))
        for p in (50, 99)}


def summarize(out) -> dict[str, Any]:
    """TTFT / ITL percentiles and the terms the diagnosis compares."""
    from bench.metrics import compute_metrics
    from bench.studies.service import mean_step_s

    m = compute_metrics(out.records)

    def pct(field: str, p: int) -> float | None:
        xs = [getattr(r, field) for r in out.records if getattr(r, field) is not None]
        return float(np.percentile(xs, p)) if xs else None

    return {"ttft_p50": m.ttft.median, "ttft_p99": m.ttft.percentiles[99.0],
            "itl_p50": m.itl.median, "itl_p99": m.itl.percentiles[99.0],
            "completed": m.completed, "failed": m.failed,
            "terms": {"prefill step": mean_step_s(out.worker_stats, "prefill"),
                      "decode step": mean_step_s(out.worker_stats, "decode"),
                      **{f"{name} p{p}": pct(field, p) for name, field in (
                          ("prefill queue", "queue_s"), ("prefill phase", "prefill_s"),
                          ("KV transfer", "transfer_s")) for p in (50, 99)},
                      **control_terms(out)}}


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


def rel(real: float | None, sim: float | None) -> float | None:
    if real is None or sim is None or real <= 0:
        return None
    return (sim - real) / real


# the terms a metric is made of: TTFT = dispatch + queueing + the prefill's steps + the
# first token's delivery; ITL p50 = a decode step or its delivery; ITL p99 = a decode step,
# the wait for a leg's KV or a late delivery
TERMS = {f"ttft_p{p}": tuple(f"{t} p{p}" for t in (
    "dispatch", "prefill queue", "prefill phase", "first-token delivery")) for p in (50, 99)}
TERMS.update({"itl_p50": ("decode step", "token delivery p50"),
              "itl_p99": ("decode step", "KV transfer p99", "token delivery p99")})


def diagnose(real: dict, sim: dict, metric: str) -> str:
    """The term of ``metric`` whose simulated value is furthest off in seconds (among those
    off in the same direction as the metric, when any is)."""
    if metric.startswith("itl") and real["terms"]["decode step"] and \
            (real[metric] < 0.5 * real["terms"]["decode step"]) != \
            (sim[metric] < 0.5 * sim["terms"]["decode step"]):
        # one side's client saw several steps' tokens at once and the other's did not
        side = "real" if real[metric] < sim[metric] else "simulated"
        return f"token delivery (only the {side} tokens arrive coalesced)"
    errs = {t: (real["terms"].get(t), sim["terms"].get(t)) for t in TERMS[metric]}
    errs = {t: (a, b) for t, (a, b) in errs.items() if a is not None and b is not None}
    if not errs:
        return "?"
    # the term furthest off in the direction the metric is off, if any is
    sign = 1 if sim[metric] > real[metric] else -1
    same = {k: v for k, v in errs.items() if (v[1] - v[0]) * sign > 0} or errs
    t = max(same, key=lambda k: abs(same[k][1] - same[k][0]))
    a, b = errs[t]
    gap = sim[metric] - real[metric]
    share = f", {(b - a) / gap:.0%} of the gap" if gap else ""
    return f"{t} {a * 1e3:.2f} -> {b * 1e3:.2f} ms{share}"


def describe(cal, rows: list[dict]) -> str:
    """What the simulated side knows: how its calibration and control plane were taken."""
    w, c = cal.data.get("workload", {}), cal.data.get("control", {})
    d, svc = c.get("delivery", {}), c.get("service", {})
    lines = [f"calibration: {w.get('stat', 'min')} of {w.get('repeats')} timings per point, "
             f"taken in this run before the real runs (load average "
             f"{', '.join(f'{x:.1f}' for x in w.get('load_average', []))})"]
    fs = [r["factors"] for r in rows if "factors" in r]
    if fs:
        lines.append(
            "compute scaled per row and role by the contention measured on a first run of the "
            "same configuration and workload just before the compared one (run 2): real mean "
            "step / simulated; prefill x" + "..x".join(f"{f:.2f}" for f in (
                min(f["prefill"] for f in fs), max(f["prefill"] for f in fs)))
            + ", decode x" + "..x".join(f"{f:.2f}" for f in (
                min(f["decode"] for f in fs), max(f["decode"] for f in fs)))
            + "; control plane (rpc_s and delivery) by real / simulated dispatch there: x"
            + "..x".join(f"{f:.2f}" for f in (
                min(f["control"] for f in fs), max(f["control"] for f in fs))))
    if svc:
        lines.append(
            f"control plane measured on a real 1P1D service at idle ({svc['requests']} "
            f"requests): dispatch {svc['dispatch_s_median'] * 1e3:.2f} ms (rpc_s = "
            f"{c['rpc_s'] * 1e3:.2f} ms per message), first token +{d['first_token_s'] * 1e3:.2f}"
            f" ms, tokens +{d['token_s'] * 1e3:.2f} ms after their step, "
            f"{d['gap_s'] * 1e3:.2f} ms between deliveries per {d['scope']}, every "
            f"{d.get('stall_every') or '-'}th held {d.get('stall_s', 0) * 1e3:.2f} ms longer "
            f"(fit error {svc['fit_mean_abs_err_s'] * 1e3:.2f} ms per quantile)")
    else:
        lines.append("control plane: " + cal.source_of("control.delivery"))
    return "\n".join(lines)


METRICS = ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99")


def table(rows: list[dict]) -> str:
    head = ("config", "load", "TTFT p50 ms real/sim/err", "TTFT p99 ms real/sim/err",
            "ITL p50 ms real/sim/err", "ITL p99 ms real/sim/err",
            "noise: run 1 vs 2 (TTFT p50/p99, ITL p50/p99)", "term off (sim vs real)")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells, off = [r["config"], r["load"]], []
        for k in METRICS:
            a, b = r["real"][k], r["sim"][k]
            e = rel(a, b)
            cells.append(f"{a * 1e3:.1f} / {b * 1e3:.1f} / {e:+.0%}" if e is not None else "-")
            if e is not None and abs(e) > GOAL:
                off.append(f"{k}: {diagnose(r['real'], r['sim'], k)}")
        rep = r.get("repeat")
        noise = [rel(r["real"][k], rep[k]) for k in METRICS] if rep else []
        cells.append(" / ".join("-" if e is None else f"{e:+.0%}" for e in noise) or "-")
        cells.append("; ".join(dict.fromkeys(off)) or "within 10%")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
