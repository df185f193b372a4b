"""The service starts on one GPU with the defaults: 1 prefill + 1 decode worker with
pools.gpus_per_worker 1.0 share the GPU (0.5 each, and the log says so), each actor gets
the GPU from Ray, and the colocated baseline is placed on the GPU too. Ray is started
with a fake GPU in its own process (this pytest process may be attached to another Ray);
the workers see no CUDA device and run on the CPU, with the same tokens as engine.LLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_start_on_one_gpu_with_fractional_shares(tiny_model):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    out = subprocess.run(
        [sys.executable, str(ROOT / "tests/integration/fake_gpu_check.py"), str(tiny_model)],
        capture_output=True, text=True, timeout=400, env=env, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert any("1 prefill + 1 decode workers share 1 GPU(s): 0.5 GPU each" in n
               for n in r["notes"]), r["notes"]
    assert any("2 colocated workers share 1 GPU(s)" in n for n in r["notes"]), r["notes"]
    for layout in ("pd", "colocated"):
        assert r[layout]["gpus_used"] == 1.0, r[layout]
        workers = r[layout]["workers"]
        assert len(workers) == 2
        for w in workers.values():
            # Ray gave each actor the one GPU and made it visible; torch sees no CUDA
            # device on this machine, so 'auto' resolves to the CPU
            assert w["gpu_ids"] == ["0"] and w["cuda_visible_devices"] == "0", w
            assert w["device"] == "cpu", w
    assert r["pd_equal"] and r["colocated_equal"]
