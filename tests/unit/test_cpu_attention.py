"""The "cpu" attention backend (engine/attention/cpu_kernels.cpp): decode attention read
straight from the paged cache and the KV write, against the reference math (a softmax
over each sequence's keys gathered slot by slot); the build's fallback to the torch
reference; and greedy output equal to transformers' through the engine on it."""

from __future__ import annotations

import logging

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention import cpu_build, get_backend, torch_ref
from tests.unit.test_engine_exactness import hf_greedy, prompt


@pytest.fixture(scope="module")
def cpu():
    be = get_backend("cpu", "cpu")
    if be.name != "cpu":  # the build failed here: the fallback test covers that path
        pytest.skip(f"CPU ops unavailable: {cpu_build.load()}")
    return be


def _reference(q, k_cache, v_cache, table, n, scale):
    """softmax(q k^T * scale) v of one query row `[H, D]` over keys 0..n-1 of its table,
    query head h reading KV head h // (H / KVH), in float64."""
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    slots = torch.tensor([table[i // bs] * bs + i % bs for i in range(n)])
    k = k_cache.reshape(-1, kvh, k_cache.shape[3])[slots].double()  # [n, KVH, D]
    v = v_cache.reshape(-1, kvh, v_cache.shape[3])[slots].double()
    g = q.shape[0] // kvh
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # [n, H, D]
    w = torch.einsum("hd,nhd->hn", q.double(), k).mul(scale).softmax(-1)
    return torch.einsum("hn,nhd->hd", w, v)


def _case(block_size, heads, kv_heads, dim, lens, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // block_size) for n in lens) + 1  # one spare column: padding
    num_blocks = len(lens) * width + 3
    k = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g).to(dtype)
    v = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[:len(lens) * width]  # scattered blocks
    q = 2 * torch.randn(len(lens), heads, dim, generator=g)
    return (q, k, v, tables.view(len(lens), width).to(torch.int32),
            torch.tensor(lens, dtype=torch.int32))


@pytest.mark.parametrize("block_size", [1, 3, 16, 32])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"),
                         [(6, 2, 64), (4, 4, 16), (8, 1, 24), (9, 3, 64)])
def test_decode_reads_the_paged_cache_like_the_reference(cpu, block_size, heads, kv_heads,
                                                         dim):
    # ragged: one key, a partial block, exactly one block, several blocks and a partial one
    lens = [1, max(1, block_size - 1), block_size, 3 * block_size + 2, 70]
    q, k, v, tables, seq_lens = _case(block_size, heads, kv_heads, dim, lens)
    out = cpu.paged_decode_attention(q, k, v, tables, seq_lens, dim**-0.5)
    assert out.shape == q.shape and out.dtype == q.dtype
    for s, n in enumerate(lens):
        want = _reference(q[s], k, v, tables[s].tolist(), n, dim**-0.5)
        torch.testing.assert_close(out[s].double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(  # and like the torch backend's padded batch
        out, torch_ref.paged_decode_attention(q, k, v, tables, seq_lens, dim**-0.5))


def test_decode_of_one_sequence_splits_heads_and_of_a_batch_does_not_mix_rows(cpu):
    q, k, v, tables, seq_lens = _case(4, 6, 3, 32, [37])
    one = cpu.paged_decode_attention(q, k, v, tables, seq_lens, 0.2)
    torch.testing.assert_close(one[0].double(), _reference(q[0], k, v, tables[0].tolist(),
                                                           37, 0.2), rtol=1e-5, atol=1e-5)
    batch = _case(4, 6, 3, 32, [5, 37, 12, 1, 29, 64, 33, 8], seed=1)
    out = cpu.paged_decode_attention(*batch, 0.2)
    for s in range(8):  # each row alone gives the same row
        alone = cpu.paged_decode_attention(batch[0][s:s + 1], batch[1], batch[2],
                                           batch[3][s:s + 1], batch[4][s:s + 1], 0.2)
        torch.testing.assert_close(out[s:s + 1], alone)


def test_decode_on_a_bf16_cache_computes_in_fp32(cpu):
    q, k, v, tables, seq_lens = _case(8, 4, 2, 32, [9, 30], dtype=torch.bfloat16)
    q = q.bfloat16()
    out = cpu.paged_decode_attention(q, k, v, tables, seq_lens, 0.25)
    assert out.dtype == torch.bfloat16
    for s, n in enumerate([9, 30]):
        want = _reference(q[s].float(), k.float(), v.float(), tables[s].tolist(), n, 0.25)
        torch.testing.assert_close(out[s].double(), want, rtol=2e-2, atol=2e-2)


def test_decode_rejects_a_length_past_its_block_table(cpu):
    q, k, v, tables, _ = _case(4, 4, 2, 16, [5, 6])
    with pytest.raises(RuntimeError, match="out of its block table"):
        cpu.paged_decode_attention(q, k, v, tables, torch.tensor([5, 99], dtype=torch.int32),
                                   0.25)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_write_kv_scatters_strided_rows_and_skips_padding(cpu, slot_dtype):
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(5, 4 + 2 + 2, 16, generator=g)  # [T, H + 2 KVH, D]: k, v strided views
    k, v = qkv[:, 4:6], qkv[:, 6:]
    slots = torch.tensor([7, 0, 13, -1, -1], dtype=slot_dtype)  # two padding rows trail
    caches = [torch.zeros(4, 4, 2, 16) for _ in range(4)]
    cpu.write_kv(k, v, caches[0], caches[1], slots)
    torch_ref.write_kv(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert torch.equal(caches[0].view(-1, 2, 16)[13], k[2])
    with pytest.raises(RuntimeError, match="out of cache"):
        cpu.write_kv(k, v, caches[0], caches[1], torch.tensor([16, 0, 1, 2, 3]))


def test_auto_on_cpu_is_the_cpu_backend_with_the_torch_prefill(cpu):
    be = get_backend("auto", "cpu")
    assert be.name == "cpu"
    assert be.paged_prefill_attention is torch_ref.paged_prefill_attention
    assert be.paged_decode_attention is torch.ops.pdserve_cpu.paged_decode


def test_a_failed_build_falls_back_to_torch_and_says_why(monkeypatch, caplog):
    def broken():
        raise RuntimeError("Error building extension 'pdserve_cpu'\ng++: not found")

    monkeypatch.setattr(cpu_build, "_state", {})
    monkeypatch.setattr(cpu_build, "_build", broken)
    with caplog.at_level(logging.WARNING, logger="engine.attention.cpu_build"):
        be = get_backend("cpu", "cpu")
        assert get_backend("auto", "cpu").name == "torch"
    assert be.name == "torch" and be.paged_decode_attention is torch_ref.paged_decode_attention
    assert cpu_build.load() == "RuntimeError: g++: not found"
    warned = [r for r in caplog.records if "CPU attention ops unavailable" in r.getMessage()]
    assert len(warned) == 1 and "g++: not found" in warned[0].getMessage()  # once


def test_the_cpu_backend_is_cpu_only():
    with pytest.raises(ValueError, match="runs on the CPU"):
        get_backend("cpu", "cuda:0")


GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize(("block_size", "chunk"), [(1, 5), (4, 3), (16, 16), (32, 7)])
def test_greedy_on_the_cpu_backend_equals_transformers(cpu, tiny_model, block_size, chunk):
    llm = LLM(str(tiny_model), block_size=block_size, max_prefill_chunk=chunk,
              max_num_batched_tokens=40, attention_backend="cpu", compile="none")
    assert llm.runner.backend.name == "cpu"
    prompts = [prompt(n, seed=n) for n in (1, 6, 17, 33, 40)]
    outs = llm.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == hf_greedy(tiny_model, p, GREEDY.max_tokens)
    assert llm.block_manager.num_used_blocks == 0
    llm.block_manager.check_integrity()
