"""KV export/import on CUDA: one gather into pinned host memory on a side stream, byte
for byte what the host path gives; imports land asynchronously and a step waits for the
blocks it reads; a P/D pair on one GPU gives engine.LLM's greedy tokens."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from engine.kv_cache import KVCache  # noqa: E402
from tests.unit.test_kv_cache import MODEL, as_bytes, reference_export  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda", 0)


def cuda_cache(num_blocks=64, block_size=16, dtype=torch.bfloat16, seed=0) -> KVCache:
    kv = KVCache(MODEL, num_blocks, block_size, dtype, DEV)
    g = torch.Generator(device=DEV).manual_seed(seed)
    kv.data.copy_(torch.randn(kv.data.shape, generator=g, device=DEV).to(dtype))
    return kv


@pytest.mark.parametrize(("start", "end"), [(0, 300), (5, 6), (17, 250), (40, 40)])
def test_export_matches_the_host_path_byte_for_byte(start, end):
    kv = cuda_cache()
    blocks = torch.randperm(64, generator=torch.Generator().manual_seed(1))[:20].tolist()
    pending = kv.export_async(blocks, start, end)
    out = pending.wait()
    assert out.device.type == "cpu" and out.is_contiguous() and pending.ready()
    if end > start:
        assert out.is_pinned()
    host = KVCache(MODEL, 64, 16, torch.bfloat16)
    host.data.copy_(kv.data.cpu())
    assert as_bytes(out) == as_bytes(reference_export(host, blocks, start, end))


def test_import_is_waited_for_by_the_blocks_a_step_reads():
    src = cuda_cache(seed=2)
    payload = src.export_tokens(list(range(10, 30)), 0, 300)
    dst = cuda_cache(seed=3)
    blocks = list(range(40, 60))
    other = dst.data[:, :, 0:8].clone()
    # keep the default stream busy so the side stream's import runs concurrently
    big = torch.randn(4096, 4096, device=DEV)
    for _ in range(20):
        big = big @ big.T / 4096
    dst.import_tokens(blocks, 0, payload)  # queued on the side stream after the matmuls
    dst.wait_imports(blocks)  # what ModelRunner.execute does for its batch's blocks
    # read on the default stream (as attention does): ordered after the import only by
    # the wait above
    back = dst.data[:, :, 40:60].reshape(MODEL.num_layers, 2, 320, 2, 8)[:, :, :300].cpu()
    assert as_bytes(back) == as_bytes(payload)
    assert torch.equal(dst.data[:, :, 0:8], other)  # untouched blocks
    torch.cuda.synchronize()
    assert not dst._imports or all(e.query() for e, _ in dst._imports)


def test_a_pd_pair_on_one_gpu_gives_the_colocated_tokens(tiny_model):
    from decode_worker.engine import DecodeEngine
    from decode_worker.scheduler import DecodeSchedulerConfig
    from engine import LLM, SamplingParams
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.loader import load_model_config
    from kv_transfer.config import TransferConfig
    from kv_transfer.registry import make_receiver, make_sender
    from prefill_worker.engine import PrefillEngine
    from prefill_worker.scheduler import PrefillSchedulerConfig
    from runtime.messages import DecodeTask, EventKind, PrefillTask

    model = load_model_config(tiny_model)
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    def cfg(block: int) -> EngineConfig:
        return EngineConfig(str(tiny_model), model, CacheConfig(block, 256, gpu_share=0.5),
                            SchedulerConfig(max_model_len=1024), device="cuda:0")

    tcfg = TransferConfig(connector="inproc")
    receiver, sender = make_receiver(tcfg, name="gpu-d"), make_sender(tcfg, name="gpu-p")
    try:
        prefill = PrefillEngine("prefill-0", cfg(16), PrefillSchedulerConfig(
            max_num_batched_tokens=64, max_prefill_chunk=23), sender, 256)
        decode = DecodeEngine("decode-0", cfg(8), DecodeSchedulerConfig(max_model_len=1024),
                              receiver, 256)
        g = torch.Generator().manual_seed(4)
        prompts = [torch.randint(1, 2000, (n,), generator=g).tolist() for n in (5, 40, 130)]
        outs: dict[str, list[int]] = {}
        for i, p in enumerate(prompts):
            rid = f"r{i}"
            assert decode.reserve(DecodeTask(rid, len(p), sp, model.eos_token_ids))
            prefill.add(PrefillTask(rid, tuple(p), sp, receiver.endpoint, model.eos_token_ids))
            outs[rid] = []
        for _ in range(2000):
            for ev in prefill.step() + decode.step():
                if ev.kind in (EventKind.FIRST_TOKEN, EventKind.TOKENS):
                    outs[ev.leg_id].extend(ev.token_ids)
            if all(len(t) == 10 for t in outs.values()) and not decode.has_work \
                    and not prefill.has_work:
                break
        ref = LLM(str(tiny_model), device="cuda:0", num_blocks=256)
        assert [outs[f"r{i}"] for i in range(3)] == [o.token_ids for o in ref.generate(prompts, sp)]
        for eng in (prefill, decode):
            eng.bm.check_integrity()
            assert eng.bm.num_used_blocks == 0
    finally:
        sender.close()
        receiver.close()


def test_a_pinned_receive_buffer_is_imported_without_staging_and_held_till_copied(
        monkeypatch):
    """Issue 37 item 6: a chunk received into the pool's pinned buffer goes to the device
    straight from it (no pageable-to-pinned copy on the engine's thread), and the pool
    does not lend that buffer again while the copy may still read it."""
    from engine import kv_cache as kv_mod
    from kv_transfer.buffers import BufferPool

    src = cuda_cache(seed=4)
    payload = src.export_tokens(list(range(10, 30)), 0, 300)
    pool = BufferPool(max_idle_bytes=64 << 20)  # pin=None: this process has a CUDA context
    raw = pool.get(payload.numel() * payload.element_size())
    assert raw.is_pinned()
    data = raw.view(payload.dtype).view(payload.shape)
    data.copy_(payload)
    staged = []
    real = kv_mod.pinned_empty
    monkeypatch.setattr(kv_mod, "pinned_empty", lambda *a: staged.append(a) or real(*a))
    dst = cuda_cache(seed=5)
    big = torch.randn(4096, 4096, device=DEV)
    for _ in range(20):  # the side stream's copy waits behind these
        big = big @ big.T / 4096
    blocks = list(range(40, 60))
    dst.import_tokens(blocks, 0, data)
    ptr = raw.data_ptr()
    del raw, data
    again = pool.get(payload.numel() * payload.element_size())
    assert staged == [] and again.data_ptr() != ptr  # held: not lent while in flight
    dst.wait_imports(blocks)
    back = dst.data[:, :, 40:60].reshape(MODEL.num_layers, 2, 320, 2, 8)[:, :, :300].cpu()
    assert as_bytes(back) == as_bytes(payload)
    torch.cuda.synchronize()
    dst.wait_imports([])
    assert dst._held == []  # let go once copied
