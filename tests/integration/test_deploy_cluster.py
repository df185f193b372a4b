"""The runbook's two-node deployment, end to end, on this machine (deploy/README.md).

Two Ray nodes started with the Ray CLI as separate process trees (`ray start --head` with a
`prefill_node` resource, `ray start --address` with a `decode_node` resource), then
`pdserve serve --address auto` pinning each pool to its node type. Checks: greedy tokens over
gRPC equal `engine.LLM`'s; after the decode node's raylet is killed the service reports the
decode pool degraded (health NOT_SERVING, GetStats and /metrics show the worker dead) and a
new request ends with UNAVAILABLE in bounded time instead of hanging.

Every process this test starts runs in its own session (process group); cleanup kills, by
pid, the members of those groups and the Ray workers that carry this test's private temp
dir in their command line. `ray stop` is not used: it kills every Ray process on the
machine, including other test runs'.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.grpc.client import PdserveClient
from engine import LLM, SamplingParams

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PROMPTS = [list(range(1, 30)), list(range(50, 140))]
MAX_TOKENS = 8
DEGRADED_WITHIN_S = 120.0  # generous bounds: the point is "ends", not "fast"
UNAVAILABLE_WITHIN_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_bin() -> str:
    exe = BIN / "ray"
    return str(exe) if exe.exists() else shutil.which("ray") or "ray"


class Procs:
    """Processes this test started; kill_all() ends exactly those, by pid: the members of
    the process groups it created, and Ray's workers (which Ray puts in groups of their
    own) found by this test's private temp dir in their command line."""

    def __init__(self, marker: str):
        self.marker = marker
        self.groups: list[int] = []
        self.on_exit: list = []  # callables run first by kill_all()

    def popen(self, args: list[str], env: dict, **kw) -> subprocess.Popen:
        proc = subprocess.Popen(args, env=env, cwd=REPO, start_new_session=True, **kw)
        self.groups.append(proc.pid)  # session leader: pgid == pid, inherited by daemons
        return proc

    @staticmethod
    def members(pgid: int) -> list[psutil.Process]:
        out = []
        for p in psutil.process_iter(["pid"]):
            try:
                if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except (ProcessLookupError, psutil.Error):
                continue
        return out

    def marked(self) -> list[psutil.Process]:
        out = []
        for p in psutil.process_iter(["pid", "cmdline"]):
            try:
                if any(self.marker in arg for arg in p.info["cmdline"] or ()):
                    out.append(p)
            except psutil.Error:
                continue
        return out

    @staticmethod
    def kill(procs: list[psutil.Process]) -> None:
        for p in procs:
            try:
                p.kill()
            except psutil.Error:
                pass

    def kill_group(self, pgid: int) -> None:
        self.kill(self.members(pgid))

    def kill_all(self) -> None:
        for fn in self.on_exit:
            fn()
        for pgid in self.groups:
            self.kill_group(pgid)
        self.kill([p for p in self.marked() if p.pid != os.getpid()])


def ray_start(procs: Procs, env: dict, temp_dir: Path, *, head_port: int | None = None,
              address: str | None = None, resources: dict[str, float],
              wait: bool = True) -> subprocess.Popen:
    """`ray start` one node (it daemonizes and exits); every port explicit so that two
    nodes, and other Ray clusters on the machine, never collide. wait=False returns the
    running `ray start` (finish it with ray_started())."""
    args = [_ray_bin(), "start", "--num-cpus", "1", "--num-gpus", "0",
            "--resources", json.dumps(resources), "--temp-dir", str(temp_dir),
            "--object-store-memory", str(80 << 20), "--disable-usage-stats",
            "--node-ip-address", "127.0.0.1",
            "--node-manager-port", str(free_port()),
            "--object-manager-port", str(free_port()),
            "--dashboard-agent-listen-port", str(free_port()),
            "--dashboard-agent-grpc-port", str(free_port()),
            "--runtime-env-agent-port", str(free_port()),
            "--metrics-export-port", str(free_port())]
    if address is None:
        args += ["--head", "--port", str(head_port), "--include-dashboard", "false",
                 "--dashboard-port", str(free_port()),
                 "--ray-client-server-port", str(free_port())]
    else:
        args += ["--address", address]
    proc = procs.popen(args, env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if wait:
        ray_started(proc)
    return proc


def ray_started(proc: subprocess.Popen) -> None:
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, f"`{' '.join(proc.args)}` failed:\n{out[-3000:]}"


class LineReader:
    """Collects a process's output lines on a thread; wait_for() never blocks forever."""

    def __init__(self, stream):
        self.lines: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            self._q.put(line)
        self._q.put(None)

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        end = time.monotonic() + timeout
        while True:
            try:
                line = self._q.get(timeout=max(0.1, end - time.monotonic()))
            except queue.Empty:
                line = ""
            if line is None:
                raise AssertionError("process exited:\n" + "".join(self.lines[-60:]))
            self.lines.append(line)
            m = re.search(pattern, line)
            if m:
                return m
            if time.monotonic() > end:
                raise AssertionError(f"no line matching {pattern!r} in {timeout:.0f}s:\n"
                                     + "".join(self.lines[-60:]))

    def tail(self, n: int = 80) -> str:
        while True:
            try:
                line = self._q.get_nowait()
            except queue.Empty:
                break
            if line is not None:
                self.lines.append(line)
        return "".join(self.lines[-n:])


def scrape(port: int) -> dict[str, list]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    return {f.name: f.samples for f in text_string_to_metric_families(text.decode())}


def until(check, timeout: float, what: str):
    """Poll check() (truthy result returned) until timeout; AssertionError names `what`."""
    end = time.monotonic() + timeout
    last = None
    while time.monotonic() < end:
        try:
            last = check()
            if last:
                return last
        except Exception as e:  # a poll may fail while the cluster changes
            last = e
        time.sleep(0.5)
    raise AssertionError(f"{what} did not happen within {timeout:.0f}s (last: {last!r})")


@pytest.fixture
def cluster_env():
    """A private token, short socket paths, per-node temp dirs; kills all it started."""
    root = Path(tempfile.mkdtemp(prefix="pdd", dir="/tmp"))  # unix socket paths stay short
    token = root / "ray_token"
    token.write_text(secrets.token_hex(32))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update({
        "PYTHONPATH": str(REPO),
        "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        # Ray >= 2.5x enables token auth on `ray start --head`; give every process of this
        # cluster (both nodes and the pdserve driver) one private token explicitly.
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token),
        # notice a dead node in ~2 s instead of ~15 s (GCS health checks of raylets)
        "RAY_health_check_period_ms": "500",
        "RAY_health_check_failure_threshold": "3",
        "RAY_health_check_initial_delay_ms": "1000",
        "TOKENIZERS_PARALLELISM": "false",
    })
    procs = Procs(str(root))
    try:
        yield root, env, procs
    finally:
        procs.kill_all()
        shutil.rmtree(root, ignore_errors=True)


def test_two_node_cluster_serves_then_degrades_when_the_decode_node_dies(cluster_env,
                                                                         tiny_model):
    root, env, procs = cluster_env
    t_start = time.monotonic()

    def step(what: str) -> None:  # shown with `pytest -s` (where the minutes go)
        print(f"[deploy-test {time.monotonic() - t_start:6.1f}s] {what}", file=sys.stderr)

    head_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    head = f"127.0.0.1:{head_port}"
    ray_start(procs, env, root / "head", head_port=head_port, resources={"prefill_node": 1})
    step("head node up")
    worker = ray_start(procs, env, root / "worker", address=head,
                       resources={"decode_node": 1}, wait=False)
    decode_node_group = worker.pid
    # meanwhile, the launchers' gate before `pdserve serve` (deploy/ray-cluster.yaml,
    # kuberay/rayjob.yaml) waits for the decode node to join
    gate = subprocess.run(
        [str(BIN / "python"), str(REPO / "deploy" / "wait_for_resources.py"), "--timeout", "180",
         "--interval", "1", "CPU=2", "prefill_node=1", "decode_node=1"],
        env={**env, "RAY_ADDRESS": head}, capture_output=True, text=True, timeout=300)
    assert gate.returncode == 0 and "ready" in gate.stdout, gate.stdout + gate.stderr
    ray_started(worker)
    step("worker node up; wait_for_resources: ready")

    serve = procs.popen(
        [str(BIN / "python"), "-m", "cluster.cli", "serve", "--address", "auto",
         "--model", str(tiny_model), "--device", "cpu", "--cpus-per-worker", "1",
         "--prefill-resources", "prefill_node=0.5", "--decode-resources", "decode_node=0.5",
         "--port", str(grpc_port), "--metrics-port", str(metrics_port),
         "--max-prefill-chunk", "11", "--kv-wait-timeout-s", "20",
         "--failure-timeout-s", "5", "--drain-timeout-s", "2"],
        {**env, "RAY_ADDRESS": head}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    out = LineReader(serve.stdout)
    try:
        out.wait_for(r"serving pdserve\.v1\.Generation on 127\.0\.0\.1:\d+", timeout=300)
        step("pdserve serving")
        client = PdserveClient(f"127.0.0.1:{grpc_port}", timeout=120)
        procs.on_exit.append(client.close)

        # 1. exact greedy tokens, prefill and decode on different Ray nodes
        assert client.health() == "SERVING"
        got = [list(client.complete(p, max_tokens=MAX_TOKENS, temperature=0.0,
                                    ignore_eos=True).token_ids) for p in PROMPTS]
        ref = LLM(str(tiny_model)).generate(
            PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
        assert got == [o.token_ids for o in ref]
        stats = client.stats()
        assert {w.role for w in stats.workers if w.alive} == {"prefill", "decode"}
        samples = until(lambda: scrape(metrics_port).get("pdserve:worker_alive"), 30,
                        "worker_alive gauges")
        assert {s.labels["role"]: s.value for s in samples} == {"prefill": 1.0, "decode": 1.0}

        step("tokens equal engine.LLM's; both workers alive")
        # 2. the decode node dies: its raylet (and the tree under it) is killed by pid
        raylets = [p for p in Procs.members(decode_node_group) if p.name() == "raylet"]
        assert len(raylets) == 1, [p.name() for p in Procs.members(decode_node_group)]
        tree = [*raylets[0].children(recursive=True), raylets[0]]
        for p in tree:  # one that exited since the listing is already where it should be
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGKILL)
        procs.kill_group(decode_node_group)  # the node's other daemons go with it

        step("decode node killed")

        def degraded():
            # (GetStats' `serving` only turns false on shutdown; health tracks the pools)
            seen = ({w.role: w.alive for w in client.stats().workers}, client.health())
            assert seen == ({"prefill": True, "decode": False}, "NOT_SERVING"), seen
            return True

        # only the decode worker was on that node: the pools really were on two nodes
        until(degraded, DEGRADED_WITHIN_S, "decode dead, prefill alive, NOT_SERVING")
        step("degraded: decode worker dead, NOT_SERVING")
        until(lambda: {s.labels["role"]: s.value
                       for s in scrape(metrics_port)["pdserve:worker_alive"]}
              == {"prefill": 1.0, "decode": 0.0}, 30, "pdserve:worker_alive{role=decode} == 0")

        # 3. a new request ends (UNAVAILABLE), bounded by the router's grace, not a hang
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            client.complete(PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0,
                            timeout=UNAVAILABLE_WITHIN_S)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, (
            err.value.code(), err.value.details(), time.monotonic() - t0)
        assert "decode" in (err.value.details() or "")
        step(f"new request: UNAVAILABLE after {time.monotonic() - t0:.1f}s")
    except BaseException:
        print(out.tail(), file=sys.stderr)
        raise
    # No graceful stop: the fixture kills the driver, the nodes and their workers by pid
    # (SIGTERM draining is covered by test_cli.py).
