"""Regenerate the committed Python stubs of `proto/pdserve/v1/pdserve.proto`.

    python -m proto.generate            # rewrite proto/pdserve/v1/pdserve_pb2*.py(i)
    python -m proto.generate --out DIR  # write them under DIR/pdserve/v1/ instead

protoc names the stub modules after the proto path (`pdserve/v1/...`), so the gRPC stub
says `from pdserve.v1 import pdserve_pb2`, which only works with `proto/` on sys.path.
We rewrite that import to the package path `proto.pdserve.v1`, so the stubs import as
`from proto.pdserve.v1 import pdserve_pb2` with no sys.path tricks. Each stub also gets
a `# ruff: noqa` first line: generated code is exempt from the linter.
tests/unit/test_proto_sync.py regenerates into a temp dir and compares.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from importlib import resources
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent  # the -I root: files are "pdserve/v1/*.proto"
PROTO_FILES = ("pdserve/v1/pdserve.proto",)
PACKAGE_PREFIX = "proto"  # the Python package that holds PROTO_ROOT
STUB_SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")

NOQA = "# ruff: noqa\n"
_IMPORT_RE = re.compile(r"^from pdserve\.v1 import ", re.MULTILINE)


def stub_paths(root: Path) -> list[Path]:
    """Every generated file under `root` (a directory laid out like PROTO_ROOT)."""
    out = []
    for proto in PROTO_FILES:
        stem = proto[: -len(".proto")]
        out.extend(root / f"{stem}{suffix}" for suffix in STUB_SUFFIXES)
    return out


def generate(out_dir: Path = PROTO_ROOT) -> list[Path]:
    """Run protoc (grpc_tools) for every proto file into `out_dir`; returns the stubs.

    protoc runs in a child interpreter: its compiler library must not load into a process
    that already holds other native libraries bundling protobuf or abseil (a NIXL agent's
    UCX plug-ins: the import then crashes the process, as it crashed the test session)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = resources.files("grpc_tools") / "_proto"
    for proto in PROTO_FILES:
        (out_dir / proto).parent.mkdir(parents=True, exist_ok=True)
        args = [
            sys.executable, "-m", "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{well_known}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            proto,
        ]
        run = subprocess.run(args, capture_output=True, text=True, timeout=300)
        if run.returncode != 0:
            raise RuntimeError(f"protoc failed on {proto} (exit {run.returncode}): "
                               f"{run.stderr.strip()[-2000:]}")
    stubs = stub_paths(out_dir)
    for path in stubs:
        text = _IMPORT_RE.sub(f"from {PACKAGE_PREFIX}.pdserve.v1 import ", path.read_text())
        # Generated code is not ours to restyle (pyproject's ruff exclude misses .pyi).
        path.write_text(text if text.startswith(NOQA) else NOQA + text)
    return stubs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m proto.generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=PROTO_ROOT,
                        help="root to write stubs under (default: the proto/ package)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
