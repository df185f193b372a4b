"""`pdserve bench` against a service on the emulated accelerator (engine/emulate/): the
label of every figure, and the devices' busy fractions and the host's lag over the run.

The workers' stats (GetStats) carry each emulated device's busy and wall seconds since it
started and the host lag over its continuing steps (engine/emulate/device.py); the bench
takes them before and after its run and prints, per role, the busy fraction over the run
(``Device busy (prefill|decode): X%``), the host lag percentiles of the latest steps, and
one line when the host, not the emulated device, set the pace.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

PACE_SHARE = 0.10  # host lag above this share of the device's busy time: the host set the pace


def add_emulate_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("emulated accelerator (labels: pass what `pdserve serve` ran)")
    g.add_argument("--emulate", metavar="PROFILE|FILE", help="the server's --emulate (h200, "
                   "h100, a100 or a calibration file): labels every figure")
    g.add_argument("--model-shape", help="the server's --model-shape")
    g.add_argument("--emulate-kv-fraction", type=float, default=1.0,
                   help="the server's --emulate-kv-fraction (default 1)")


def emulate_label(args: argparse.Namespace) -> str | None:
    """'emulated <profile>, <shape>: analytic, not measured', or None without --emulate;
    ValueError naming a bad profile or shape."""
    if not getattr(args, "emulate", None):
        return None
    from engine.config import EmulateConfig

    if not args.model_shape:
        raise ValueError("--emulate needs --model-shape (the server's)")
    return EmulateConfig(args.emulate, args.model_shape,
                         getattr(args, "emulate_kv_fraction", 1.0)).label


async def device_snapshot(addr: str, *, token: str | None = None, tls_ca: str | None = None
                          ) -> dict[str, tuple[str, dict[str, float]]]:
    """worker id -> (role, its figures) of the workers on an emulated device ({} if none)."""
    from cluster.grpc.client import AsyncPdserveClient

    async with AsyncPdserveClient(addr, token=token, tls_ca=tls_ca, timeout=30.0) as c:
        stats = await c.stats()
    return {w.worker_id: (w.role, dict(w.extra)) for w in stats.workers
            if w.extra.get("device_wall_s")}


def device_report(before: Mapping[str, tuple[str, Mapping[str, float]]],
                  after: Mapping[str, tuple[str, Mapping[str, float]]]) -> dict[str, Any]:
    """Per role over the run: busy fraction (device seconds over wall seconds, summed over
    the role's workers), host lag (seconds, steps, the worst worker's p50 / p99 of its
    latest steps) and whether the host set the pace."""
    out: dict[str, Any] = {}
    for wid, (role, a) in after.items():
        b = before.get(wid, (role, {}))[1]
        d = {k: a.get(k, 0.0) - b.get(k, 0.0) for k in
             ("device_busy_s", "device_wall_s", "host_lag_s", "host_lag_steps",
              "process_cpu_s")}
        r = out.setdefault(role, {"workers": 0, "device_busy_s": 0.0, "device_wall_s": 0.0,
                                  "host_lag_s": 0.0, "host_lag_steps": 0.0,
                                  "process_cpu_s": 0.0,
                                  "host_lag_p50_s": 0.0, "host_lag_p99_s": 0.0})
        r["workers"] += 1
        for k, v in d.items():
            r[k] += v
        r["host_lag_p50_s"] = max(r["host_lag_p50_s"], a.get("host_lag_p50_s", 0.0))
        r["host_lag_p99_s"] = max(r["host_lag_p99_s"], a.get("host_lag_p99_s", 0.0))
    for r in out.values():
        r["busy_ratio"] = r["device_busy_s"] / r["device_wall_s"] if r["device_wall_s"] else 0.0
        r["host_set_pace"] = r["host_lag_s"] > PACE_SHARE * r["device_busy_s"]
    return out


def format_report(report: Mapping[str, Any], label: str | None,
                  output_tokens: int = 0) -> str:
    lines = [f"Emulated device: {label or 'emulated (pass --emulate/--model-shape to label it)'}"]
    for role in sorted(report):
        r = report[role]
        lines.append(f"Device busy ({role}): {100 * r['busy_ratio']:.1f}%")
    lags = " | ".join(f"{role} {1e3 * report[role]['host_lag_p50_s']:.2f}/"
                      f"{1e3 * report[role]['host_lag_p99_s']:.2f} ms" for role in sorted(report))
    lines.append(f"Host lag p50/p99: {lags}")
    if output_tokens:  # the worker processes' CPU (every thread) over the run
        cpu = " | ".join(f"{role} {1e6 * report[role]['process_cpu_s'] / output_tokens:.0f}"
                         for role in sorted(report))
        lines.append(f"Host CPU per output token (us): {cpu}")
    paced = [role for role in sorted(report) if report[role]["host_set_pace"]]
    for role in paced:
        r = report[role]
        lines.append(f"The host set the pace ({role}): its devices waited "
                     f"{r['host_lag_s']:.2f} s for the host over {r['host_lag_steps']:.0f} "
                     f"steps, {100 * r['host_lag_s'] / max(r['device_busy_s'], 1e-9):.0f}% of "
                     "their busy time")
    return "\n".join(lines)
