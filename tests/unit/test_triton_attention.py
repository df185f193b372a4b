"""Triton paged-attention kernels == torch reference, on CPU under TRITON_INTERPRET=1.

The interpreter is chosen when `triton.jit` decorates a kernel, so TRITON_INTERPRET=1 is
set while this module imports triton (and while its tests run, via an autouse fixture)
and restored afterwards, so it does not leak into other modules. If triton_ops was
already imported compiled for CUDA in this session (tests/gpu ran first on a GPU box),
this module skips: run `pytest tests/unit` on its own there.

Tolerance (fp32 in the interpreter): |triton - ref| <= 1e-5 + 1e-5 * |ref|.
"""

from __future__ import annotations

import ctypes
import math
import os

import pytest
import torch

_prev_interpret = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
try:
    triton = pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction

    from engine.attention import torch_ref, triton_decode, triton_ops, triton_prefill
finally:
    if _prev_interpret is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _prev_interpret

if not isinstance(triton_decode._decode_kernel, InterpretedFunction):
    pytest.skip(
        "triton_ops was imported compiled for CUDA earlier in this session; "
        "run the interpreter suite on its own: pytest tests/unit/test_triton_attention.py",
        allow_module_level=True,
    )

ATOL = RTOL = 1e-5
POISON_TAIL = 1e3  # finite junk in slots past seq_len (the reference masks, then multiplies)
GQA = {"gqa1": (2, 2), "gqa4": (8, 2), "gqa7": (14, 2)}  # (query heads, kv heads)
MATRIX = [
    pytest.param(bs, d, *GQA[g], id=f"bs{bs}-d{d}-{g}")
    for bs in (16, 32)
    for d in (64, 128)
    for g in GQA
]


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


@pytest.fixture(autouse=True, scope="module")
def _interpreter_session():
    prev = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    prev_threads = _openblas_threads(1)
    yield
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


# ---------------------------------------------------------------------------- decode

DECODE_LENS = [1, 15, 16, 17, 100, 300]  # one token, block edges, several hundred


@pytest.mark.parametrize(("block_size", "head_dim", "num_heads", "num_kv_heads"), MATRIX)
def test_decode_matches_reference(block_size, head_dim, num_heads, num_kv_heads):
    k_cache, v_cache, table = paged_cache(DECODE_LENS, block_size, num_kv_heads, head_dim)
    lens = torch.tensor(DECODE_LENS, dtype=torch.int32)
    q = rand(len(DECODE_LENS), num_heads, head_dim)
    scale = head_dim**-0.5
    out = triton_ops.paged_decode_attention(q, k_cache, v_cache, table, lens, scale)
    ref = torch_ref.paged_decode_attention(q, k_cache, v_cache, table, lens, scale)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(
    ("num_splits", "block_n"), [(1, 64), (3, 16), (7, 32), (64, 16)], ids=lambda x: str(x)
)
def test_decode_split_k_partitions(num_splits, block_n):
    # block_size 32 with 16-token tiles: partition edges fall inside pages; 64 splits
    # leave most partitions past the shorter sequences' ends (those programs exit)
    lens_list = [5, 33, 250, 161]
    k_cache, v_cache, table = paged_cache(lens_list, 32, 2, 64, extra_cols=2, seed=3)
    lens = torch.tensor(lens_list, dtype=torch.int32)
    q = rand(len(lens_list), 8, 64, seed=4)
    out = triton_decode.paged_decode(
        q, k_cache, v_cache, table, lens, 0.125, num_splits=num_splits, block_n=block_n
    )
    ref = torch_ref.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.125)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_zero_length_padding_row_gives_zeros(num_splits):
    lens_list = [40, 0, 7]
    k_cache, v_cache, table = paged_cache(lens_list, 16, 1, 64, seed=5)
    lens = torch.tensor(lens_list, dtype=torch.int32)
    q = rand(3, 4, 64, seed=6)
    out = triton_decode.paged_decode(q, k_cache, v_cache, table, lens, 0.1,
                                     num_splits=num_splits, block_n=16)
    ref = torch_ref.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.1)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(out[[0, 2]], ref[[0, 2]], atol=ATOL, rtol=RTOL)


def test_decode_strided_q_and_fp16():
    # q as a view into a fused qkv buffer (row stride != H*D); fp16 end to end
    lens_list = [3, 64, 129]
    k_cache, v_cache, table = paged_cache(lens_list, 16, 2, 64, dtype=torch.float16, seed=7)
    qkv = rand(3, (8 + 2 * 2) * 64, seed=8).half()
    q = qkv[:, : 8 * 64].view(3, 8, 64)
    lens = torch.tensor(lens_list, dtype=torch.int32)
    out = triton_ops.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.125)
    ref = torch_ref.paged_decode_attention(
        q.float(), k_cache.float(), v_cache.float(), table, lens, 0.125
    )
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)


# ---------------------------------------------------------------------------- prefill

# (cached prefix, chunk length) per sequence: a 1-token prompt, a whole prompt, a chunk
# starting and ending inside blocks, a decode row (q_len 1), a block-aligned chunk, a
# long chunk after a long prefix, and an idle sequence (q_len 0)
PREFILL_BATCH = [(0, 1), (0, 37), (45, 20), (100, 1), (16, 16), (250, 50), (7, 0)]


def prefill_inputs(batch, block_size, num_heads, num_kv_heads, head_dim, seed=0):
    seq_lens = [p + c for p, c in batch]
    k_cache, v_cache, table = paged_cache(seq_lens, block_size, num_kv_heads, head_dim,
                                          seed=seed)
    q_lens = torch.tensor([c for _, c in batch])
    qsl = torch.zeros(len(batch) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(q_lens, 0)
    q = rand(int(qsl[-1]), num_heads, head_dim, seed=seed + 1)
    return q, k_cache, v_cache, table, qsl, torch.tensor(seq_lens, dtype=torch.int32)


@pytest.mark.parametrize(("block_size", "head_dim", "num_heads", "num_kv_heads"), MATRIX)
def test_prefill_matches_reference(block_size, head_dim, num_heads, num_kv_heads):
    args = prefill_inputs(PREFILL_BATCH, block_size, num_heads, num_kv_heads, head_dim)
    scale = head_dim**-0.5
    out = triton_ops.paged_prefill_attention(*args, scale)
    ref = torch_ref.paged_prefill_attention(*args, scale)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


def test_prefill_in_chunks_equals_one_shot():
    # one 150-token prompt run as chunks 37 | 63 | 50 (edges inside 16-token blocks)
    # must give the same rows as the whole prompt at once: causal alignment by position
    q, k_cache, v_cache, table, _, _ = prefill_inputs([(0, 150)], 16, 8, 2, 64, seed=9)
    whole = triton_ops.paged_prefill_attention(
        q, k_cache, v_cache, table, torch.tensor([0, 150], dtype=torch.int32),
        torch.tensor([150], dtype=torch.int32), 0.125,
    )
    parts = []
    for a, b in [(0, 37), (37, 100), (100, 150)]:
        parts.append(triton_ops.paged_prefill_attention(
            q[a:b], k_cache, v_cache, table, torch.tensor([0, b - a], dtype=torch.int32),
            torch.tensor([b], dtype=torch.int32), 0.125,
        ))
    torch.testing.assert_close(torch.cat(parts), whole, atol=ATOL, rtol=RTOL)


def test_prefill_of_single_tokens_equals_decode():
    batch = [(0, 1), (31, 1), (64, 1), (200, 1)]
    q, k_cache, v_cache, table, qsl, lens = prefill_inputs(batch, 32, 14, 2, 64, seed=10)
    pre = triton_ops.paged_prefill_attention(q, k_cache, v_cache, table, qsl, lens, 0.125)
    dec = triton_ops.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.125)
    torch.testing.assert_close(pre, dec, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "block_q"),
    [(16, 1, 1), (16, 2, 2), (2, 2, 16), (4, 4, 32)],
    ids=["g16-bq1", "g8-bq2", "g1-bq16", "g1-bq32"],
)
def test_prefill_tile_shapes(num_heads, num_kv_heads, block_q):
    # many q-tiles per sequence (tile -> sequence binary search), BLOCK_M = 16 or 32
    batch = [(5, 3), (0, 20), (33, 9), (0, 2), (9, 0), (40, 12)]
    args = prefill_inputs(batch, 16, num_heads, num_kv_heads, 64, seed=11)
    out = triton_prefill.paged_prefill(*args, 0.1, block_q=block_q, block_n=16)
    ref = torch_ref.paged_prefill_attention(*args, 0.1)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(
    ("seed", "block_size", "gqa"), [(0, 1, "gqa4"), (1, 8, "gqa7"), (2, 32, "gqa1")],
    ids=["bs1-gqa4", "bs8-gqa7", "bs32-gqa1"],
)
def test_random_mixed_batches(seed, block_size, gqa):
    # random prefixes and chunk lengths; block sizes 1 and 8 are what the engine tests use
    g = torch.Generator().manual_seed(100 + seed)
    num_heads, num_kv_heads = GQA[gqa]
    n_seqs = int(torch.randint(2, 6, (1,), generator=g))
    prefixes = torch.randint(0, 200, (n_seqs,), generator=g).tolist()
    chunks = torch.randint(1, 60, (n_seqs,), generator=g).tolist()
    batch = list(zip(prefixes, chunks, strict=True))
    args = prefill_inputs(batch, block_size, num_heads, num_kv_heads, 64, seed=seed)
    out = triton_ops.paged_prefill_attention(*args, 0.125)
    ref = torch_ref.paged_prefill_attention(*args, 0.125)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)
    # the same caches as a decode batch: one query per sequence at its last position
    q, k_cache, v_cache, table, _, lens = args
    q1 = rand(len(batch), num_heads, 64, seed=seed + 50)
    out = triton_ops.paged_decode_attention(q1, k_cache, v_cache, table, lens, 0.125)
    ref = torch_ref.paged_decode_attention(q1, k_cache, v_cache, table, lens, 0.125)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


# ---------------------------------------------------------------------------- write_kv


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16], ids=str)
def test_write_kv_scatters_and_skips_padding(cache_dtype):
    num_blocks, block_size, kvh, d = 6, 16, 2, 64
    k_cache = rand(num_blocks, block_size, kvh, d, seed=12).to(cache_dtype)
    v_cache = rand(num_blocks, block_size, kvh, d, seed=13).to(cache_dtype)
    exp_k, exp_v = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([17, 3, -1, 95, 40, -1, 64], dtype=torch.int64)
    kv = rand(len(slots), 3 * kvh * d, seed=14)  # fused buffer: strided k / v views
    k = kv[:, : kvh * d].view(-1, kvh, d)
    v = kv[:, kvh * d : 2 * kvh * d].view(-1, kvh, d)
    keep = slots >= 0
    torch_ref.write_kv(k[keep], v[keep], exp_k, exp_v, slots[keep])
    triton_ops.write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, exp_k) and torch.equal(v_cache, exp_v)


def test_registry_resolves_triton_under_interpreter(monkeypatch):
    from engine.attention import get_backend

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    be = get_backend("triton", "cpu")
    assert be.name == "triton"
    assert be.paged_decode_attention is triton_ops.paged_decode_attention
    assert be.paged_prefill_attention is triton_ops.paged_prefill_attention
    assert be.write_kv is triton_ops.write_kv


def test_engine_greedy_with_triton_backend_equals_torch(tiny_model):
    # the whole engine (write_kv + decode + chunked prefill, as the model calls them)
    from engine import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 2000, (n,), generator=g).tolist() for n in (5, 17, 40)]
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(tiny_model), attention_backend=backend, block_size=8, max_prefill_chunk=13)
        assert llm.runner.backend.name == backend
        outs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs["triton"] == outs["torch"]


# ---------------------------------------------------------------------------- sm_90 build

# Compiles the kernels for an H100/H200 (sm_90) in a subprocess, where triton.jit compiles
# instead of interpreting: catches GPU-only lowering errors (layouts, dot shapes, shared
# memory) on a machine without a GPU. Exit 3 = this Triton lacks the API (skip).
_SM90_SCRIPT = r"""
import sys
sys.path.insert(0, sys.argv[1])
import torch
try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    target = GPUTarget("cuda", 90, 32)
except Exception as exc:
    print(f"no sm_90 compile API: {exc!r}"); sys.exit(3)
from engine.attention import triton_decode as D, triton_ops as O, triton_prefill as P

DIV16 = ("stride", "partition_size")
def build(name, fn, ptrs, consts, warps, stages):
    sig, attrs = {}, {}
    for i, arg in enumerate(fn.arg_names):
        if arg in consts:
            sig[arg] = "constexpr"
            continue
        sig[arg] = ptrs.get(arg, "fp32" if arg == "qk_scale" else "i32")
        runtime = fn.params[i].do_not_specialize  # never specialised by a launch
        if sig[arg].startswith("*") or (arg.startswith(DIV16) and not runtime):
            attrs[(i,)] = [["tt.divisibility", 16]]  # what a real launch specialises on
    try:
        src = ASTSource(fn, sig, constexprs=consts, attrs=attrs)
    except TypeError as exc:
        print(f"ASTSource API differs: {exc!r}"); sys.exit(3)
    k = triton.compile(src, target=target, options={"num_warps": warps, "num_stages": stages})
    assert k.metadata.shared <= 227 * 1024, (name, k.metadata.shared)
    print(name, "smem", k.metadata.shared)

def io(dt, *extra):
    t = {n: dt for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "k_ptr", "v_ptr")}
    t.update(block_tables_ptr="*i32", seq_lens_ptr="*i32", query_start_loc_ptr="*i32",
             part_acc_ptr="*fp32", part_m_ptr="*fp32", part_l_ptr="*fp32", slot_ptr="*i64")
    return t

cuda = torch.device("cuda")
for dt, tdt, group, split in [("*bf16", torch.bfloat16, 16, True), ("*fp32", torch.float32, 7, False)]:
    cfg = D.decode_config(tdt, 128, cuda)
    consts = dict(NUM_HEADS=8 * group, GROUP=group, GROUP_PAD=D.next_pow2(group, 16), HEAD_DIM=128,
                  D_PAD=128, BLOCK_SIZE=16, BLOCK_N=cfg["block_n"], SPLIT=split,
                  DOT_PREC=D.dot_precision(tdt))
    build(f"decode {dt} g{group} split={split}", D._decode_kernel, io(dt), consts,
          cfg["num_warps"], cfg["num_stages"])
build("reduce", D._decode_reduce_kernel, io("*bf16"),
      dict(NUM_HEADS=128, HEAD_DIM=128, D_PAD=128, SPLITS_PAD=64), 4, 1)
for dt, tdt, group, d in [("*bf16", torch.bfloat16, 4, 128), ("*fp32", torch.float32, 7, 128)]:
    gp = D.next_pow2(group)
    cfg = P.prefill_config(tdt, d, gp, cuda)
    consts = dict(GROUP=group, GROUP_PAD=gp, HEAD_DIM=d, D_PAD=d, BLOCK_SIZE=16,
                  BLOCK_Q=cfg["block_q"], BLOCK_N=cfg["block_n"], DOT_PREC=D.dot_precision(tdt))
    build(f"prefill {dt} g{group} d{d}", P._prefill_kernel, io(dt), consts,
          cfg["num_warps"], cfg["num_stages"])
build("write_kv", O._write_kv_kernel, io("*bf16"),
      dict(NUM_KV_HEADS=8, HEAD_DIM=128, H_PAD=8, D_PAD=128, BLOCK_SIZE=16), 4, 1)
"""


def test_kernels_compile_for_sm90():
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silence Triton 3.9's default warning
    proc = subprocess.run([sys.executable, "-c", _SM90_SCRIPT, root], env=env, cwd=root,
                          capture_output=True, text=True, timeout=900)
    if proc.returncode == 3:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("smem") == 6, proc.stdout


# ---------------------------------------------------------------------------- recompiles

_NO_SPECIALIZE_SCRIPT = r"""
import sys
sys.path.insert(0, sys.argv[1])
from engine.attention import triton_decode as D, triton_prefill as P
for fn, names in [(D._decode_kernel, D.DECODE_RUNTIME_INTS),
                  (D._decode_reduce_kernel, D.REDUCE_RUNTIME_INTS),
                  (P._prefill_kernel, P.PREFILL_RUNTIME_INTS)]:
    flags = {p.name: p.do_not_specialize for p in fn.params}
    assert all(flags[n] for n in names), (fn.fn.__name__, flags)
    print(fn.fn.__name__, sorted(n for n, f in flags.items() if f))
"""


def test_per_step_ints_are_not_specialised_by_compiled_kernels():
    # compiled (not interpreted) kernels, where specialisation happens: a subprocess
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _NO_SPECIALIZE_SCRIPT, root], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "_decode_kernel ['num_splits', 'partition_size', 'stride_bts']" in r.stdout
    assert "_prefill_kernel ['num_seqs', 'stride_bts']" in r.stdout


@pytest.mark.parametrize("num_seqs", [1, 16])
@pytest.mark.parametrize("extra_cols", [0, 15])  # table widths 1/16 and 16/31 blocks
def test_decode_with_values_a_launch_would_specialise_on(num_seqs, extra_cols):
    lens_list = [16 * (1 + (i % 2) * 15) if extra_cols == 0 else 1 + 37 * i
                 for i in range(num_seqs)]
    k_cache, v_cache, table = paged_cache(lens_list, 16, 2, 64, extra_cols=extra_cols,
                                          seed=num_seqs)
    lens = torch.tensor(lens_list, dtype=torch.int32)
    q = rand(num_seqs, 8, 64, seed=3)
    ref = torch_ref.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.125)
    for num_splits in (1, 2, 16):
        out = triton_decode.paged_decode(q, k_cache, v_cache, table, lens, 0.125,
                                         num_splits=num_splits, block_n=16)
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("batch", [[(0, 16)], [(16, 16)] * 16, [(0, 1)]], ids=["1seq", "16seq", "1tok"])
def test_prefill_with_values_a_launch_would_specialise_on(batch):
    args = prefill_inputs(batch, 16, 8, 2, 64, seed=len(batch))
    out = triton_ops.paged_prefill_attention(*args, 0.125)
    ref = torch_ref.paged_prefill_attention(*args, 0.125)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


def test_warmup_runs_every_kernel_variant_and_leaves_the_cache_clear(tiny_model, monkeypatch):
    from engine import LLM, SamplingParams

    llm = LLM(str(tiny_model), attention_backend="triton", block_size=8, num_blocks=80)
    splits: list[int] = []
    real = triton_decode.paged_decode

    def spy(q, k_cache, v_cache, block_tables, seq_lens, scale, **kw):
        n, _ = triton_decode.plan_splits(
            q.shape[0], k_cache.shape[2], block_tables.shape[1] * k_cache.shape[1],
            triton_decode.decode_config(q.dtype, q.shape[2], q.device)["block_n"], q.device)
        splits.append(n)
        return real(q, k_cache, v_cache, block_tables, seq_lens, scale, **kw)

    monkeypatch.setattr(triton_ops, "paged_decode", spy)
    llm.runner.warmup()
    assert 1 in splits and max(splits) > 1  # single-partition and split-K (+ reduce)
    assert llm.runner.kv.data.abs().sum() == 0  # block 0 cleared, nothing else written
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ref = LLM(str(tiny_model), block_size=8, num_blocks=80)
    prompt = list(range(3, 30))
    assert llm.generate([prompt], params)[0].token_ids == ref.generate([prompt], params)[0].token_ids
