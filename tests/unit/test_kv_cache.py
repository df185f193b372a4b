"""KV cache export/import on the host path: byte-exact against a per-layer, per-token
reference, one tensor op each, any alignment of token ranges to blocks, layer ranges,
dtype conversion on import, and a clean fallback where pinned memory is unavailable.
Also the runner's per-step inputs: one packed upload, 16-byte aligned segments."""

from __future__ import annotations

import pytest
import torch

from engine import device as device_mod
from engine.config import ModelConfig
from engine.kv_cache import KVCache, slots_for

MODEL = ModelConfig("LlamaForCausalLM", 100, 32, 64, 3, 4, 2, 8, 1e-6, 512, False, False,
                    False, False, False)


def filled_cache(dtype=torch.bfloat16, num_blocks=12, block_size=5) -> KVCache:
    kv = KVCache(MODEL, num_blocks, block_size, dtype)
    g = torch.Generator().manual_seed(0)
    kv.data.copy_(torch.randn(kv.data.shape, generator=g).to(dtype))
    return kv


def reference_export(kv: KVCache, block_ids, start, end) -> torch.Tensor:
    out = torch.empty((kv.num_layers, 2, end - start) + tuple(kv.k[0].shape[2:]),
                      dtype=kv.dtype)
    for layer in range(kv.num_layers):
        for t in range(start, end):
            b, off = block_ids[t // kv.block_size], t % kv.block_size
            out[layer, 0, t - start] = kv.k[layer][b, off]
            out[layer, 1, t - start] = kv.v[layer][b, off]
    return out


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def test_slots_follow_the_global_token_index():
    blocks = [7, 2, 9, 4]
    for start, end in [(0, 20), (3, 4), (4, 16), (5, 5), (9, 20)]:
        want = [blocks[i // 5] * 5 + i % 5 for i in range(start, end)]
        assert slots_for(blocks, start, end, 5) == want


def test_layers_are_views_of_one_tensor():
    kv = filled_cache()
    assert kv.data.shape == (3, 2, 12, 5, 2, 8)
    kv.k[1][3, 2] = 42.0
    assert kv.data[1, 0, 3, 2].eq(42.0).all()
    assert all(k.is_contiguous() and v.is_contiguous() for k, v in zip(kv.k, kv.v, strict=True))


@pytest.mark.parametrize(("start", "end"), [(0, 20), (3, 17), (5, 10), (7, 8), (6, 6)])
def test_export_is_byte_exact(start, end):
    kv = filled_cache()
    blocks = [11, 0, 6, 3]  # shuffled, not contiguous
    out = kv.export_tokens(blocks, start, end)
    assert out.is_contiguous() and out.device.type == "cpu"
    assert out.shape == (3, 2, end - start, 2, 8)
    assert as_bytes(out) == as_bytes(reference_export(kv, blocks, start, end))


def test_export_is_one_gather_over_all_layers():
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.names: list[str] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.names.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    kv = filled_cache()
    with Count() as c:
        kv.export_tokens([4, 1, 8], 2, 13)
    assert c.names.count("index_select") == 1 and "copy_" not in c.names
    with Count() as c:
        kv.import_tokens([4, 1, 8], 2, torch.zeros(3, 2, 11, 2, 8, dtype=torch.bfloat16))
    assert c.names.count("index_copy_") == 1


@pytest.mark.parametrize("layer_start", [0, 1, 2])
def test_import_round_trips_byte_exact_in_another_block_layout(layer_start):
    src = filled_cache(block_size=5)
    payload = src.export_tokens([2, 9, 4, 0], 3, 19)[layer_start:]
    dst = KVCache(MODEL, 10, 4, torch.bfloat16)  # another block size, as on a decode worker
    before = dst.data.clone()
    blocks = [8, 1, 5, 2, 7]
    dst.import_tokens(blocks, 3, payload, layer_start=layer_start)
    back = dst.export_tokens(blocks, 3, 19)[layer_start:]
    assert as_bytes(back) == as_bytes(payload)
    # nothing outside the range and the layers was touched
    written = torch.zeros_like(dst.data, dtype=torch.bool)
    for t in range(3, 19):
        written[layer_start:, :, blocks[t // 4], t % 4] = True
    assert torch.equal(dst.data[~written], before[~written])


def test_import_converts_the_payload_dtype():
    src = filled_cache(dtype=torch.float32)
    payload = src.export_tokens([1, 2], 0, 10)
    dst = KVCache(MODEL, 4, 5, torch.bfloat16)
    dst.import_tokens([3, 0], 0, payload)
    assert torch.equal(dst.export_tokens([3, 0], 0, 10), payload.to(torch.bfloat16))


def test_the_async_export_on_cpu_is_ready_at_once():
    kv = filled_cache()
    pending = kv.export_async([1, 2, 3], 0, 12)
    assert pending.ready() and pending.event is None
    assert torch.equal(pending.wait(), kv.export_tokens([1, 2, 3], 0, 12))


def test_pinned_memory_falls_back_to_pageable_with_one_warning(monkeypatch, caplog):
    # this machine has no CUDA: pinning fails; the buffer is an ordinary tensor
    monkeypatch.setattr(device_mod, "_pin_failed", False)
    with caplog.at_level("WARNING", logger="engine.device"):
        a = device_mod.pinned_empty((3, 4), torch.bfloat16)
        b = device_mod.pinned_empty((5,), torch.int32)
    assert a.shape == (3, 4) and a.dtype == torch.bfloat16 and not a.is_pinned()
    assert b.shape == (5,) and b.dtype == torch.int32
    assert sum("pinned host memory unavailable" in r.message for r in caplog.records) == 1


def test_bytes_per_token_and_block():
    assert KVCache.bytes_per_token(MODEL, torch.bfloat16) == 3 * 2 * 2 * 8 * 2
    assert KVCache.bytes_per_block(MODEL, 16, torch.float32) == 3 * 2 * 2 * 8 * 4 * 16


# ---- the runner's per-step inputs ----------------------------------------------------------
def test_one_packed_upload_per_step_with_aligned_segments(tiny_model, monkeypatch):
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.loader import load_model_config
    from engine.model_runner import ModelRunner, SeqChunk, _StepBuffer

    cfg = EngineConfig(str(tiny_model), load_model_config(tiny_model), CacheConfig(4, 32),
                       SchedulerConfig())
    runner = ModelRunner(cfg, 32)
    uploads: list[torch.Tensor] = []
    real = _StepBuffer.upload

    def spy(self):
        t = real(self)
        uploads.append(t)
        return t

    monkeypatch.setattr(_StepBuffer, "upload", spy)
    seen: dict[str, torch.Tensor] = {}
    real_model = runner.model.forward

    def forward(ids, pos, k, v, meta):
        seen.update(ids=ids, pos=pos, slots=meta.slot_mapping, dt=meta.decode_block_tables,
                    pt=meta.prefill_block_tables, qsl=meta.prefill_query_start_loc)
        return real_model(ids, pos, k, v, meta)

    monkeypatch.setattr(runner.model, "forward", forward)
    chunks = [SeqChunk("a", (5,), 6, (3, 9), sample=True),
              SeqChunk("b", (7, 8, 9), 2, (1, 4), sample=True),
              SeqChunk("c", (10, 11), 0, (6,), sample=False)]
    ids, logits = runner.execute(chunks)
    assert len(uploads) == 1 and ids == ["a", "b"] and logits.shape[0] == 2
    base = uploads[0].data_ptr()
    for name, t in seen.items():
        assert t.dtype == torch.int32 and (t.data_ptr() - base) % 16 == 0, name
        assert t.untyped_storage().data_ptr() == uploads[0].untyped_storage().data_ptr()
    assert seen["ids"].tolist() == [5, 7, 8, 9, 10, 11]
    assert seen["pos"].tolist() == [6, 2, 3, 4, 0, 1]
    assert seen["slots"].tolist() == [9 * 4 + 2, 1 * 4 + 2, 1 * 4 + 3, 4 * 4 + 0, 24, 25]
    assert seen["dt"].tolist() == [[3, 9]] and seen["pt"].tolist() == [[1, 4], [6, 0]]
    assert seen["qsl"].tolist() == [0, 3, 5]
