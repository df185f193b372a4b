"""Per-thread CPU of a process over a window (Linux /proc), for tools/control_plane.py
--profile: which thread of the front door or a worker (its event loop, the channel's
reader and writer, Ray's core-worker threads, the KV receiver...) spends the CPU, native
threads included (py-spy sees Python threads only).

    snap = thread_times(pid); ...; text = table(snap, thread_times(pid), tokens)
"""

from __future__ import annotations

import os
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def thread_times(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (thread name, user + system CPU seconds) of every thread of `pid`."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / _TICK)
    return out


def table(before: dict, after: dict, tokens: int) -> str:
    """CPU per thread over the window, in seconds and microseconds per generated token,
    largest first (a Python thread's name is its native id in py-spy's summary: threads
    started by Python keep the process's name here)."""
    rows = [(cpu - before.get(tid, (name, 0.0))[1], tid, name)
            for tid, (name, cpu) in after.items()]
    total = sum(r[0] for r in rows) or 1e-9
    lines = [f"{'thread (tid)':<32} {'cpu s':>8} {'us/token':>9} {'share':>6}"]
    for cpu, tid, name in sorted(rows, reverse=True):
        if cpu > 0:
            lines.append(f"{f'{name} ({tid})':<32} {cpu:8.2f} {cpu / max(1, tokens) * 1e6:9.1f} "
                         f"{cpu / total:6.1%}")
    lines.append(f"{'total':<32} {total:8.2f} {total / max(1, tokens) * 1e6:9.1f}")
    return "\n".join(lines) + "\n"
