"""tools/gpu_check on a machine without CUDA and with the GPU image's packages (no Ray):
it says so, skips the GPU steps, runs its CPU-safe parts (placement plan, KV host path,
engine and in-process 1P+1D service on the tiny model) and writes its JSON; the GPU
steps' modules import there; and the attention benchmark's L2 rotation and summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tools import attention_bw

ROOT = Path(__file__).resolve().parents[2]


# what the GPU image lacks (tools/gpu_check_plan.py NOT_NEEDED): absent in the check's run
IMAGE_LACKS = ("ray", "starlette", "uvicorn", "pydantic", "openai", "gguf", "grpc_health",
               "grpc_reflection")


def image_like(tmp_path: Path) -> str:
    """A PYTHONPATH whose sitecustomize makes IMAGE_LACKS unimportable (find_spec: None)."""
    d = tmp_path / "image"
    d.mkdir()
    (d / "sitecustomize.py").write_text(
        f"import sys\nfor m in {IMAGE_LACKS!r}:\n    sys.modules[m] = None\n")
    return os.pathsep.join((str(d), str(ROOT)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_gpu_check_skips_cleanly_and_runs_its_cpu_parts(tmp_path):
    """... on the GPU image's packages: no Ray (the in-process P/D path), no HTTP door."""
    out = tmp_path / "gpu.json"
    env = {**os.environ, "PYTHONPATH": image_like(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "tools.gpu_check", "--out", str(out), "--quick",
                        "--limit-scale", "5"],  # a loaded CI machine: the limits are for GPUs
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "no CUDA device: the GPU steps are skipped" in r.stderr
    doc = json.loads(out.read_text())
    assert doc["cuda"] is False and "no CUDA device" in doc["skipped_reason"]
    steps = doc["steps"]
    for name in ("pytest", "kernels_bf16", "engine_compiled", "attention_bw", "tp_one_gpu",
                 "decode_sweep"):
        assert steps[name] == {"status": "skipped", "reason": "no CUDA device"}
    for name in ("env", "model", "kv_export", "engine", "service"):
        assert steps[name]["status"] == "passed", (name, steps[name])
    assert "skipped: no CUDA device" in r.stderr and "engine: passed" in r.stderr
    assert steps["env"]["result"]["plan_1p1d_on_one_gpu"]["gpus"] == [0.5, 0.5]
    kv = steps["kv_export"]["result"]["results"][0]
    assert kv["bytes"] == kv["tokens"] * 32 * 2 * 8 * 128 * 2 and kv["export_ms"] > 0
    eng = steps["engine"]["result"]
    assert eng["greedy"]["output_tokens"] == eng["sampled"]["output_tokens"] > 0
    assert eng["kv_blocks_used_at_end"] == 0
    svc = steps["service"]["result"]
    same, total = svc["greedy_outputs_equal"].split("/")
    assert same == total  # fp32 on CPU: P/D gives the colocated engine's tokens
    assert svc["pd"]["failures"] == [] and svc["pd"]["kv_blocks_used_at_end"]["decode"] == 0
    assert "no Ray" in svc["pd"]["layout"] and steps["env"]["result"]["ray"] is None
    assert steps["env"]["result"]["missing_modules"] == []
    assert (tmp_path / "gpu.log").exists()


def test_the_gpu_steps_import_without_what_the_image_lacks(tmp_path):
    mods = ("tools.gpu_check_steps", "tools.tp_gpu_check", "tools.attention_bw",
            "tools.gpu_decode_step", "tools.gpu_check_service", "engine.tp_launch",
            "engine.attention.triton_ops", "tests.unit.test_engine_exactness",
            "tests.unit.test_kv_cache", "tests.unit.test_sampler",
            "tests.unit.test_bf16_numerics", "tests.logprobs_ref")
    code = "import importlib, sys\n" + "".join(f"importlib.import_module({m!r})\n" for m in mods)
    r = subprocess.run([sys.executable, "-c", code + "assert sys.modules['ray'] is None\n"],
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": image_like(tmp_path)},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


def test_a_bad_model_is_named(tmp_path):
    from tools.gpu_check import prepare_model, write_model

    with pytest.raises(SystemExit, match="neither a preset"):
        prepare_model(str(tmp_path / "nowhere"), cuda=True)
    with pytest.raises(SystemExit, match="neither a preset"):
        write_model(str(tmp_path / "nowhere"))


def test_unknown_steps_are_rejected(capsys):
    from tools.gpu_check import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--out", "x.json", "--steps", "env,warp"])
    assert "unknown steps ['warp']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args([])  # neither --out nor --dry-run
    assert "--out is required" in capsys.readouterr().err


@pytest.mark.parametrize("kv_bytes", [2 << 20, 8 << 20, 64 << 20, 4 << 30])
def test_rotation_defeats_the_l2(kv_bytes):
    l2 = 60 << 20  # H200
    n = attention_bw.rotating_sets(kv_bytes, l2)
    assert n * kv_bytes >= 4 * l2 or n == attention_bw.MAX_ROTATING_SETS
    assert n == 1 or (n - 1) * kv_bytes < 4 * l2


def test_summary_judges_against_the_read_bandwidth():
    rows = [{"context": 4096, "triton_ms": 1.0, "kv_bytes": 1 << 30, "fraction_of_copy_bw": 0.9,
             "fraction_of_read_bw": 0.6, "ratio_vs_torch": 3.0},
            {"context": 512, "triton_ms": 1.0, "kv_bytes": 1 << 20, "fraction_of_copy_bw": 0.2,
             "fraction_of_read_bw": 0.1}]
    s = attention_bw.summarize(rows)
    assert s["min_fraction_of_read_bw"] == 0.6 and s["contexts_ge_4k"] == 1
    assert s["goal_fraction_ge_0.70"] is False and s["goal_ratio_ge_2x"] is True
