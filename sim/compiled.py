"""The opt-in compiled simulator: the same source, compiled with mypyc (`make sim-fast`).

`make sim-fast` (tools/sim_build_fast.py) copies pdserve's packages into build/simfast/ and
compiles the simulator's hot modules there (``COMPILED``: sim/'s event loop, workers,
links, router and cost model, and the real policy code they run) with mypyc, next to
the copied sources. Nothing imports from that directory unless asked: the service and
`make test` run the source tree. `python -m tools.sim_bench_scale` and `pdserve simulate`, run
from the command line, re-execute themselves on the build (``reexec``) when it is there
and was built from the source as it is now (``--code auto``, the default; ``compiled``
insists, ``interpreted`` never), and print which code ran. A build older than any source
file is never used: the simulator must run the code the service runs.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / "simfast"
MANIFEST = "MANIFEST.json"  # in BUILD: the hash of every file it was built from
PACKAGES = ("engine", "kv_transfer", "runtime", "prefill_worker", "decode_worker", "cluster",
            "proto", "bench", "sim")
DATA = ("engine/data/*.txt", "engine/attention/*.cpp", "engine/models/*.cpp", "bench/data/*.json")
# the modules compiled (the rest of the copy runs interpreted): sim/'s own hot path, then
# the policy code it runs (a profile of `python -m tools.sim_bench_scale --policy-share` picks them).
COMPILED = (
    "sim/loop.py", "sim/worker.py", "sim/decode_runs.py", "sim/decode_kv.py", "sim/decode.py",
    "sim/prefill.py", "sim/link.py", "sim/admission.py", "sim/router_upkeep.py",
    "sim/router_reserve.py", "sim/router.py", "engine/costs/model.py", "engine/costs/analytic.py",
    "engine/block_manager.py", "engine/request.py", "decode_worker/scheduler.py",
    "prefill_worker/scheduler.py", "prefill_worker/policies.py", "cluster/router/policies.py",
    "kv_transfer/send_queue.py", "kv_transfer/link_scheduler.py", "cluster/router/admission.py",
    "cluster/router/pool.py", "sim/adapters.py", "sim/cluster.py", "sim/executor.py",
    "prefill_worker/engine.py",
)
ENV = "PDSERVE_SIM_COMPILED"  # set in the re-executed process: the build it runs on
CODES = ("auto", "compiled", "interpreted")


def source_files(root: Path = ROOT) -> list[str]:
    """The files a build copies: every .py of the packages and their package data."""
    out: set[str] = set()
    for pkg in PACKAGES:
        for p in (root / pkg).rglob("*.py"):
            if "__pycache__" not in p.parts:
                out.add(p.relative_to(root).as_posix())
    for pattern in DATA:
        out.update(p.relative_to(root).as_posix() for p in root.glob(pattern))
    return sorted(out)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def unusable(build: Path = BUILD) -> str | None:
    """Why the build cannot run the current source (None: it can)."""
    try:
        built = json.loads((build / MANIFEST).read_text())
    except (OSError, ValueError):
        return f"no compiled build in {build} (`make sim-fast` makes one)"
    if built.get("python") != sys.version.split()[0]:
        return f"the compiled build is for Python {built.get('python')}: run `make sim-fast`"
    files = built.get("files", {})
    now = source_files()
    if sorted(files) != now:
        added = sorted(set(now) - set(files)) or sorted(set(files) - set(now))
        return f"the compiled build is stale ({added[0]} added or removed): run `make sim-fast`"
    for rel in now:
        if digest(ROOT / rel) != files[rel]:
            return f"the compiled build is stale ({rel} changed): run `make sim-fast`"
    return None


def running() -> str:
    """Which code this process runs: a line for the output."""
    build = os.environ.get(ENV)
    origins = [importlib.util.find_spec(m[:-3].replace("/", ".")) for m in COMPILED]
    native = sum(1 for s in origins if s is not None and (s.origin or "").endswith(".so"))
    if build and native == len(COMPILED):
        return f"compiled (mypyc: {native} modules from {build})"
    if build:
        return f"interpreted: only {native} of {len(COMPILED)} compiled modules load from {build}"
    return "interpreted (the source tree)"


def reexec(code: str, module_argv: list[str]) -> str | None:
    """In a command-line process: re-execute ``python -P -m ...module_argv`` on the build
    (does not return) when ``code`` asks for it and the build is usable. Returns an error
    when ``code`` is "compiled" and it is not, else None (run on)."""
    if code == "interpreted" or os.environ.get(ENV):
        return None
    why = unusable()
    if why is not None:
        return why if code == "compiled" else None
    env = dict(os.environ, **{ENV: str(BUILD)})
    # the source tree after the build: what the build does not copy (tools/) still imports
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(BUILD), str(ROOT), env.get("PYTHONPATH"))
                                        if p)
    sys.stdout.flush()
    sys.stderr.flush()
    # -P: not the current directory first (it may be the source tree)
    os.execve(sys.executable, [sys.executable, "-P", "-m", *module_argv], env)
    return None  # (not reached)
