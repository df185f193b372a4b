"""`pdserve` subcommands against real servers (in-process main() and one subprocess)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.cli import main
from cluster.config import ServeConfig
from cluster.local_backend import LocalBackend
from cluster.server import BackgroundServer
from engine import LLM, SamplingParams

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(tiny_model):
    cfg = ServeConfig().with_values({"server.port": 0})
    with BackgroundServer(LocalBackend(LLM(str(tiny_model))), cfg) as srv:
        yield srv


def test_generate_streams_text_and_prints_usage(server, tiny_model, capsys):
    rc = main(["generate", "--addr", server.address, "--max-tokens", "10", "--temperature", "0",
               "--show-token-ids", "Readability counts."])
    assert rc == 0
    out, err = capsys.readouterr()
    want = LLM(str(tiny_model)).generate(["Readability counts."],
                                         SamplingParams(temperature=0.0, max_tokens=10))[0]
    assert out.startswith(want.text)
    assert f"token_ids: {want.token_ids}" in out
    assert re.search(r"finish=length prompt=\d+ completion=10 .*ttft=[\d.]+ms", err)


def test_generate_reports_server_errors(server, capsys):
    rc = main(["generate", "--addr", server.address, "--max-tokens", "0", "hi"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "INVALID_ARGUMENT" in err and "max_tokens" in err
    assert main(["generate", "--addr", server.address, "--token-ids", "5,6,7",
                 "--max-tokens", "3", "--temperature", "0"]) == 0


def test_stats_prints_the_worker_table(server, capsys):
    assert main(["stats", "--addr", server.address]) == 0
    out = capsys.readouterr().out
    assert "WORKER" in out and "KV_FREE" in out and "SEND_Q" in out
    assert re.search(r"colocated-0\s+colocated\s+yes\s+0\s+0\s+0\s+\d+", out)
    assert "serving=yes" in out


def test_make_model_writes_a_loadable_dir(tmp_path, capsys):
    out_dir = tmp_path / "m"
    assert main(["make-model", "--preset", "tiny", "--arch", "qwen2", "--out", str(out_dir)]) == 0
    assert (out_dir / "config.json").exists() and (out_dir / "model.safetensors").exists()
    assert str(out_dir) in capsys.readouterr().out


def test_demo_colocated_streams_four_requests(tiny_model, capsys):
    assert main(["demo", "--colocated", "--model", str(tiny_model),
                 "--demo-max-tokens", "6"]) == 0
    out = capsys.readouterr().out
    for name in ("short-0", "short-1", "short-2", "long"):
        assert re.search(rf"{name}: prompt=\s*\d+ tok\s+completion=\s*6 tok", out), name
    assert "colocated-0" in out and "demo: stopped cleanly" in out


def test_serve_subprocess_answers_and_drains_on_sigint(tiny_model, capsys):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "serve", "--colocated", "--model", str(tiny_model),
         "--port", "0", "--drain-timeout-s", "5"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # "pdserve: serving ... on HOST:PORT (...)"
        match = re.search(r"on (127\.0\.0\.1:\d+)", line)
        assert match, (line, proc.stderr.read() if proc.poll() is not None else "")
        addr = match.group(1)
        assert main(["generate", "--addr", addr, "--max-tokens", "4", "hello"]) == 0
        assert "completion=4" in capsys.readouterr().err
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=30)
        err = proc.stderr.read()
        assert rc == 0, err
        assert "draining" in err and "server stopped" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
