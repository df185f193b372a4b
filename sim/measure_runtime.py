"""Runtime timings for `pdserve calibrate`: KV links per connector, the worker engines'
per-step overhead beyond the model, and the control plane's call latency (Ray).

Links: one chunk at a time from a real sender to a real receiver in this process (the
``inproc`` and ``tcp`` connectors), from ``send`` until the receiver hands the chunk out;
``latency_s`` and ``bytes_per_s`` are the line through those points. A quick
measurement: the real deployment has the two ends in different processes.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from sim.measure import Measurer

_ids = itertools.count()


def measure_link(m: Measurer, connector: str, token_counts: Sequence[int]) -> dict[str, Any]:
    T = m.T
    cfg = T.TransferConfig(connector=connector, secret=secrets.token_bytes(32),
                           max_frame_bytes=64 << 20, credit_window_bytes=256 << 20)
    kw = {"name": f"cal-rx-{next(_ids)}"} if connector == "inproc" else {}
    rx = T.make_receiver(cfg, **kw)
    tx = T.make_sender(cfg, **({"name": "cal-tx"} if connector in ("inproc", "tcp") else {}))
    points = []
    try:
        for n in token_counts:
            payload = m.payload(n)
            times = []
            for rep in range(m.repeats + 1):
                rid = f"cal-{connector}-{n}-{rep}"
                chunk = T.KVChunk(rid, 0, 0, n, payload, is_final=True, first_token=1)
                t0 = time.perf_counter()
                tx.send(chunk, dest=rx.endpoint)
                got = None
                while got is None:
                    rx.wait(1.0)
                    for c in rx.poll().chunks:
                        rx.release(c)
                        if c.request_id == rid and c.is_final:
                            got = time.perf_counter() - t0
                if rep:
                    times.append(got)
            points.append((int(payload.numel() * payload.element_size()), m.reduce(times)))
    finally:
        tx.close()
        rx.close()
    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points])
    slope, intercept = np.polyfit(x, y, 1) if len(x) > 1 else (0.0, y[0])
    if slope <= 0:  # the larger chunk was no slower: bandwidth beyond what was measured
        slope = max((y[-1] - y[0]) / max(x[-1] - x[0], 1.0), 1e-12)
    return {"latency_s": float(max(intercept, 0.0)), "bytes_per_s": float(1.0 / slope),
            "points": [{"bytes": b, "seconds": s} for b, s in points],
            "note": "in-process sender and receiver, one chunk at a time"}


def _wrap_timer(obj: Any, name: str, acc: list[float], sync) -> None:
    fn = getattr(obj, name)

    def timed(*a, **kw):
        sync()
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        sync()
        acc.append(time.perf_counter() - t0)
        return out

    setattr(obj, name, timed)


def _check_timed(*timed: list[float]) -> None:
    """The engine's step went through the wrapped calls: else what is subtracted is 0 and
    the overhead silently holds the model (as when the wrappers sat on methods the
    engines do not call)."""
    if not all(timed):
        raise RuntimeError("calibrate: an engine step ran without the timed ModelRunner.run "
                           "/ KVCache.export_async calls; the overhead would hold the model")


def measure_overheads(m: Measurer, items: Sequence[int], sample_s) -> dict[str, Any]:
    """Per-step engine time beyond the model (scheduler, bookkeeping, events) for steps
    of ``n`` requests: wall time of ``step()`` minus the model (``ModelRunner.run``), the
    KV copies (``export_async``) and the sampling (``sample_s(rows)``, measured before);
    and ``decode_join_s``: what the model's step takes more when a leg runs its first
    decode step (the step its KV completed in) than in the next, at batch 1."""
    T, cfg = m.T, m.cfg
    tcfg = T.TransferConfig(connector="inproc", max_frame_bytes=64 << 20)
    rx = T.make_receiver(tcfg, name=f"cal-ovh-{next(_ids)}")
    tx = T.make_sender(tcfg, name="cal-ovh-tx")
    pre = T.PrefillEngine("cal-prefill", cfg, T.PrefillSchedulerConfig(
        max_num_batched_tokens=max(items) * 8, max_prefill_chunk=8, max_num_seqs=max(items)),
        tx, m.num_blocks)
    dec = T.DecodeEngine("cal-decode", cfg, T.DecodeSchedulerConfig(
        max_num_seqs=max(items), max_model_len=m.max_len), rx, m.num_blocks)
    out: dict[str, Any] = {"prefill_step": {"x": [], "seconds": []},
                           "decode_step": {"x": [], "seconds": []}}
    joins: list[float] = []
    try:
        for n in items:
            pre_s, dec_s = [], []
            for rep in range(m.repeats + 1):
                legs = [f"cal-{n}-{rep}-{i}" for i in range(n)]
                sp = T.SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
                for leg in legs:
                    dec.reserve(T.DecodeTask(leg, 8, sp))
                    pre.add(T.PrefillTask(leg, m._tokens(8), sp, rx.endpoint))
                execs: list[float] = []
                copies: list[float] = []
                _wrap_timer(pre.runner, "run", execs, m._sync)  # (what the engines call)
                _wrap_timer(pre.runner.kv, "export_async", copies, m._sync)
                t0 = time.perf_counter()
                pre.step()
                wall = time.perf_counter() - t0
                del pre.runner.run, pre.runner.kv.export_async
                _check_timed(execs, copies)
                if rep:
                    pre_s.append(wall - sum(execs) - sum(copies) - sample_s(n))
                firsts: list[float] = []
                _wrap_timer(dec.runner, "run", firsts, m._sync)
                while len(dec.scheduler.running) < n:  # KV arrives, legs start
                    rx.wait(0.05)
                    dec.step()
                    pre.step()
                del dec.runner.run
                execs = []
                _wrap_timer(dec.runner, "run", execs, m._sync)
                t0 = time.perf_counter()
                dec.step()
                wall = time.perf_counter() - t0
                del dec.runner.run
                _check_timed(execs)
                if rep:
                    dec_s.append(wall - sum(execs) - sample_s(n))
                    if n == 1 and firsts:  # the leg's first step, then its second
                        joins.append(firsts[-1] - execs[0])
                for leg in legs:
                    dec.abort(leg)
                    pre.abort(leg)
            for key, vals in (("prefill_step", pre_s), ("decode_step", dec_s)):
                out[key]["x"].append(n)
                out[key]["seconds"].append(max(m.reduce(vals), 0.0))
        if not joins:
            raise RuntimeError("calibrate: no decode step at batch 1 to time a leg joining "
                               f"(step sizes {list(items)} must include 1)")
        out["decode_join_s"] = max(m.reduce(joins), 0.0)
    finally:
        tx.close()
        rx.close()
    return out


def measure_rpc(calls: int = 200) -> float:
    """One-way latency of a Ray actor call on this machine (half the fastest round trip)."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    try:
        @ray.remote(num_cpus=0.1)
        class Echo:
            def ping(self, x):
                return x

        actor = Echo.remote()
        ray.get(actor.ping.remote(0))
        rtts = []
        for i in range(calls):
            t0 = time.perf_counter()
            ray.get(actor.ping.remote(i))
            rtts.append(time.perf_counter() - t0)
        ray.kill(actor)
        return min(rtts) / 2
    finally:
        if started:
            ray.shutdown()
