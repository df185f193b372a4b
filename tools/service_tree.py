"""The service under tools/control_plane.py: `pdserve serve` (1 prefill + 1 decode
worker, tiny model) in its own session, and its process tree's CPU per group (front
door(s), decode worker, prefill worker, Ray daemons), summed with psutil.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

GROUPS = ("front door", "decode", "prefill", "ray daemons")


def group_of(proc) -> str:
    try:
        cmd = " ".join(proc.cmdline())
    except Exception:  # gone or not ours to read
        return "ray daemons"
    if "DecodeWorker" in cmd:
        return "decode"
    if "PrefillWorker" in cmd:
        return "prefill"
    if "cluster.serve.front_door" in cmd:  # the extra front doors of --api-servers
        return "front door"
    return "ray daemons"


def tree_cpu(root_pid: int) -> dict[int, tuple[str, float]]:
    """pid -> (group, user + system CPU seconds) of `root_pid` and its descendants."""
    import psutil

    out = {}
    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return out
    for p in procs:
        try:
            t = p.cpu_times()
            out[p.pid] = ("front door" if p.pid == root_pid else group_of(p), t.user + t.system)
        except psutil.Error:
            continue
    return out


def cpu_delta(before: dict, after: dict) -> dict[str, float]:
    groups = dict.fromkeys(GROUPS, 0.0)
    for pid, (group, cpu) in after.items():
        groups[group] += cpu - before.get(pid, (group, 0.0))[1]
    return groups


@dataclass
class Service:
    """`pdserve serve` (1P + 1D, tiny model) in its own session (process group)."""

    extra: list[str] = field(default_factory=list)
    profile: Path | None = None  # cProfile output of the whole run
    native_dir: Path | None = None  # py-spy profiles of each load window go here
    threads_dir: Path | None = None  # the CPU per thread of each load window goes here
    proc: subprocess.Popen | None = None
    addr: str = ""

    @property
    def loop(self) -> str:
        """The front door's event loop (runtime/event_loop.py) under these flags."""
        from runtime.event_loop import resolve

        flags = self.extra
        kind = flags[flags.index("--event-loop") + 1] if "--event-loop" in flags else "auto"
        return resolve(kind)

    def start(self, max_num_seqs: int) -> None:
        serve = ["-m", "cluster.cli", "serve", "--port", "0", "--model", "tiny",
                 "--prefill-workers", "1", "--decode-workers", "1",
                 "--max-num-seqs", str(max_num_seqs), "--log-level", "warning", *self.extra]
        pre = ["-m", "cProfile", "-o", str(self.profile)] if self.profile else []
        self.proc = subprocess.Popen([sys.executable, *pre, *serve], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        deadline = time.monotonic() + 300
        for line in self.proc.stdout:
            if "serving pdserve.v1.Generation on" in line:
                self.addr = line.split(" on ", 1)[1].split()[0]
                return
            if time.monotonic() > deadline:
                break
        self.stop()
        raise RuntimeError("pdserve serve did not start")

    def stop(self) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        p.send_signal(signal.SIGINT)  # drains, then shuts Ray down
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # the session this bench started
            p.wait(10)
