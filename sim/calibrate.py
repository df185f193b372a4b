"""`pdserve calibrate`: measure this machine with the real engine, write a calibration.

    pdserve calibrate --model tiny --out cal.json --quick --rpc-ms 0.5
    pdserve calibrate --model DIR --device cuda --dtype bfloat16 --out gpu.json
    pdserve calibrate --analytic h200 --model-shape llama-3-8b --out h200.json

The grid covers what the configuration to be simulated can ask for (``--max-model-len``,
``--max-num-batched-tokens``, ``--max-num-seqs``); a simulation that needs more stops
with an error naming the entry. The fit error is measured on points off the grid and on
mixed batches, and printed and stored with the tables.
"""

from __future__ import annotations

import os
import platform
import random
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.costs.calibration import FORMAT, Calibration
from engine.costs.delivery import Delivery
from engine.costs.model import TableCosts


@dataclass(frozen=True)
class Grid:
    chunk: list[int]
    context: list[int]
    batch: list[int]
    decode_context: list[int]
    rows: list[int]
    tokens: list[int]
    link_tokens: list[int]
    held_out: int


def _axis(values, hi: int) -> list[int]:
    return sorted({min(max(1, int(v)), hi) for v in values} | {hi})


def make_grid(max_len: int, max_bt: int, max_seqs: int, quick: bool) -> Grid:
    if quick:
        return Grid(_axis([1, 16], max_bt), sorted({0, max_len // 2, max_len}),
                    _axis([1], max_seqs), _axis([1, max_len // 2], max_len),
                    _axis([1], max_seqs), _axis([1, 16], max_len), [16, 256], 3)
    # dense where caches overflow: a decode step's KV reads jump in cost once they leave
    # the last-level cache (on a CPU), so contexts are sampled at 1.5x steps too
    pw = sorted({*(2 ** i for i in range(13)), *(3 * 2 ** i for i in range(11))})
    return Grid(_axis([1, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 2048], max_bt),
                sorted({0, *[p for p in pw if 64 <= p < max_len], max_len}),
                _axis([p for p in pw if p <= 64 or p in (128, 256, 512)], max_seqs),
                _axis([1, 16, *[p for p in pw if p >= 64]], max_len),
                _axis([2 ** i for i in range(13)], max_seqs),
                _axis([1, 16, 64, 256, 1024, 4096], max_len), [16, 256, 2048], 12)


def monotone(table: list[list[float | None]]) -> list[list[float | None]]:
    """Each cell at most every cell of more work (larger index on both axes): a step never
    gets cheaper with more tokens or context, so a cell above one of them is interference
    that even the fastest of its repeats did not escape. Unmeasured cells stay None."""
    rows, cols = len(table), len(table[0]) if table else 0
    out = [list(r) for r in table]
    for i in range(rows - 1, -1, -1):
        for j in range(cols - 1, -1, -1):
            if out[i][j] is None:
                continue
            for a, b in ((i + 1, j), (i, j + 1)):
                if a < rows and b < cols and out[a][b] is not None:
                    out[i][j] = min(out[i][j], out[a][b])
    return out


def _rel(measured: float, model: float) -> float:
    return abs(model - measured) / measured if measured > 0 else 0.0


def _fit(errors: list[dict]) -> dict[str, Any]:
    rel = [e["rel_err"] for e in errors]
    return {"points": errors, "mean_rel_err": float(np.mean(rel)) if rel else None,
            "max_rel_err": float(np.max(rel)) if rel else None}


def _hardware(device: str) -> dict[str, Any]:
    import torch

    hw: dict[str, Any] = {"device": device, "machine": platform.machine(),
                          "processor": platform.processor() or platform.machine(),
                          "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        hw.update(name=props.name, memory_bytes=int(props.total_memory))
    else:
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    hw["name"] = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
    return hw


def _engine() -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    import torch

    try:
        v = version("pdserve")
    except PackageNotFoundError:
        v = "unknown"
    commit = None
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        pass
    return {"pdserve": v, "git_commit": commit, "torch": torch.__version__,
            "python": platform.python_version()}


def calibrate(model: str, *, out: str | Path, device: str = "cpu", dtype: str = "float32",
              backend: str = "auto", block_size: int = 16, max_model_len: int | None = None,
              max_batch_tokens: int = 512, max_seqs: int = 64, quick: bool = False,
              repeats: int | None = None, connectors: tuple[str, ...] = ("inproc", "tcp"),
              rpc_ms: float | None = None, client_ms: float = 0.0, seed: int = 0,
              threads: int = 1, stat: str = "min",
              log: Callable[[str], None] = print) -> Calibration:
    """Measure and write the calibration file; returns it (checked by loading its model)."""
    import torch

    from sim.adapters import IDLE_WAIT_S, engine_tools, resolve_model_dir
    from sim.measure import Measurer
    from sim.measure_runtime import measure_link, measure_overheads, measure_rpc

    t_start = time.perf_counter()
    torch.set_num_threads(threads)  # as a worker with cpus_per_worker=threads sets it
    model_dir = resolve_model_dir(model)
    repeats = repeats or (5 if quick else 9)
    mc = engine_tools().load_model_config(model_dir)
    max_len = min(max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
    g = make_grid(max_len, max_batch_tokens, max_seqs, quick)
    log(f"calibrate: {model_dir} on {device} ({dtype}), max_model_len {max_len}, "
        f"batch tokens {max_batch_tokens}, seqs {max_seqs}, {'quick' if quick else 'full'} grid")
    m = Measurer(model_dir, device=device, dtype=dtype, backend=backend, block_size=block_size,
                 max_model_len=max_len, max_batch_tokens=max_batch_tokens, max_seqs=max_seqs,
                 repeats=repeats, kv_budget_bytes=1 << 30, stat=stat)
    limit = mc.max_position_embeddings
    prefill = [[m.prefill_chunks([(c, p)]) if c + p <= limit else None for p in g.context]
               for c in g.chunk]
    log(f"  prefill grid {len(g.chunk)}x{len(g.context)} done")
    decode = [[m.decode_batch([L] * b) for L in g.decode_context] for b in g.batch]
    log(f"  decode grid {len(g.batch)}x{len(g.decode_context)} done")
    sampling = [m.sampling(n) for n in g.rows]
    export = [m.kv_export(t) for t in g.tokens]
    imp = [m.kv_import(t) for t in g.tokens]
    sample_at = lambda n: float(np.interp(n, g.rows, sampling))  # noqa: E731
    overheads = measure_overheads(m, g.rows, sample_at)
    log("  sampling, KV copies and step overheads done")
    links = {c: measure_link(m, c, g.link_tokens) for c in connectors}
    sources = {"control.client_s": f"assumed: --client-ms {client_ms:g}",
               "control.idle_wait_s": "code constant: runtime/loop.py WorkerLoop",
               "control.delivery": "assumed: tokens reach the router one Ray call after "
                                   "their step, never coalesced (not measured on a service)"}
    if rpc_ms is None:
        log("  measuring Ray actor call latency ...")
        rpc_s = measure_rpc()
        sources["control.rpc_s"] = "measured: half the fastest Ray actor round trip"
    else:
        rpc_s = rpc_ms / 1000
        sources["control.rpc_s"] = f"assumed: --rpc-ms {rpc_ms:g}"
    for key in ("prefill", "decode", "sampling", "kv_export", "kv_import", "overheads", "links"):
        sources.setdefault(key, f"measured on this machine, "
                                f"{'fastest' if stat == 'min' else 'median'} of {repeats}")
    shape = {k: getattr(mc, k) for k in (
        "architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers",
        "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings",
        "tie_word_embeddings")}
    hw = _hardware(str(m.runner.device))
    data = {
        "format": FORMAT, "kind": "measured",
        "label": f"measured on {hw.get('name', hw['device'])} ({hw['device']}), "
                 f"{Path(model_dir).name} {dtype}",
        "created_unix_s": time.time(), "hardware": hw, "engine": {
            **_engine(), "attention_backend": m.runner.backend.name},
        "model": {"path": str(model_dir), "name": Path(model_dir).name, **shape},
        "dtype": dtype,
        "workload": {"quick": quick, "repeats": repeats, "stat": stat,
                     "load_average": list(os.getloadavg()), "block_size": block_size,
                     "max_model_len": max_len, "max_num_batched_tokens": max_batch_tokens,
                     "max_num_seqs": max_seqs, "kv_blocks": m.num_blocks, "seed": seed,
                     "torch_threads": threads,
                     "greedy_sampling": True},
        "prefill": {"chunk": g.chunk, "context": g.context, "seconds": monotone(prefill),
                    "seconds_raw": prefill},
        "decode": {"batch": g.batch, "context": g.decode_context, "seconds": monotone(decode),
                   "seconds_raw": decode,
                   # the torch reference attention pads a decode batch to its longest context
                   "context_stat": "max" if m.runner.backend.name == "torch" else "mean"},
        "sampling": {"x": g.rows, "seconds": sampling},
        "kv_export": {"x": g.tokens, "seconds": export},
        "kv_import": {"x": g.tokens, "seconds": imp},
        "overheads": overheads, "links": links,
        "control": {"rpc_s": rpc_s, "client_s": client_ms / 1000, "idle_wait_s": IDLE_WAIT_S,
                    # until measured on a service (sim/measure_control.py): one Ray call
                    "delivery": Delivery(rpc_s, rpc_s).to_dict()},
        "sources": sources,
    }
    cal = Calibration(data, source=Path(out).name)
    _fit_errors(cal, m, g, max_len, max_batch_tokens, seed)
    cal.data["workload"]["seconds"] = time.perf_counter() - t_start
    cal.save(out)
    return cal


def _fit_errors(cal: Calibration, m, g: Grid, max_len: int, max_bt: int, seed: int) -> None:
    """Model vs measurement off the grid: single chunks, mixed prefill batches, decode
    batches of one context and of mixed contexts."""
    costs = TableCosts(cal)
    rng = random.Random(seed)
    pre, mix, dec, dmix = [], [], [], []
    for _ in range(g.held_out):
        c = rng.randint(1, max_bt)
        p = rng.randint(0, max_len - c)
        t = m.prefill_chunks([(c, p)])
        pre.append({"chunk": c, "context": p, "measured_s": t, "model_s": costs.prefill_s([(c, p)]),
                    "rel_err": _rel(t, costs.prefill_s([(c, p)]))})
        parts, budget = [], max_bt
        while budget > 0 and len(parts) < 4:
            c = rng.randint(1, budget)
            parts.append((c, rng.randint(0, max_len - c)))
            budget -= c
        t = m.prefill_chunks(parts)
        mix.append({"chunks": parts, "measured_s": t, "model_s": costs.prefill_s(parts),
                    "rel_err": _rel(t, costs.prefill_s(parts))})
        b, L = rng.randint(1, g.batch[-1]), rng.randint(1, max_len)
        t = m.decode_batch([L] * b)
        dec.append({"batch": b, "context": L, "measured_s": t, "model_s": costs.decode_s(b, b * L),
                    "rel_err": _rel(t, costs.decode_s(b, b * L))})
        ctxs = [rng.randint(1, max_len) for _ in range(b)]
        t = m.decode_batch(ctxs)
        model = costs.decode_s(b, sum(ctxs), max(ctxs))
        dmix.append({"contexts": ctxs, "measured_s": t, "model_s": model,
                     "rel_err": _rel(t, model)})
    cal.data["prefill"]["fit"] = {"single_chunk": _fit(pre), "mixed_batch": _fit(mix)}
    cal.data["decode"]["fit"] = {"uniform_context": _fit(dec), "mixed_context": _fit(dmix)}


def fit_report(cal: Calibration) -> list[str]:
    """One line per fit: mean and max relative error off the grid."""
    lines = []
    for table in ("prefill", "decode"):
        for name, fit in cal.data.get(table, {}).get("fit", {}).items():
            if fit["mean_rel_err"] is not None:
                lines.append(f"  {table} {name}: mean error {100 * fit['mean_rel_err']:.1f}%, "
                             f"max {100 * fit['max_rel_err']:.1f}% "
                             f"({len(fit['points'])} points off the grid)")
    return lines
