"""Build and load the CPU ops once per machine and process: attention (cpu_kernels.cpp)
and the Llama layer's elementwise glue (engine/models/cpu_glue.cpp), one library.

The library is compiled by `torch.utils.cpp_extension.load` (g++ and ninja) into
`$PDSERVE_EXT_DIR` (default `~/.cache/pdserve/torch_extensions`), in a folder named after
the source's hash and the torch version, so a changed kernel or another torch never loads
a stale build; later processes load the cached library in milliseconds. The build time
is logged once (about 10 s on a 2-core machine). Where the build or the load fails, the
reason is logged and `load()` returns it: the "cpu" backend then falls back to the torch
reference (engine/attention/registry.py).

The ops, once loaded: `torch.ops.pdserve_cpu.paged_decode(q, k_cache, v_cache,
block_tables, seq_lens, scale)` and `torch.ops.pdserve_cpu.write_kv(k, v, k_cache, v_cache,
slot_mapping)`, with the contract of engine/attention/base.py; `rms_norm`, `add_rms_norm`
and `rope` (engine/models/llama.py uses them on fp32 CPU steps); `pack_rows`, `gemv` and
`decode_layers` (engine/models/cpu_step.py: a decode step's layers as one call).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

_MODELS = Path(__file__).parents[1] / "models"
SOURCES = (Path(__file__).with_name("cpu_kernels.cpp"),  # attention: decode, KV write
           _MODELS / "cpu_glue.cpp",  # norms, rotary
           _MODELS / "cpu_step.cpp")  # packed GEMV, the fused decode stack
HEADERS = (_MODELS / "cpu_rows.h",)  # in the digest: a changed header rebuilds
CFLAGS = ("-O3", "-march=native", "-fopenmp")  # built where it runs: see _digest
# -fopenmp: at::parallel_for is a header template that runs serially unless the including
# code is compiled with OpenMP (with -fopenmp-simd alone every kernel ran on one thread);
# the library's libgomp.so.1 is torch's own, already loaded, so there is one thread pool
LDFLAGS = ("-fopenmp",)
_lock = threading.Lock()
_state: dict[str, str | None] = {}  # "error": None once loaded, else the failure


def build_dir(digest: str) -> Path:
    root = os.environ.get("PDSERVE_EXT_DIR") or Path.home() / ".cache/pdserve/torch_extensions"
    return Path(root) / f"pdserve_cpu_{digest}"


def _cpu_flags() -> str:
    """This CPU's feature flags: `-march=native` code is only loaded on a matching CPU
    (a home directory shared by different machines keeps one build per CPU kind)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _digest() -> str:
    import torch

    h = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS))
    h.update(f"{torch.__version__} {CFLAGS} {LDFLAGS} {_cpu_flags()}".encode())
    return h.hexdigest()[:16]


def _build() -> None:
    import torch
    from torch.utils.cpp_extension import load as load_extension

    digest = _digest()
    where = build_dir(digest)
    where.mkdir(parents=True, exist_ok=True)
    name = f"pdserve_cpu_{digest}"
    cached = (where / f"{name}.so").exists()
    t = time.perf_counter()
    load_extension(name, [str(p) for p in SOURCES], extra_cflags=list(CFLAGS),
                   extra_ldflags=list(LDFLAGS), build_directory=str(where),
                   is_python_module=False, verbose=False)
    took = time.perf_counter() - t
    if not all(hasattr(torch.ops.pdserve_cpu, op) for op in ("paged_decode", "rope", "decode_layers")):
        raise RuntimeError(f"{where}: the library loaded but registered no pdserve_cpu ops")
    if cached:
        log.info("CPU attention ops loaded from %s in %.2f s", where, took)
    else:
        log.warning("CPU attention ops built in %.1f s (once; cached in %s)", took, where)


def load() -> str | None:
    """Build (first time on this machine) and load the ops into this process; returns
    None when they are usable, else why not (also logged, once per process)."""
    with _lock:
        if "error" not in _state:
            try:
                _build()
                _state["error"] = None
            except Exception as e:  # noqa: BLE001 - any build failure means: use the fallback
                last = str(e).strip().splitlines()[-1:]  # a build error's last line says why
                reason = f"{type(e).__name__}: {last[0] if last else 'no message'}"
                _state["error"] = reason
                log.warning("CPU attention ops unavailable (%s); attention runs on the torch "
                            "reference kernels", reason)
        return _state["error"]
