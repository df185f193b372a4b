"""`pdserve serve --api-servers 2`: two front-door processes share one port over the same
1P+1D pools. Clients on separate connections (the kernel spreads them over both
processes) get exact greedy output; GetStats counts every front door's requests from any
connection; an Abort sent on another connection than the stream's ends it wherever it
runs; the pools end with no KV in use, and SIGINT stops every process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import psutil
import pytest

from cluster.grpc.convert import build_request
from engine import LLM, SamplingParams
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[2]
N_CONN = 8


@pytest.fixture(scope="module")
def two_doors(tiny_model):
    p = subprocess.Popen([sys.executable, "-m", "cluster.cli", "serve", "--port", "0",
                          "--model", str(tiny_model), "--api-servers", "2",
                          "--log-level", "warning"], cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    addr = ""
    lines = []
    for line in p.stdout:
        lines.append(line)
        if "serving pdserve.v1.Generation on" in line:
            addr = line.split(" on ", 1)[1].split()[0]
            break
    assert addr, "".join(lines[-30:])
    threading.Thread(target=lambda: [None for _ in p.stdout], daemon=True).start()
    try:
        yield p, addr
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
            try:
                p.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


def _stubs(addr: str) -> list:
    # one TCP connection each (no subchannel sharing), so SO_REUSEPORT spreads them
    chans = [grpc.insecure_channel(addr, options=[("grpc.use_local_subchannel_pool", 1)])
             for _ in range(N_CONN)]
    return chans, [pb_grpc.GenerationStub(c) for c in chans]


def _wait_idle(stub, timeout: float = 60.0) -> pb.GetStatsResponse:
    end = time.monotonic() + timeout
    while True:
        st = stub.GetStats(pb.GetStatsRequest(), timeout=30)
        if (st.num_inflight == 0 and all(w.kv_blocks_used == 0 for w in st.workers)) \
                or time.monotonic() > end:
            return st


def test_two_front_doors_serve_one_port_exactly_and_share_aborts_and_stats(two_doors,
                                                                          tiny_model):
    proc, addr = two_doors
    children = [c for c in psutil.Process(proc.pid).children(recursive=True)
                if "cluster.serve.front_door" in " ".join(c.cmdline())]
    assert len(children) == 1  # front door 0 is the serve process itself
    chans, stubs = _stubs(addr)
    prompts = [[(7 * i + j) % 500 + 3 for j in range(5 + i)] for i in range(N_CONN)]
    want = LLM(str(tiny_model)).generate(prompts, SamplingParams(temperature=0.0,
                                                                 max_tokens=12))
    for stub, prompt, w in zip(stubs, prompts, want, strict=True):
        got = [t for r in stub.Generate(build_request(prompt, max_tokens=12, temperature=0.0),
                                        timeout=120) for t in r.token_ids]
        assert got == w.token_ids

    # the longest requests the model allows, one per connection; every connection's
    # GetStats sees all of them
    max_len = stubs[0].GetModelInfo(pb.GetModelInfoRequest(), timeout=30).max_model_len
    calls = [stub.Generate(build_request(prompts[i], max_tokens=max_len - len(prompts[i]) - 1,
                                         temperature=0.0, ignore_eos=True,
                                         request_id=f"long-{i}"), timeout=300)
             for i, stub in enumerate(stubs)]
    firsts = [next(iter(c)) for c in calls]  # each has streamed its first token
    assert all(f.token_ids for f in firsts)
    for stub in stubs:
        assert stub.GetStats(pb.GetStatsRequest(), timeout=30).num_inflight == N_CONN
    # each request aborted from the next connection: found wherever its stream runs
    for i in range(N_CONN):
        r = stubs[(i + 1) % N_CONN].Abort(pb.AbortRequest(request_id=f"long-{i}"), timeout=30)
        assert r.found, i
    for c in calls:
        last = list(c)[-1]
        assert last.finish_reason == pb.FINISH_REASON_ABORT
    st = _wait_idle(stubs[0])
    assert st.num_inflight == 0
    assert all(w.alive and w.kv_blocks_used == 0 for w in st.workers), st
    for c in chans:
        c.close()

    proc.send_signal(signal.SIGINT)  # drains every front door, then the pools go
    assert proc.wait(90) == 0
    for c in children:
        assert not c.is_running() or c.status() == psutil.STATUS_ZOMBIE
