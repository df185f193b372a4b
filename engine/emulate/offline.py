"""The EngineConfig of an in-process engine on the emulated accelerator:
``engine.LLM.from_config(emulated_engine_config("h200", "llama-3-8b"))`` is the reference a
soak or a test compares the emulated service's greedy tokens with, and the offline API.
(engine.llm is not imported here: it reaches engine.tp_driver, which picks this
package's runner.)"""

from __future__ import annotations

from engine.config import CacheConfig, EmulateConfig, EngineConfig, SchedulerConfig
from engine.emulate.model_dir import emulated_model_dir


def emulated_engine_config(costs: str, shape: str, *, block_size: int = 16,
                           kv_cache_memory_bytes: int = 1 << 30, max_num_seqs: int = 64,
                           max_num_batched_tokens: int = 512, max_model_len: int | None = None,
                           dtype: str = "bfloat16") -> EngineConfig:
    """EngineConfig of the emulated ``costs`` profile (or calibration file) running
    ``shape`` (its model directory written on first use)."""
    from engine.loader import load_model_config

    em = EmulateConfig(costs, shape)
    model_dir = emulated_model_dir(shape)
    model = load_model_config(model_dir)
    return EngineConfig(str(model_dir), model,
                        CacheConfig(block_size, None, kv_cache_memory_bytes, True),
                        SchedulerConfig(max_num_batched_tokens, max_num_seqs, None, True,
                                        max_model_len or model.max_position_embeddings),
                        dtype=dtype, emulate=em)
