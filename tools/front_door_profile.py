"""A native profile of the front door (and of each worker) for tools/control_plane.py
--profile.

With py-spy available (`pip install py-spy`, or the `profile` extra), `NativeProfile`
samples the running front door (`py-spy record --native --threads`, Python and C/Cython
frames of every thread) over one measured window and writes the collapsed stacks
(`<tag>.collapsed`, for flamegraph.pl / speedscope) and a summary (`<tag>.txt`): each
thread's running and waiting samples, then the top frames of the running samples by self
and by inclusive count. tools/control_plane.py profiles the bare grpc floor server the
same way, so the two compare frame by frame. Without py-spy, tools/control_plane.py falls back to cProfile (the
event-loop thread's Python functions only, `cprofile_summary`).

    python -m tools.front_door_profile summarize out/front_door_256.collapsed
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

RATE_HZ = 250  # samples per second: high enough for a 10 s window, low perturbation
_LINE = re.compile(r" \(([^()]*?):\d+\)$")  # " (file.py:123)" after a Python frame
WAITS = frozenset({"epoll_wait", "epoll_pwait", "poll", "select", "pthread_cond_wait", "pthread_cond_timedwait",
                   "PyThread_acquire_lock_timed", "sem_wait", "sem_timedwait", "nanosleep",
                   "clock_nanosleep", "syscall", "accept", "accept4"})  # (abseil's futex waits
# go by syscall; a blocking socket's recv, e.g. a worker's channel reader, counts as running)
_ADDR = re.compile(r"^0x([0-9a-f]+) \((.*)\)$")  # an unsymbolized native frame


def py_spy() -> str | None:
    """The py-spy executable (next to this interpreter first), or None."""
    here = Path(sys.executable).with_name("py-spy")
    return str(here) if here.exists() else shutil.which("py-spy")


def frame_name(frame: str) -> str:
    """`func (pkg/file.py:123)` -> `func (pkg/file.py)`: frames count per function."""
    return _LINE.sub(r" (\1)", frame)


def read_maps(pid: int) -> list[tuple[int, int, int]]:
    """(start, end, file offset) of each file mapping of `pid`."""
    out = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 6:
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out.append((lo, hi, int(parts[2], 16)))
    return out


def stable_frame(frame: str, maps: list[tuple[int, int, int]]) -> str:
    """`0x7f40e14e6c21 (lib.so)` -> `lib.so+0x5e6c21` (its offset in the file, the same
    in every process and run), so stripped libraries (grpc's cygrpc) compare across
    profiles and against `objdump` of the file."""
    m = _ADDR.match(frame)
    if m is None:
        return frame
    addr = int(m.group(1), 16)
    for lo, hi, off in maps:
        if lo <= addr < hi:
            return f"{m.group(2)}+{addr - lo + off:#x}"
    return frame


def read_collapsed(path: Path, maps: list[tuple[int, int, int]] = ()
                   ) -> list[tuple[list[str], int]]:
    out = []
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if stack and n.isdigit():
            out.append(([stable_frame(frame_name(f), maps) for f in stack.split(";")], int(n)))
    return out


def waiting(frames: list[str]) -> bool:
    """A sample blocked in the kernel (epoll, a lock, a condition: the GIL's too), which
    py-spy --native counts like a running one."""
    return any(f.split(" (", 1)[0] in WAITS for f in frames)


def summarize(stacks: list[tuple[list[str], int]], top: int = 40) -> str:
    """Running and waiting samples per thread (the first frame of a --threads stack), then
    the running samples' top frames by self (the stack's leaf) and inclusive count."""
    total = sum(n for _, n in stacks) or 1
    run: Counter = Counter()
    wait: Counter = Counter()
    self_: Counter = Counter()
    incl: Counter = Counter()
    for frames, n in stacks:
        if waiting(frames):
            wait[frames[0]] += n
            continue
        run[frames[0]] += n
        self_[frames[-1]] += n
        for f in set(frames[1:]):
            incl[f] += n
    busy = sum(run.values()) or 1
    lines = [f"{total} samples, {busy} running (share of all samples: running / waiting)",
             "", "by thread:"]
    lines += [f"  {run[t] / total:6.1%} / {wait[t] / total:6.1%}  {t}"
              for t in sorted(set(run) | set(wait), key=lambda t: -run[t])]
    for title, c in (("self", self_), ("inclusive", incl)):
        lines += ["", f"top {top} by {title} samples (share of running samples):"]
        lines += [f"  {n / busy:6.1%}  {f}" for f, n in c.most_common(top)]
    return "\n".join(lines) + "\n"


class NativeProfile:
    """py-spy recording `pid` between start() and stop()."""

    def __init__(self, exe: str, pid: int, out_dir: Path, tag: str):
        self.exe, self.pid = exe, pid
        self.collapsed = out_dir / f"{tag}.collapsed"
        self.summary = out_dir / f"{tag}.txt"
        self.proc: subprocess.Popen | None = None
        self.maps: list[tuple[int, int, int]] = []

    def start(self) -> None:
        self.maps = read_maps(self.pid)
        self.proc = subprocess.Popen(
            [self.exe, "record", "--native", "--threads", "--rate", str(RATE_HZ),
             "--format", "raw", "--pid", str(self.pid), "--output", str(self.collapsed)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def stop(self) -> Path | None:
        """Stop sampling, write the summary; its path (None when py-spy failed)."""
        p = self.proc
        if p is None:
            return None
        if p.poll() is None:
            p.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        try:
            _, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        if not self.collapsed.exists():  # e.g. a window shorter than py-spy's attach
            self.summary.write_text(f"py-spy wrote no profile (exit {p.returncode}): "
                                    f"{(err or '').strip()[-500:]}\n")
            return None
        self.summary.write_text(summarize(read_collapsed(self.collapsed, self.maps)))
        return self.summary


def cprofile_summary(prof: Path, top: int = 40) -> Path:
    """The fallback without py-spy: cProfile's top functions by own time, as text."""
    import pstats

    out = prof.with_suffix(".txt")
    with out.open("w") as f:
        pstats.Stats(str(prof), stream=f).sort_stats("tottime").print_stats(top)
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "summarize":
        print(__doc__, file=sys.stderr)
        return 2
    sys.stdout.write(summarize(read_collapsed(Path(args[1]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
