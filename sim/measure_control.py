"""The control plane's costs, measured on the real service at idle (`pdserve calibrate
--control`): a 1P1D service with tracing on serves a few requests one at a time, and the
worker traces (wall clock) are set against what the client saw:

- dispatch: the client's send -> the first prefill chunk starts. It is three router <->
  worker messages (decode reservation, its reply, the prefill add), so a third of it is
  the simulator's per-message latency ``control.rpc_s``;
- first token: the last prefill chunk's compute ends -> the client has the first token,
  less what the simulator counts in that step after the compute (sampling, the KV
  export, the step overhead): ``control.delivery.first_token_s``;
- KV handoff: the last prefill chunk's compute ends -> the decode worker admits the leg
  (its KV arrived), less the same post-compute work: reported (``kv_handoff_s_median``)
  to compare with the link's in-process figure, not used (at idle it is a small
  difference of two measured figures, within their noise);
- decode tokens: each decode step's end -> the client has its token;
  ``control.delivery`` (token_s, gap_s, the stalls) is fitted to the distribution of those
  delays and of the client's inter-token gaps with the router's delivery mechanism
  (engine/costs/delivery.py).

Under load the router's CPU is shared by more streams; these idle figures do not grow
with it (the README's validation says how far that goes).
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from engine.costs.calibration import Calibration, CalibrationError
from engine.costs.delivery import Delivery, fit_delivery
from engine.costs.model import TableCosts

PROMPT, OUTPUT, SPACING_S = 96, 24, 0.3


def service_config(model_dir: str, max_model_len: int):
    """The 1P1D service measured (TCP KV link, one CPU per worker)."""
    from cluster.config.serve import ServeConfig

    return ServeConfig.from_dict({
        "model": {"path": model_dir, "device": "cpu", "max_model_len": max_model_len},
        "pools": {"cpus_per_worker": 1.0, "max_restarts": 0, "prefill_workers": 1,
                  "decode_workers": 1},
        "cache": {"kv_cache_memory_gb": 0.25, "enable_prefix_caching": False},
        "transfer": {"connector": "tcp"}})


def _requests(n: int, vocab: int) -> list:
    from bench.workload import WorkloadRequest

    return [WorkloadRequest(f"ctl-{i}", i * SPACING_S,
                            [1 + (i * 31 + j * 7) % (vocab - 1) for j in range(PROMPT)], OUTPUT)
            for i in range(n)]


def measure_control(cfg, costs: TableCosts, *, requests: int = 12,
                    log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run ``requests`` through the service of ``cfg`` at idle; the control figures."""
    from bench.studies.service import Service, ensure_ray
    from engine.loader import load_model_config

    started = ensure_ray(num_cpus=4)
    try:
        svc = Service(cfg, trace=True)
        try:
            vocab = load_model_config(cfg.model.path).vocab_size
            svc.run_workload(_requests(2, vocab))  # warm-up: first calls, first steps
            out = svc.run_workload(_requests(requests, vocab))
        finally:
            svc.close()
    finally:
        if started:
            import ray

            ray.shutdown()
    after_compute = (costs.sample_s(1) + costs.kv_export_s(PROMPT)
                     + costs.step_overhead_s("prefill", 1))
    dispatch, first, handoff, streams = samples(out, lambda r: after_compute)
    if len(streams) < max(2, requests // 2):
        raise CalibrationError(f"control-plane measurement: only {len(streams)} of {requests} "
                               "requests had complete traces")
    delivery, err = fit_streams(first, streams, costs)
    first_s = delivery.first_token_s
    scope = delivery.scope
    lags = np.concatenate([a - e for e, a in streams])
    itl = np.concatenate([np.diff(a) for _, a in streams])
    report = {"requests": len(streams), "prompt_tokens": PROMPT, "output_tokens": OUTPUT,
              "load_average": list(os.getloadavg()),
              "dispatch_s_median": statistics.median(dispatch),
              "first_token_lag_s_median": statistics.median(first),
              "token_lag_s_median": float(np.median(lags)),
              "token_lag_s_p99": float(np.percentile(lags, 99)),
              "client_itl_s_median": float(np.median(itl)),
              "coalesced_fraction": float(np.mean(itl < 1e-4)),
              "fit_mean_abs_err_s": err}
    log(f"  control plane at idle ({len(streams)} requests): dispatch "
        f"{report['dispatch_s_median'] * 1e3:.2f} ms, first token +{first_s * 1e3:.2f} ms, "
        f"tokens +{delivery.token_s * 1e3:.2f} ms with {delivery.gap_s * 1e3:.2f} ms between "
        f"deliveries per {scope}, every {delivery.stall_every or '-'}th held "
        f"{delivery.stall_s * 1e3:.2f} ms longer"
        f"{' on average (exponential sizes)' if delivery.stall_shape == 'exp' else ''} (delay p99 {report['token_lag_s_p99'] * 1e3:.2f}"
        f" ms; fit error {err * 1e3:.2f} ms per quantile)")
    if handoff:
        report["kv_handoff_s_median"] = statistics.median(handoff.values())
        conn = cfg.transfer.connector
        log(f"  KV handoff at idle: {report['kv_handoff_s_median'] * 1e3:.2f} ms after the "
            f"post-compute work (the {conn} link in-process: "
            f"{costs.link(conn).latency_s * 1e3:.2f} ms + bytes)")
    return {"rpc_s": statistics.median(dispatch) / 3, "delivery": delivery.to_dict(),
            "service": report}


def samples(out, after_compute: Callable[[Any], float]
            ) -> tuple[list[float], list[float], dict[str, float], list]:
    """From a traced run (bench/studies/service.py RunOutput), per request with complete
    traces and one decode leg: the dispatch, the first token's delay after its last chunk's
    compute (less ``after_compute(record)``: the work the simulator counts in that step
    after the compute), the KV handoff the same way (by request id), and (decode step
    ends, client arrival times) of its decode tokens, all on the wall clock."""
    by_leg: dict[str, dict[str, list]] = {}
    for e in out.events:
        by_leg.setdefault(e.request_id.split("#")[0], {}).setdefault(e.phase, []).append(e)
    dispatch: list[float] = []
    first: list[float] = []
    handoff: dict[str, float] = {}
    streams: list = []
    for r in out.records:
        ev = by_leg.get(r.request_id, {})
        chunks = sorted(ev.get("prefill_chunk", []), key=lambda e: e.start)
        steps = sorted(ev.get("decode_step", []), key=lambda e: e.end)
        if not r.success or not chunks or len(steps) != len(r.token_times) - 1:
            continue
        t = np.array(r.token_times) + out.wall_offset  # monotonic -> wall clock
        post = after_compute(r)
        dispatch.append(chunks[0].start - (r.send_time + out.wall_offset))
        first.append(t[0] - chunks[-1].end - post)
        admit = ev.get("decode_admit", [])
        if admit:
            handoff[r.request_id] = min(a.start for a in admit) - chunks[-1].end - post
        if len(steps):
            streams.append((np.array([e.end for e in steps]), t[1:]))
    return dispatch, first, handoff, streams


def fit_streams(first: list[float], streams: list, costs) -> tuple[Delivery, float]:
    """The delivery model (engine/costs/delivery.py, the router's mechanism) fitted to measured
    first-token delays and decode token streams; with its fit error."""
    # (the router's: workers push one message per step over their control channel, the
    # router applies and detokenizes what queued as one batch; nothing polls)
    return fit_delivery(streams, first_token_s=max(statistics.median(first), 0.0),
                        scope="router", poll_timeout_s=None,
                        offset_s=costs.step_overhead_s("decode", 1))


def add_control(cal_path: str | Path, cfg=None, *, requests: int = 12,
                log: Callable[[str], None] = print) -> Calibration:
    """Measure the control plane and write it into the calibration at ``cal_path``."""
    cal = Calibration.load(cal_path)
    if cfg is None:
        cfg = service_config(cal.get("model.path"), int(cal.get("workload.max_model_len")))
    got = measure_control(cfg, TableCosts(cal), requests=requests, log=log)
    cal.data["control"].update(got)
    src = cal.data.setdefault("sources", {})
    src["control.rpc_s"] = ("measured: a third of the idle dispatch latency on a 1P1D "
                            "service (send -> first prefill chunk: reserve, reply, add)")
    src["control.delivery"] = ("measured: idle 1P1D service traces vs client times; token_s "
                               "and gap_s fitted with engine/costs/delivery.py's mechanism")
    cal.save(cal_path)
    return cal
