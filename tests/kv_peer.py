"""A KV receiver in another process, hung then killed mid-stream: the connector fault
check shared by the tcp and torchdist tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from kv_transfer import KVChunk, TransferConfig, make_sender

REPO = Path(__file__).resolve().parents[1]

_CHILD = """
import sys, time
from kv_transfer import TransferConfig, make_receiver
connector, secret = sys.argv[1], bytes.fromhex(sys.argv[2])
rx = make_receiver(TransferConfig(connector=connector, secret=secret, failure_timeout_s=1.0))
print(rx.endpoint, flush=True)
while True:
    for c in rx.poll().chunks:
        rx.release(c)
    time.sleep(0.002)
"""


def wait_failed(tx, rid: str, limit_s: float) -> tuple[str, float]:
    """(reason, seconds) of `rid`'s failure on sender `tx`, polled within `limit_s`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        for r, why in tx.poll().failed:
            if r == rid:
                return why, time.monotonic() - t0
        time.sleep(0.01)
    raise AssertionError(f"{rid} not reported failed within {limit_s}s")


def stream_until_acked(tx, rid: str, endpoint: str, chunk: Callable[..., KVChunk]) -> None:
    """Queue 400 paced chunks of `rid` (still streaming when a signal lands) and wait for
    the link's first new ack."""
    acked = tx.stats()["links"].get(endpoint, {}).get("bytes_acked", 0)
    for i in range(400):
        tx.send(chunk(rid, i, i == 399, tokens=32), dest=endpoint)
    deadline = time.monotonic() + 30
    while tx.stats()["links"].get(endpoint, {}).get("bytes_acked", 0) == acked:
        assert time.monotonic() < deadline, "nothing acked"
        time.sleep(0.01)


def check_hung_then_killed(cfg: TransferConfig, chunk: Callable[..., KVChunk]) -> None:
    """One receiver process (starting one costs seconds): SIGSTOP it mid-stream (a hung
    peer: only missing heartbeats or a blocked send reveal it), resume it and check the
    sender reconnects, then SIGKILL it mid-stream (a dead peer). Each failure is seen
    within the failure timeout, and the sender holds no bytes at the end."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, cfg.connector, cfg.secret.hex()],
                             cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    tx = make_sender(cfg)
    try:
        endpoint = child.stdout.readline().strip()
        assert endpoint.startswith(f"{cfg.connector}://"), "receiver process did not start"
        stream_until_acked(tx, "hung", endpoint, chunk)
        os.kill(child.pid, signal.SIGSTOP)
        why, dt = wait_failed(tx, "hung", 15)
        assert dt <= cfg.failure_timeout_s + 1.0, (why, dt)
        os.kill(child.pid, signal.SIGCONT)
        tx.send(chunk("after", 0, True), dest=endpoint)  # a new link to the same receiver
        deadline = time.monotonic() + 15
        while "after" not in tx.poll().finished:
            assert time.monotonic() < deadline, "no new link after the receiver resumed"
            time.sleep(0.01)
        stream_until_acked(tx, "killed", endpoint, chunk)
        os.kill(child.pid, signal.SIGKILL)
        why, dt = wait_failed(tx, "killed", 15)
        assert dt <= cfg.failure_timeout_s + 1.0, (why, dt)
        assert tx.stats()["links"][endpoint]["connects"] == 2
        assert tx.stats()["inflight_bytes"] == 0 and tx.stats()["queued_bytes"] == 0
    finally:
        tx.close()
        child.kill()
        child.wait(timeout=10)
