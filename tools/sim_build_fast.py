"""Build the opt-in compiled simulator (`make sim-fast`): sim/compiled.py says what and why.

    python -m tools.sim_build_fast        # needs mypy (mypyc) and a C compiler

Copies the packages' sources into a fresh directory beside build/simfast/, compiles
``COMPILED`` there with mypyc (the extension modules land next to the copied .py files,
which Python then loads instead), writes the manifest of what it was built from, and
only then replaces build/simfast/: a failed build leaves the last good one (or none).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

from sim.compiled import BUILD, COMPILED, MANIFEST, ROOT, digest, source_files

# Third-party packages are not type-checked (numpy's stubs stay: they ship inline). The
# one error left in the compiled modules is a numpy array returned for Sequence[float]
# by TableCosts (engine/costs/model.py), which mypyc runs as any object.
MYPY_INI = """\
[mypy]
follow_imports = silent
ignore_missing_imports = True
[mypy-torch,torch.*,transformers,transformers.*,ray,ray.*,safetensors,safetensors.*,xxhash,xxhash.*,grpc,grpc.*,google.*,matplotlib,matplotlib.*,httpx,httpx.*,msgpack,msgpack.*]
follow_imports = skip
[mypy-engine.costs.model]
disable_error_code = override
"""


def main() -> int:
    tmp = BUILD.with_name(BUILD.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.perf_counter()
    files = source_files()
    for rel in files:
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, tmp / rel)
    (tmp / "mypy.ini").write_text(MYPY_INI)
    print(f"sim-fast: compiling {len(COMPILED)} modules with mypyc in {tmp} ...", flush=True)
    done = subprocess.run([sys.executable, "-m", "mypyc", "--config-file", "mypy.ini",
                           *COMPILED], cwd=tmp, capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stdout[-8000:] + done.stderr[-8000:], file=sys.stderr)
        print("sim-fast: mypyc failed; build/simfast is unchanged", file=sys.stderr)
        return 1
    for scratch in ("build", ".mypy_cache", "mypy.ini"):  # (the C sources, mypy's cache)
        p = tmp / scratch
        shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
    missing = [m for m in COMPILED if not list((tmp / m).parent.glob(
        (tmp / m).stem + ".cpython-*.so"))]
    if missing:
        print(f"sim-fast: no extension module for {missing}", file=sys.stderr)
        return 1
    manifest = {"python": sys.version.split()[0], "compiled": list(COMPILED),
                "files": {rel: digest(tmp / rel) for rel in files}}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    shutil.rmtree(BUILD, ignore_errors=True)
    tmp.rename(BUILD)
    print(f"sim-fast: built {BUILD} ({len(COMPILED)} modules compiled, {len(files)} files, "
          f"{time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
