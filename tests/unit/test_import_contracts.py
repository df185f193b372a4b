"""The import contracts of pyproject.toml ([tool.importlinter], run by `lint-imports`) hold:
layers that import downward only, Ray and gRPC only where the design allows, no file
cycles, bench-only packages out of the service. Synthetic back-imports show that the
contracts do fail on what they forbid."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(cwd: Path, *contracts: str, env: dict | None = None
                 ) -> subprocess.CompletedProcess:
    """`lint-imports` on the tree at ``cwd`` (its pyproject.toml; ``cwd`` first on the path)."""
    if not LINT_IMPORTS.exists():
        pytest.fail(f"{LINT_IMPORTS} missing: `make setup` installs import-linter (test extra)")
    args = [str(LINT_IMPORTS), "--no-cache"] + [a for c in contracts for a in ("--contract", c)]
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=300, env=env)


def contract_names() -> list[str]:
    """The ``name`` of every [[tool.importlinter.contracts]] table (no tomllib on 3.10)."""
    text = (ROOT / "pyproject.toml").read_text().split("[tool.importlinter]", 1)[1]
    names = re.findall(r'^name = "(.+)"$', text, re.M)
    assert len(names) == text.count("[[tool.importlinter.contracts]]") > 0
    return names


def test_every_import_contract_is_kept() -> None:
    run = lint_imports(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    kept = " ".join(run.stdout.split())  # long names wrap
    assert all(f"{name} KEPT" in kept for name in contract_names()), run.stdout


@pytest.mark.parametrize("file,line,broken", [
    ("bench/studies/link.py", "import bench.studies.common", "no cycles"),
    ("bench/metrics.py", "import bench.cli", "CLI -> study runner"),
    ("bench/workload.py", "import bench.studies.common", "CLI -> study runner"),
    ("sim/options.py", "import sim.cluster", "at run time"),
    ("cluster/router/types.py", "import sim.loop", "import downward only"),
    ("bench/soak_plan.py", "import tests.conftest", "not installed"),
    ("cluster/router/pool.py", "import cluster.launch.placement", "the router"),
    ("cluster/grpc/intake.py", "import cluster.http.protocol", "the router"),
])
def test_a_back_import_breaks_a_contract(tmp_path: Path, file: str, line: str,
                                         broken: str) -> None:
    for package in {"bench", "sim", "tools", file.split("/")[0]}:
        shutil.copytree(ROOT / package, tmp_path / package)
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    with open(tmp_path / file, "a", encoding="utf-8") as f:
        f.write(f"\n{line}  # the back-import under test\n")
    run = lint_imports(tmp_path)
    assert run.returncode != 0, run.stdout
    report = " ".join(run.stdout.split())
    assert any(broken in n and f"{n} BROKEN" in report for n in contract_names()), run.stdout


BENCH_EXTRA = ("matplotlib", "tqdm")  # pyproject.toml's [bench] extra
NO_BENCH_EXTRA = f"""
import sys
tried = []

class NotInstalled:  # as if `pip install pdserve` without [bench]
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BENCH_EXTRA!r}:
            tried.append(name)
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)

sys.meta_path.insert(0, NotInstalled())
import cluster.cli, cluster.http.asgi_server, cluster.launch.launcher, cluster.serve.server, engine.llm
args = cluster.cli.build_parser().parse_args(["serve"])
assert args.command == "serve" and "bench" in cluster.cli.COMMANDS, cluster.cli.COMMANDS
print("tried:", sorted(set(tried)))
"""


def test_the_server_imports_and_parses_serve_without_the_bench_extra() -> None:
    run = subprocess.run([sys.executable, "-c", NO_BENCH_EXTRA], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    # torch.hub tries tqdm and falls back; nothing of ours reaches for matplotlib
    assert "matplotlib" not in run.stdout.split("tried:")[1], run.stdout


def test_a_back_import_from_a_lower_layer_breaks_the_layers_contract(tmp_path: Path) -> None:
    for pkg in ("engine", "kv_transfer", "runtime", "prefill_worker", "decode_worker",
                "cluster", "proto", "bench", "sim", "tools"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "cluster" / "router.py").write_text("import runtime.loop\n")
    (tmp_path / "runtime" / "loop.py").write_text("")
    (tmp_path / "runtime" / "messages.py").write_text("from cluster import router\n")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    run = lint_imports(tmp_path, "pdserve-layers",
                       env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert run.returncode != 0
    assert "runtime.messages -> cluster.router" in run.stdout, run.stdout
