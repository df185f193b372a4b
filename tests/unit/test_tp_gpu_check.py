"""tools/tp_gpu_check.py: without CUDA it records a skip and exits 0; `--device cpu` runs
the same checks over gloo (exact against transformers) and writes them as JSON."""

from __future__ import annotations

import json

import torch

from tools.tp_gpu_check import main


def test_without_cuda_the_check_is_skipped_cleanly(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "tp.json"
    assert main(["--out", str(out), "--tp", "2,4"]) == 0
    doc = json.loads(out.read_text())
    assert doc["skipped"] == "no CUDA device" and doc["results"] == []


def test_the_cpu_run_is_exact_and_reports_both_rates(tmp_path, tiny_model):
    out = tmp_path / "tp.json"
    assert main(["--out", str(out), "--device", "cpu", "--model", str(tiny_model), "--tp", "2",
                 "--prompts", "2", "--prompt-len", "9", "--max-tokens", "4"]) == 0
    doc = json.loads(out.read_text())
    (r,) = doc["results"]
    assert r["tp"] == 2 and r["exact_vs_tp1"] and r["exact_vs_transformers"]
    assert doc["tp1"]["exact_vs_transformers"] and r["tok_per_s"] > 0
    assert r["speedup_vs_tp1"] == round(r["tok_per_s"] / doc["tp1"]["tok_per_s"], 3)
