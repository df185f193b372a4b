"""The KV cache on a real GPU is sized from its free memory after the weights load."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from engine import memory  # noqa: E402
from engine.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from engine.kv_cache import KVCache  # noqa: E402
from engine.loader import load_model_config  # noqa: E402
from engine.model_runner import ModelRunner  # noqa: E402

pytestmark = pytest.mark.gpu


def cfg_for(model_dir, device: str, **cache) -> EngineConfig:
    # (tests/unit/test_kv_sizing.py has the same helper, but imports Ray via the launcher)
    return EngineConfig(str(model_dir), load_model_config(model_dir),
                        CacheConfig(block_size=16, **cache),
                        SchedulerConfig(max_model_len=4096, max_num_seqs=64), device=device,
                        dtype="bfloat16")


@pytest.mark.parametrize("share", [1.0, 0.5])
def test_runner_sizes_kv_from_mem_get_info_after_loading(tiny_model, share):
    cfg = cfg_for(tiny_model, device="cuda:0", gpu_share=share, gpu_memory_utilization=0.3)
    cfg = replace(cfg, scheduler=replace(cfg.scheduler, max_model_len=1 << 24))  # no cap
    torch.cuda.empty_cache()
    free0, total = torch.cuda.mem_get_info()
    runner = ModelRunner(cfg, None)
    kv_bytes = runner.num_blocks * KVCache.bytes_per_block(cfg.model, 16, torch.bfloat16)
    held = torch.cuda.memory_reserved()
    assert held <= 0.3 * share * total + (1 << 20), (held, total)
    assert kv_bytes >= 0.3 * share * total - held - memory.activation_reserve_bytes(
        cfg.model, cfg.scheduler, torch.bfloat16) - memory.runner_reserve_bytes(cfg) - (
        256 << 20)
    # the CUDA-graph tables (64 rows x 1M blocks: 256 MiB) were inside the reserve
    assert memory.runner_reserve_bytes(cfg) == 64 * (1 << 20) * 4
    assert kv_bytes < free0
    del runner
    torch.cuda.empty_cache()
