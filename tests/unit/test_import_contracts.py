"""The architecture contracts of pyproject.toml's [tool.importlinter] (issue 12): layers
that import downward only, Ray and gRPC only where the design allows, no file cycles.

`lint-imports` checks the real tree; a synthetic tree with one back-import shows that
the layers contract does fail when a lower layer imports a higher one."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MY_CONTRACTS = ("pdserve-layers", "pdserve-ray-free", "pdserve-acyclic")


def lint_imports(cwd: Path, *contracts: str) -> subprocess.CompletedProcess:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.fail("lint-imports is missing: `make setup` installs import-linter (test extra)")
    args = [exe, "--no-cache"] + [a for c in contracts for a in ("--contract", c)]
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(cwd), "PATH": "/usr/bin:/bin"})


def test_the_tree_keeps_its_layers_its_ray_free_core_and_has_no_file_cycles():
    out = lint_imports(ROOT, *MY_CONTRACTS)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"Contracts: {len(MY_CONTRACTS)} kept, 0 broken." in out.stdout, out.stdout

def test_a_back_import_from_a_lower_layer_breaks_the_layers_contract(tmp_path):
    for pkg in ("engine", "kv_transfer", "runtime", "prefill_worker", "decode_worker",
                "cluster", "proto", "bench"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "cluster" / "router.py").write_text("import runtime.loop\n")
    (tmp_path / "runtime" / "loop.py").write_text("")
    (tmp_path / "runtime" / "messages.py").write_text("from cluster import router\n")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    out = lint_imports(tmp_path, "pdserve-layers")
    assert out.returncode != 0
    assert "runtime.messages -> cluster.router" in out.stdout, out.stdout

