"""Triton's interpreter on CPU for the kernel tests (tests/unit/test_triton_attention.py
and test_triton_compile.py): importing this module imports triton and the kernels of
engine.attention, the torch reference, the inputs both files build and the tolerance.

The interpreter is chosen when `triton.jit` decorates a kernel, so TRITON_INTERPRET=1 is
set while this module imports triton (and while a test module runs, via the
`triton_interpreter` fixture of tests/conftest.py, which holds interpreter_session()) and
restored afterwards, so it does not leak into other modules. Without triton, or if
triton_ops was already imported compiled for CUDA in this session (tests/gpu ran first on
a GPU box), the importing test module skips: run `pytest tests/unit` on its own there.

Tolerance (fp32 in the interpreter): |triton - ref| <= 1e-5 + 1e-5 * |ref|.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
from collections.abc import Iterator

import pytest
import torch

_prev_interpret = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
try:
    triton = pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction

    # the test modules import the kernels from here: interpreted, whoever imports first
    from engine.attention import torch_ref, triton_decode, triton_ops, triton_prefill  # noqa: F401
finally:
    if _prev_interpret is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _prev_interpret

if not isinstance(triton_decode._decode_kernel, InterpretedFunction):
    pytest.skip(
        "triton_ops was imported compiled for CUDA earlier in this session; run the "
        "interpreter suites on their own: "
        "pytest tests/unit/test_triton_attention.py tests/unit/test_triton_compile.py",
        allow_module_level=True,
    )

ATOL = RTOL = 1e-5
POISON_TAIL = 1e3  # finite junk in slots past seq_len (the reference masks, then multiplies)


def _openblas_threads(n: int) -> int | None:
    """Set the thread count of numpy's OpenBLAS (the interpreter's tl.dot is np.matmul) and
    return the previous one; None where no OpenBLAS is loaded. Small matmuls on a loaded
    2-core box run ~100x faster single-threaded (no spinning helper threads)."""
    try:
        with open("/proc/self/maps") as f:
            libs = {ln.split()[-1] for ln in f if "openblas" in ln.lower() and "/" in ln}
    except OSError:
        return None
    for path in sorted(libs):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix, suffix in [("scipy_openblas", "64_"), ("scipy_openblas", ""),
                               ("openblas", "64_"), ("openblas", "")]:
            get = getattr(lib, f"{prefix}_get_num_threads{suffix}", None)
            put = getattr(lib, f"{prefix}_set_num_threads{suffix}", None)
            if get is not None and put is not None:
                prev = int(get())
                put(n)
                return prev
    return None


@contextlib.contextmanager
def interpreter_session() -> Iterator[None]:
    """TRITON_INTERPRET=1 and single-threaded OpenBLAS while the block runs, both restored."""
    prev = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    prev_threads = _openblas_threads(1)
    try:
        yield
    finally:
        if prev_threads is not None:
            _openblas_threads(prev_threads)
        if prev is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = prev


def paged_cache(
    seq_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int,
    extra_cols: int = 0, dtype: torch.dtype = torch.float32, seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V caches and a shuffled, non-contiguous block table for `seq_lens`.

    Blocks no table references hold NaN (a kernel that reads them fails loudly); slots past
    a sequence's end and the padding columns' block hold large finite junk.
    """
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(need) + 4  # 3 never-referenced (NaN) blocks + 1 padding target
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)
    pad_block = int(perm[-1])
    table = torch.full((len(seq_lens), max(need, default=0) + extra_cols), pad_block,
                       dtype=torch.int32)
    used = {pad_block}
    start = 0
    for s, (n, nb) in enumerate(zip(seq_lens, need, strict=True)):
        table[s, :nb] = perm[start : start + nb]
        used.update(perm[start : start + nb].tolist())
        if n % block_size:  # tail of the last block
            last = int(perm[start + nb - 1])
            k_cache[last, n % block_size :] = POISON_TAIL
            v_cache[last, n % block_size :] = POISON_TAIL
        start += nb
    k_cache[pad_block] = POISON_TAIL
    v_cache[pad_block] = POISON_TAIL
    for b in set(range(num_blocks)) - used:
        k_cache[b] = float("nan")
        v_cache[b] = float("nan")
    return k_cache, v_cache, table


def rand(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def prefill_inputs(batch, block_size, num_heads, num_kv_heads, head_dim, seed=0):
    seq_lens = [p + c for p, c in batch]
    k_cache, v_cache, table = paged_cache(seq_lens, block_size, num_kv_heads, head_dim,
                                          seed=seed)
    q_lens = torch.tensor([c for _, c in batch])
    qsl = torch.zeros(len(batch) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(q_lens, 0)
    q = rand(int(qsl[-1]), num_heads, head_dim, seed=seed + 1)
    return q, k_cache, v_cache, table, qsl, torch.tensor(seq_lens, dtype=torch.int32)
