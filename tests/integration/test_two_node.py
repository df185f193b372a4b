"""Prefill on one Ray node, decode on another (two raylets on this machine), tcp KV link."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # tests/integration/test_deploy_cluster.py covers two nodes in `make test`
def test_two_node_cluster_same_tokens(tiny_model):
    # its own process: this pytest process may already be attached to another Ray
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, str(ROOT / "tests/integration/two_node_check.py"), str(tiny_model)],
        capture_output=True, text=True, timeout=400, env=env, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["prefill_node"] != result["decode_node"]
    assert result["equal"] is True
